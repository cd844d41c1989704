"""Time to first token of a fresh process's first request, against the same request again.

    .venv/bin/python bench/first_answer.py [--model PATH | --synthetic dense|v4|qwen35|dense-small|v4-tiny]
        [--device cpu|cuda] [--dtype bfloat16] [--tokens 3000] [--new-tokens 16] [--repeats 3]
        [--cache user|fresh] [--cudnn-attention] [--no-row-buckets] [--out DIR]

Each run is a FRESH Python process (this script with --child): it imports the engine, loads the
model (with the load's warm-up stage, or with --no-warm-up semantics), then sends one request (a
prompt of --tokens token ids, greedy, --new-tokens new tokens, no snapshot reuse) twice. The first
is what a user waits for after a start; the second is the warm figure it should match. A third
request, 37 tokens shorter, is a prompt length no earlier request ran (`other_length_ttft_s`); a
fourth, of 1,000 tokens when the prompt is longer, a length of another class of Triton's integer
specialisation (`aligned_chunks_ttft_s`). Runs with and without warm-up alternate, --repeats each,
and the medians are compared.

Per variant: `load_s` (the load as reported, its warm-up included), `warm_up_s`, `first_ttft_s` and
`second_ttft_s` (GenerateStats.time_to_first_token_s: prefill and the first sample), their ratio,
and `start_to_first_token_s`, the wall time from the process's spawn to the first token (imports,
load, warm-up and the first request: what the person at the keyboard waits).

`--cache user` keeps Triton's and inductor's caches in the user's data directory (as `ds4desk`
does); one unmeasured run primes it first. `--cache fresh` gives every run an empty cache: the cost
of a first start ever.

Synthetic models (random weights, a byte-level tokenizer), written once to --work:
`dense` Qwen3-0.6B's shapes (28 layers, hidden 1024, bf16), `v4` bench/gpu_deepseek_v4.py's
DeepSeek-V4-Flash-shaped model, `qwen35` bench/qwen35_gpu.py's 8-layer Qwen3.5 of Qwen3.5-9B's
shapes, `dense-small` and `v4-tiny` small ones for a CPU smoke run.
Each run also lists the Triton kernels each request compiled or read from the disk cache
(`triton_compiles`: name and argument specialisation, from Triton's jit_cache_hook), the work a
warm-up should have done. Prints one JSON line; --out also writes it under that folder.
"""

from __future__ import annotations

import time

SPAWNED = time.time()  # as early as this process can see: a child's imports come after

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

