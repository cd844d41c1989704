"""Batch-1 speed on one GPU: ds4desk against transformers, llama.cpp and the physical floors.

    # once, on a machine with the embedded SmolLM2 GGUF: its tokenizer, small enough to carry
    python3 bench/gpu_speed.py prepare OUT_DIR
    # on the GPU machine, in one go
    python3 bench/gpu_speed.py run --vocab OUT_DIR [--llama-bench PATH] [--v4] [--out bench/results]

The dense model is Llama-shaped with 1.07B parameters (hidden 2048, 16 layers, 32 heads, 8 KV
heads, FFN 8192, rope base 500000, tied embeddings, bf16) and SmolLM2's tokenizer, with random
weights written once as a Hugging Face folder (ds4desk and transformers load it) and as a BF16 GGUF
(llama.cpp's `llama-bench` loads it). Prefill is one prompt of 512 or 4096 tokens; decode is 256
new tokens after that prompt. The floors: weight bytes over the measured copy bandwidth for
decode, 2 x parameters x tokens over the measured bf16 matmul rate for prefill.

`--v4` adds the DeepSeek-V4 synthetic model of bench/gpu_deepseek_v4.py (ds4desk and transformers).

`--llama-quantize PATH` (with `--llama-bench`) adds the same dense model quantized by llama.cpp's own
`llama-quantize` from the BF16 GGUF to each of `--quant-types` (default Q8_0 and Q4_K_M, llama.cpp's
mix of Q4_K and Q6_K): ds4desk runs each file in place, its weights packed, and llama.cpp runs the same
file. The decode floor there is the file's tensor bytes over the copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.gguf_source import gguf_tensor_name, permute_rope_rows
from ds4desk.engine.runtime import Runtime

DENSE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
PROMPTS = (512, 4096)
NEW_TOKENS = 256
CHUNKS = (512, 1024, 2048, 4096)


# --- preparing the tokenizer (runs where the embedded GGUF is) -------------------------------------


def prepare(out: Path) -> None:
    from ds4desk.engine.loading.default_model import default_model_path
    from ds4desk.engine.loading.gguf_header import read_gguf_header
    from ds4desk.engine.loading.gguf_tokenizer import build_tokenizer

    header = read_gguf_header(default_model_path())
    meta = header.metadata
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(meta).tokenizer.save(str(out / "tokenizer.json"))
    keys = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id")
    vocab = {key: meta[f"tokenizer.ggml.{key}"] for key in keys if f"tokenizer.ggml.{key}" in meta}
    (out / "gguf_vocab.json").write_text(json.dumps(vocab, default=int))
    print(f"wrote {out}")


# --- the dense model's files -----------------------------------------------------------------------


def random_dense_state(seed: int = 0, layers: int | None = None) -> dict[str, torch.Tensor]:
    """Random bf16 weights of DENSE (`layers`: that many layers instead of its own)."""
    cfg = DENSE
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    layers = layers or cfg["num_hidden_layers"]
    kv_width = cfg["num_key_value_heads"] * cfg["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    def ones(width: int) -> torch.Tensor:
        return torch.ones(width, dtype=torch.bfloat16)

    state = {
        "model.embed_tokens.weight": normal(cfg["vocab_size"], hidden),
        "model.norm.weight": ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.k_proj.weight": normal(kv_width, hidden),
            p + "self_attn.v_proj.weight": normal(kv_width, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "mlp.gate_proj.weight": normal(ffn, hidden),
            p + "mlp.up_proj.weight": normal(ffn, hidden),
            p + "mlp.down_proj.weight": normal(hidden, ffn),
        }
    return state


def write_hf(
    folder: Path, state: dict[str, torch.Tensor], vocab_dir: Path, layers: int | None = None
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    config = DENSE if layers is None else {**DENSE, "num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(vocab_dir / "tokenizer.json", folder / "tokenizer.json")


def write_gguf(path: Path, state: dict[str, torch.Tensor], vocab_dir: Path) -> None:
    import gguf

    cfg = DENSE
    vocab = json.loads((vocab_dir / "gguf_vocab.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("ds4desk-bench-dense-1b")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(int(vocab.get("bos_token_id", 1)))
    writer.add_eos_token_id(int(vocab.get("eos_token_id", 2)))

    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for name, tensor in state.items():
        if tensor.dim() == 1:  # norms: llama.cpp wants them in float32
            writer.add_tensor(gguf_tensor_name(name), tensor.float().numpy())
            continue
        raw = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)  # bf16 bits
        projection = name.split(".")[-2]
        if projection in heads:  # GGUF keeps Q/K rows in rope's adjacent-pair order
            raw = permute_rope_rows(raw, heads[projection])
        writer.add_tensor(
            gguf_tensor_name(name), raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- measurements ----------------------------------------------------------------------------------


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of `fn` after one warm-up, with the device drained around each run."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def floors() -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and the bf16 matmul rate."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = timed(lambda: a @ b, 20)
    src = dst = a = b = torch.empty(0)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * 2**30 / copy_s, "bf16_flop_per_s": 2 * 8192**3 / mm_s}


def prompt_ids(count: int, vocab: int) -> list[int]:
    return [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(count)]


def bench_ds4desk_dense(
    folder: Path,  # a Hugging Face folder or a GGUF file
    graphs: bool,
    chunk: int = 4096,
    decode_attention: str = "triton",
    kernels: bool = True,
    pdl: bool = True,
) -> dict[str, object]:
    from ds4desk.engine.kernels import launch
    from ds4desk.engine.kernels.dense import gemv as decode_kernels
    from ds4desk.engine.loading.detect import read_source

    settings = {decode_kernels.SWITCH: None if kernels else False, launch.PDL: None if pdl else False}
    with launch.force(settings):
        device = torch.device("cuda")
        source = read_source(folder)
        model = load_model(source, device, torch.bfloat16).model
        model.decode_attention = decode_attention
        runtime = Runtime(model, device, context=max(PROMPTS) + NEW_TOKENS + 8, chunk=chunk, graphs=graphs)
        vocab = DENSE["vocab_size"]
        name = "ds4desk" if graphs else "ds4desk-eager"
        if decode_attention != "triton":
            name += f"-{decode_attention}"
        if not kernels:
            name += "-cublas"
        if not pdl:
            name += "-nopdl"
        row: dict[str, object] = {
            "engine": name,
            "graphs": graphs,
            "decode_attention": decode_attention,
            "fused_decode_kernels": kernels,
            "programmatic_dependent_launch": pdl,
        }
        greedy = SamplingParams(temperature=0.0)
        with torch.inference_mode():
            for count in PROMPTS:
                ids = prompt_ids(count, vocab)
                prefill_s = timed(lambda ids=ids: runtime.prefill_logits(ids))
                row[f"prefill_{count}_tok_s"] = count / prefill_s
                ttfts, decodes = [], []
                for _ in range(3):
                    out = runtime.generate(ids, greedy, NEW_TOKENS, set(), lambda _t: None, lambda: False)
                    assert len(out.tokens) == NEW_TOKENS
                    ttfts.append(out.stats.time_to_first_token_s)
                    decodes.append(out.stats.decode_tok_s)
                row[f"ttft_{count}_s"] = statistics.median(ttfts)
                row[f"decode_{count}_tok_s"] = statistics.median(decodes)
            if graphs:
                ids = prompt_ids(4096, vocab)
                for size in CHUNKS:
                    runtime.chunk = size
                    row[f"prefill_4096_chunk_{size}_tok_s"] = 4096 / timed(
                        lambda ids=ids: runtime.prefill_logits(ids)
                    )
        runtime.close()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def bench_transformers_dense(folder: Path) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    row: dict[str, object] = {"engine": "transformers"}
    for count in PROMPTS:
        ids = torch.tensor([prompt_ids(count, DENSE["vocab_size"])], device="cuda")
        with torch.inference_mode():
            prefill_s = timed(lambda ids=ids: model(ids, logits_to_keep=1), 3)

            def generate(ids: torch.Tensor = ids) -> None:
                model.generate(
                    ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
                )

            total_s = timed(generate, 2)
        row[f"prefill_{count}_tok_s"] = count / prefill_s
        row[f"ttft_{count}_s"] = prefill_s
        row[f"decode_{count}_tok_s"] = (NEW_TOKENS - 1) / max(total_s - prefill_s, 1e-9)
    model.to("meta")
    gc.collect()
    torch.cuda.empty_cache()
    return row


def bench_llama_cpp(binary: Path, gguf_path: Path) -> dict[str, object]:
    row: dict[str, object] = {"engine": "llama.cpp"}

    def run(*args: str) -> list[dict[str, object]]:
        cmd = [str(binary), "-m", str(gguf_path), "-ngl", "99", "-fa", "1", "-r", "3", "-o", "json", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    for test in run("-p", ",".join(map(str, PROMPTS)), "-n", "0"):
        row[f"prefill_{test['n_prompt']}_tok_s"] = test["avg_ts"]
    for test in run("-p", "0", "-n", str(NEW_TOKENS), "-d", ",".join(map(str, PROMPTS))):
        row[f"decode_{test['n_depth']}_tok_s"] = test["avg_ts"]
    return row


def gguf_tensor_bytes(path: Path) -> int:
    from ds4desk.engine.loading.gguf_header import read_gguf_header

    return sum(t.nbytes for t in read_gguf_header(path).tensors.values())


def bench_quantized(args: argparse.Namespace, work: Path, copy_bytes_per_s: float) -> dict[str, object]:
    """The BF16 GGUF quantized by llama-quantize to each type, run by ds4desk and llama.cpp."""
    out: dict[str, object] = {}
    for kind in args.quant_types:
        path = work / f"dense-{kind}.gguf"
        done = subprocess.run(
            [str(args.llama_quantize), str(work / "dense.gguf"), str(path), kind],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            out[kind] = {"error": f"llama-quantize failed: {done.stderr[-1500:]}"}
            continue
        tensor_bytes = gguf_tensor_bytes(path)
        rows = []
        for name, bench in (
            ("ds4desk", lambda path=path: bench_ds4desk_dense(path, graphs=True)),
            ("llama.cpp", lambda path=path: bench_llama_cpp(args.llama_bench, path)),
        ):
            if f"{kind}:{name}" in args.skip:
                continue
            try:
                rows.append(bench())
            except Exception as exc:
                rows.append({"engine": name, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps({"type": kind, **rows[-1]}), flush=True)
        entry = {
            "file_bytes": path.stat().st_size,
            "tensor_bytes": tensor_bytes,
            "floor_decode_tok_s": copy_bytes_per_s / tensor_bytes,
            "floor_prefill_4096_tok_s": float("nan"),
            "rows": rows,
        }
        out[kind] = entry
        print_table(f"dense 1.07B {kind}", entry, rows)
    return out


def run(args: argparse.Namespace) -> None:
    work = args.work or Path(tempfile.mkdtemp(prefix="ds4speed-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "machine": platform.platform(),
    }
    result["floors"] = measured = floors()
    print(json.dumps(measured), flush=True)
    started = time.perf_counter()
    state = random_dense_state()
    parameters = sum(t.numel() for t in state.values())
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    write_hf(work / "dense", state, args.vocab)
    if args.llama_bench:
        write_gguf(work / "dense.gguf", state, args.vocab)
    del state
    print(f"wrote the dense model in {time.perf_counter() - started:.1f} s", flush=True)
    dense: dict[str, object] = {
        "parameters": parameters,
        "weight_bytes": weight_bytes,
        "floor_decode_tok_s": measured["copy_bytes_per_s"] / weight_bytes,
        **{f"floor_prefill_{n}_tok_s": measured["bf16_flop_per_s"] / (2 * parameters) for n in PROMPTS},
    }
    rows = []
    engines: list[tuple[str, Callable[[], dict[str, object]]]] = [
        ("ds4desk", lambda: bench_ds4desk_dense(work / "dense", graphs=True)),
        ("ds4desk-nopdl", lambda: bench_ds4desk_dense(work / "dense", True, pdl=False)),
        ("ds4desk-cublas", lambda: bench_ds4desk_dense(work / "dense", True, kernels=False)),
        ("ds4desk-matmul", lambda: bench_ds4desk_dense(work / "dense", True, decode_attention="matmul")),
        ("ds4desk-eager", lambda: bench_ds4desk_dense(work / "dense", graphs=False)),
        ("transformers", lambda: bench_transformers_dense(work / "dense")),
    ]
    if args.llama_bench:
        engines.append(("llama.cpp", lambda: bench_llama_cpp(args.llama_bench, work / "dense.gguf")))
    for name, bench in engines:
        if name in args.skip:
            continue
        try:
            rows.append(bench())
        except Exception as exc:  # one engine failing must not lose the others' numbers
            rows.append({"engine": name, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)
    dense["rows"] = rows
    result["dense"] = dense
    print_table("dense 1.07B bf16", dense, rows)
    if args.llama_quantize and args.llama_bench:
        result["gguf"] = bench_quantized(args, work, measured["copy_bytes_per_s"])

    if args.v4:
        from bench import gpu_deepseek_v4 as v4

        folder = work / "v4"
        v4_params = v4.write_model(folder)
        v4_rows = []
        for count in (1024, 4096):
            for name, fn in (
                ("ds4desk", lambda c=count: v4.bench_ds4desk(folder, work / "v4cache", c, NEW_TOKENS, 2)),
                (
                    "ds4desk-eager",
                    lambda c=count: v4.bench_ds4desk(
                        folder, work / "v4cache", c, NEW_TOKENS, 1, graphs=False
                    ),
                ),
                ("transformers", lambda c=count: v4.bench_transformers(folder, c, NEW_TOKENS, 1)),
            ):
                if f"v4:{name}" in args.skip:
                    continue
                try:
                    prefill, decode = fn()
                    v4_rows.append(
                        {"engine": name, "prompt": count, "prefill_tok_s": prefill, "decode_tok_s": decode}
                    )
                except Exception as exc:
                    v4_rows.append({"engine": name, "prompt": count, "error": f"{type(exc).__name__}: {exc}"})
                print(json.dumps(v4_rows[-1]), flush=True)
        result["deepseek_v4"] = {"parameters": v4_params, "rows": v4_rows}

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"gpu_speed_{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def print_table(title: str, model: dict[str, object], rows: list[dict[str, object]]) -> None:
    keys = [f"prefill_{n}_tok_s" for n in PROMPTS] + [f"decode_{n}_tok_s" for n in PROMPTS]
    decode_floor, prefill_floor = model["floor_decode_tok_s"], model.get("floor_prefill_4096_tok_s", 0.0)
    print(f"\n{title}: floors decode {decode_floor:.0f} tok/s, prefill {prefill_floor:.0f} tok/s")
    print(f"{'engine':14}" + "".join(f"{k.removesuffix('_tok_s'):>16}" for k in keys))
    for row in rows:
        cells = "".join(f"{row.get(k, float('nan')):16.1f}" for k in keys)
        print(f"{row['engine']:14}{cells}")
    ours = next((r for r in rows if r["engine"] == "ds4desk"), None)
    if ours is None:
        return
    for row in rows:
        if row is ours or "error" in row:
            continue
        ratios = "".join(f"{ours.get(k, float('nan')) / row.get(k, float('nan')):16.2f}" for k in keys)
        print(f"{'x ' + row['engine']:14}{ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("out", type=Path)
    go = sub.add_parser("run")
    go.add_argument("--vocab", type=Path, required=True)
    go.add_argument("--llama-bench", type=Path)
    go.add_argument("--v4", action="store_true")
    go.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize, for the GGUF rows")
    go.add_argument(
        "--quant-types",
        default=["Q8_0", "Q4_K_M"],
        type=lambda text: [t for t in text.split(",") if t],
        help="llama-quantize types of the GGUF rows",
    )
    go.add_argument(
        "--skip",
        default="",
        type=lambda text: set(filter(None, text.split(","))),
        help="engines to leave out (v4:NAME for a DeepSeek-V4 row)",
    )
    go.add_argument("--work", type=Path, help="where to write the models (default: a temporary folder)")
    go.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out)
    else:
        run(args)


if __name__ == "__main__":
    main()