DENSE_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
DENSE_SMALL = {**DENSE_06B, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512}
DENSE_SMALL |= {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
SYNTHETIC = ("dense", "v4", "qwen35", "dense-small", "v4-tiny")
ALIGNED_CHUNKS_LENGTH = 1000


# --- the synthetic models ---------------------------------------------------------------------------


def write_dense(folder: Path, config: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    from ds4desk.engine.make_tiny import write_tokenizer

    hidden, ffn, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_width, kv_width = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    gen = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(width: int) -> torch.Tensor:
        return torch.ones(width, dtype=torch.bfloat16)

    state = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden),
        "model.norm.weight": ones(hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": normal(q_width, hidden),
            p + "self_attn.k_proj.weight": normal(kv_width, hidden),
            p + "self_attn.v_proj.weight": normal(kv_width, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_width),
            p + "self_attn.q_norm.weight": ones(head),
            p + "self_attn.k_norm.weight": ones(head),
            p + "mlp.gate_proj.weight": normal(ffn, hidden),
            p + "mlp.up_proj.weight": normal(ffn, hidden),
            p + "mlp.down_proj.weight": normal(hidden, ffn),
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder, config["vocab_size"])


def synthetic_folder(kind: str, work: Path) -> Path:
    """The synthetic model's folder under `work`, written on first use."""
    folder = work / f"first-answer-{kind}"
    if (folder / "config.json").is_file():
        return folder
    if kind in ("dense", "dense-small"):
        write_dense(folder, DENSE_06B if kind == "dense" else DENSE_SMALL)
    elif kind == "v4":
        from gpu_deepseek_v4 import write_model

        write_model(folder)
    elif kind == "qwen35":
        import torch
        from qwen35_gpu import QWEN35_9B_LAYERS, random_state, write_folder

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        write_folder(folder, QWEN35_9B_LAYERS, random_state(QWEN35_9B_LAYERS, device), None)
    else:
        from ds4desk.engine.make_tiny import make_tiny

        make_tiny("deepseek_v4", folder, seed=0)
    return folder


# --- one fresh process --------------------------------------------------------------------------


def child(config: dict[str, Any]) -> None:
    """Load, then the same request twice and a shorter one; one JSON line on stdout."""
    if config["cache_dir"]:
        os.environ["TRITON_CACHE_DIR"] = str(Path(config["cache_dir"]) / "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(config["cache_dir"]) / "torchinductor")
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest
    from ds4desk.engine import runtime as runtime_module

    runtime_module.CUDNN_ATTENTION = config.get("cudnn_attention", False)
    from ds4desk.engine.models.deepseek_v4 import ops as v4_ops
    from ds4desk.engine.models.llama import model as dense_model
    from ds4desk.engine.models.qwen3_5 import model as qwen35_model

    padded = config.get("row_buckets", True)
    dense_model.PAD_PREFILL_ROWS = v4_ops.PAD_PRODUCT_ROWS = qwen35_model.PAD_PRODUCT_ROWS = padded

    compiled = _log_triton_compiles()
    imported = time.time()
    engine = Engine()
    try:
        request = LoadRequest(
            path=config["model"],
            device=config["device"],
            dtype=config["dtype"],
            context=config["tokens"] + config["new_tokens"] + 64,
            warm_up=config["warm_up"],
        )
        loaded = engine.load(request)
        if not loaded.ok:
            raise SystemExit(f"load failed: {loaded.error}")
        assert loaded.info is not None
        vocab = config["vocab"]
        ids = prompt_ids(config["tokens"], vocab)
        runs = []
        compiles: dict[str, list[str]] = {}
        # The third: a prompt of a length neither request nor the warm-up ran (what a new prompt costs).
        # The fourth: 1,000 tokens, not a multiple of 16 but 16 chunks of 64: a class of Triton's
        # integer specialisation (1, a multiple of 16, other) that neither the warm-up's lengths nor
        # the requests before meet.
        other = ids[: max(1, len(ids) - 37)]
        requests = [("first", ids), ("second", ids), ("other", other)]
        if len(ids) > ALIGNED_CHUNKS_LENGTH:
            requests.append(("aligned_chunks", ids[:ALIGNED_CHUNKS_LENGTH]))
        for name, prompt in requests:
            request = GenerateRequest(
                prompt_tokens=prompt, max_new_tokens=config["new_tokens"], stop_tokens=[], use_snapshots=False
            )
            before = len(compiled)
            started = time.time()
            if config.get("profile"):
                result = _profiled(engine, request, Path(config["profile"]) / f"{name}.txt")
            else:
                result = engine.generate(request)
            if not result.ok:
                raise SystemExit(f"generate failed: {result.error}")
            runs.append((started, result))
            compiles[name] = compiled[before:]
    finally:
        engine.close()
    (first_at, first), (_, second), (_, other_run) = runs[:3]
    aligned = runs[3][1].stats.time_to_first_token_s if len(runs) > 3 else None
    print(
        json.dumps(
            {
                "import_s": imported - config["spawned_at"],
                "load_s": loaded.seconds,
                "warm_up_s": loaded.warm_up_seconds,
                "first_ttft_s": first.stats.time_to_first_token_s,
                "second_ttft_s": second.stats.time_to_first_token_s,
                "other_length_ttft_s": other_run.stats.time_to_first_token_s,
                "aligned_chunks_ttft_s": aligned,
                "first_decode_tok_s": first.stats.decode_tok_s,
                "second_decode_tok_s": second.stats.decode_tok_s,
                "start_to_first_token_s": first_at + first.stats.time_to_first_token_s - config["spawned_at"],
                "same_tokens": first.tokens == second.tokens,
                # Triton kernels each request compiled or read from the disk cache (the warm-up's job).
                "triton_compiles": compiles,
                "model": loaded.info.name,
                "device": loaded.info.device,
                "dtype": loaded.info.dtype,
            }
        )
    )


def prompt_ids(count: int, vocab: int) -> list[int]:
    """A prompt of `count` ordinary token ids spread over the vocabulary (the speed does not depend on
    which)."""
    return [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(count)]


def _log_triton_compiles() -> list[str]:
    """Triton's kernels as they are compiled or read from its disk cache in this process (its
    jit_cache_hook: each kernel's name and the specialisation of its arguments); empty without
    Triton."""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        return compiled

    def hook(*, repr: str, **_: Any) -> bool:
        compiled.append(repr)
        return False  # go on and compile

    knobs.runtime.jit_cache_hook = hook
    return compiled


def _profiled(engine: Any, request: Any, table: Path) -> Any:
    """engine.generate under torch's profiler (host and device activity); its table of ops by host
    time goes to `table`. The profiler slows every op, so these runs' times are not reported."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    # The engine runs requests on a thread of its own: record every thread's ops.
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, experimental_config=every_thread) as prof:
        result = engine.generate(request)
    table.parent.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    orders = ["cpu_time_total", "self_cpu_time_total"]
    if torch.cuda.is_available():
        orders.append("self_device_time_total")
    table.write_text(
        "\n\n".join(averages.table(sort_by=order, row_limit=50, max_name_column_width=70) for order in orders)
    )
    return result


def spawn(config: dict[str, Any]) -> dict[str, Any]:
    config = {**config, "spawned_at": time.time()}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"a run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the comparison ---------------------------------------------------------------------------------


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "import_s",
        "load_s",
        "warm_up_s",
        "first_ttft_s",
        "second_ttft_s",
        "other_length_ttft_s",
        "start_to_first_token_s",
    )
    out: dict[str, Any] = {key: round(statistics.median(r[key] for r in runs), 4) for key in keys}
    aligned = [r["aligned_chunks_ttft_s"] for r in runs if r["aligned_chunks_ttft_s"] is not None]
    out["aligned_chunks_ttft_s"] = round(statistics.median(aligned), 4) if aligned else None
    out["first_over_second"] = round(out["first_ttft_s"] / max(out["second_ttft_s"], 1e-9), 2)
    out["same_tokens"] = all(r["same_tokens"] for r in runs)
    out["first_triton_compiles"] = max(len(r["triton_compiles"]["first"]) for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a model folder or .gguf (default: the embedded SmolLM2)")
    source.add_argument("--synthetic", choices=SYNTHETIC, help="a synthetic model, written once to --work")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--tokens", type=int, default=3000, help="prompt tokens (default 3000)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per variant")
    parser.add_argument("--cache", choices=("user", "fresh"), default="user")
    parser.add_argument("--work", type=Path, help="where synthetic models go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="also write the JSON under this folder")
    parser.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let torch's attention pick cuDNN (the runtime's CUDNN_ATTENTION), to compare",
    )
    parser.add_argument(
        "--no-row-buckets",
        action="store_true",
        help="run prefill products at their own row count (models/llama PAD_PREFILL_ROWS, "
        "models/deepseek_v4/ops and models/qwen3_5/model PAD_PRODUCT_ROWS), to compare",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="instead: one run with warm-up, both requests under torch's profiler; tables to this folder",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child({**json.loads(args.child)})
        return

    with tempfile.TemporaryDirectory(prefix="ds4desk-first-answer-") as scratch:
        work = args.work or Path(scratch)
        model = str(synthetic_folder(args.synthetic, work)) if args.synthetic else args.model
        vocab = vocab_of(model)
        base = {
            "cudnn_attention": args.cudnn_attention,
            "row_buckets": not args.no_row_buckets,
            "model": model,
            "device": args.device,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "new_tokens": args.new_tokens,
            "vocab": vocab,
        }

        def cache_dir(tag: str) -> str:
            if args.cache == "user":
                from ds4desk.paths import resolve_data_dirs

                return str(resolve_data_dirs(None).create().cache)
            folder = Path(scratch) / f"cache-{tag}"
            folder.mkdir()
            return str(folder)

        if args.cache == "user":  # compiled kernels on disk first, as after any earlier start
            spawn({**base, "warm_up": False, "cache_dir": cache_dir("prime")})
        if args.profile is not None:
            print(
                json.dumps(
                    spawn(
                        {
                            **base,
                            "warm_up": True,
                            "cache_dir": cache_dir("profile"),
                            "profile": str(args.profile),
                        }
                    )
                )
            )
            return
        runs: dict[str, list[dict[str, Any]]] = {"warm_up": [], "no_warm_up": []}
        for repeat in range(args.repeats):
            for warm in (True, False):
                config = {**base, "warm_up": warm, "cache_dir": cache_dir(f"{repeat}-{warm}")}
                runs["warm_up" if warm else "no_warm_up"].append(spawn(config))

    first = runs["warm_up"][0]
    report = {
        "bench": "first_answer",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "model": first["model"],
        "synthetic": args.synthetic,
        "device": first["device"],
        "dtype": first["dtype"],
        "prompt_tokens": args.tokens,
        "cudnn_attention": args.cudnn_attention,
        "row_buckets": not args.no_row_buckets,
        "new_tokens": args.new_tokens,
        "cache": args.cache,
        "repeats": args.repeats,
        "with_warm_up": summary(runs["warm_up"]),
        "without_warm_up": summary(runs["no_warm_up"]),
        "runs": runs,
    }
    line = json.dumps(report)
    print(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        variant = f"{args.tokens}{'_cudnn' if args.cudnn_attention else ''}"
        variant += "_no_row_buckets" if args.no_row_buckets else ""
        name = f"first_answer_{args.synthetic or 'model'}_{args.device.replace(':', '')}_{variant}.json"
        (args.out / name).write_text(line + "\n")


def vocab_of(model: str | None) -> int:
    """The vocabulary size, for prompt ids inside it (from the headers: no weights are read)."""
    from ds4desk.engine.loading.default_model import default_model_path
    from ds4desk.engine.loading.detect import read_source

    config = read_source(Path(model) if model else default_model_path()).config
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size)


if __name__ == "__main__":
    main()
