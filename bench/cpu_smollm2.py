"""CPU prefill and decode speed on SmolLM2-135M: ds4desk against transformers (and llama.cpp), one run.

    .venv/bin/python bench/cpu_smollm2.py [--prompt-tokens 128 512] [--new-tokens 128] [--repeats 3]

ds4desk and transformers run the very same float32 weights (the GGUF imported by ds4desk into
safetensors). llama.cpp, where llama-cpp-python is installed, runs the original Q4_1 GGUF (what
its users run) and, for a like-for-like row, an F32 GGUF written from the same imported weights.
Prints a table of tok/s and ratios against transformers, and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from ds4desk.engine import Engine, GenerateRequest, LoadRequest
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_source import gguf_tensor_name, permute_rope_rows

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Row:
    engine: str
    weights: str
    prompt_tokens: int
    new_tokens: int
    prefill_tok_s: float
    decode_tok_s: float


def median_of(repeats: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    run()  # warm-up: first-touch of the weights, allocator, thread pool
    samples = [run() for _ in range(repeats)]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def prompt_ids(count: int, vocab: int = 49152) -> list[int]:
    # A deterministic spread of ordinary tokens; the speed does not depend on which.
    return [(i * 7919 + 17) % (vocab - 1000) + 500 for i in range(count)]


def bench_ds4desk(cache: str, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(context=len(prompt) + new + 8, chunk=512))
        assert loaded.ok, loaded.error

        def once() -> tuple[float, float]:
            result = engine.generate(
                GenerateRequest(prompt_tokens=prompt, max_new_tokens=new, stop_tokens=[])
            )
            assert result.ok and len(result.tokens) == new, result.error
            return result.stats.prefill_tok_s, result.stats.decode_tok_s

        return median_of(repeats, once)
    finally:
        engine.close()


def bench_transformers(folder: str, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def once() -> tuple[float, float]:
        with torch.inference_mode():
            start = time.perf_counter()
            model(ids, use_cache=True)
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            total_s = time.perf_counter() - start
        assert out.shape[1] == len(prompt) + new
        # generate = one prefill + (new - 1) decode steps
        return len(prompt) / prefill_s, (new - 1) / max(total_s - prefill_s, 1e-9)

    return median_of(repeats, once)


def bench_llama_cpp(gguf: str, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=gguf, n_ctx=len(prompt) + new + 8, n_batch=512, n_threads=os.cpu_count(), verbose=False
    )

    def once() -> tuple[float, float]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - start
        token = llm.sample(temp=0.0)
        start = time.perf_counter()
        for _ in range(new - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        decode_s = time.perf_counter() - start
        return len(prompt) / prefill_s, (new - 1) / decode_s

    return median_of(repeats, once)


WORKERS: dict[str, Callable[[str, list[int], int, int], tuple[float, float]]] = {
    "ds4desk": bench_ds4desk,
    "transformers": bench_transformers,
    "llama.cpp": bench_llama_cpp,
}


def in_child(engine: str, model: Path, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    """Each measurement in a fresh process: torch's OpenMP pools of one engine would otherwise slow
    the next one down (two pools on two cores make libgomp throttle its spinning), and a crash in
    native code must not take the whole run down."""
    job = json.dumps(
        {"engine": engine, "model": str(model), "prompt": prompt, "new": new, "repeats": repeats}
    )
    child = subprocess.run(
        [sys.executable, __file__, "--worker", job], capture_output=True, text=True, timeout=1800
    )
    if child.returncode != 0:
        print(
            f"  {engine} on {model.name} failed (exit code {child.returncode}): {child.stderr[-300:]}",
            file=sys.stderr,
        )
        return float("nan"), float("nan")
    prefill, decode = json.loads(child.stdout.strip().splitlines()[-1])
    return prefill, decode


def worker(job_text: str) -> None:
    job = json.loads(job_text)
    result = WORKERS[job["engine"]](job["model"], job["prompt"], job["new"], job["repeats"])
    print(json.dumps(result))


def write_f32_gguf(folder: Path, out: Path) -> None:
    """The imported float32 weights written back as an F32 GGUF, so llama.cpp runs the same numbers."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(default_model_path()))
    writer = gguf.GGUFWriter(str(out), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.file_type", "general.architecture"):
            continue
        writer.add_key_value(
            name,
            field.contents(),
            field.types[0],
            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None,
        )
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    with safe_open(folder / "model.safetensors", framework="np") as weights:
        for key in weights.keys():  # noqa: SIM118 - safe_open has no __iter__
            array = weights.get_tensor(key)
            # llama.cpp expects Q and K rows in its own rope order (the inverse of the import).
            if ".q_proj." in key or ".k_proj." in key:
                array = permute_rope_rows(array, heads if ".q_proj." in key else kv_heads)
            writer.add_tensor(gguf_tensor_name(key), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, help="ds4desk model cache (default: a temporary folder)")
    args = parser.parse_args()

    cache = args.cache or Path(tempfile.mkdtemp(prefix="ds4bench-"))
    gguf_q4 = default_model_path()
    folder = read_source(gguf_q4).folder
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
    f32_gguf = cache / "smollm2-f32.gguf"
    if have_llama and not f32_gguf.exists():
        write_f32_gguf(folder, f32_gguf)

    rows: list[Row] = []
    for count in args.prompt_tokens:
        prompt = prompt_ids(count)
        runs = [("ds4desk", "f32", cache), ("transformers", "f32", folder)]
        if have_llama:
            runs += [("llama.cpp", "f32", f32_gguf), ("llama.cpp", "q4_1", gguf_q4)]
        for name, weights, model in runs:
            prefill, decode = in_child(name, model, prompt, args.new_tokens, args.repeats)
            rows.append(Row(name, weights, count, args.new_tokens, prefill, decode))
            print(
                f"  {name:12} {weights:5} prompt {count:5}: prefill {prefill:8.1f} tok/s, "
                f"decode {decode:7.1f} tok/s",
                file=sys.stderr,
            )

    print(
        f"\nSmolLM2-135M on CPU ({os.cpu_count()} threads, torch {torch.__version__}); "
        "ratios against transformers in the same run"
    )
    print(
        f"{'engine':12} {'weights':7} {'prompt':>6} {'prefill tok/s':>14} {'x':>6} "
        f"{'decode tok/s':>13} {'x':>6}"
    )
    for row in rows:
        base = next(r for r in rows if r.engine == "transformers" and r.prompt_tokens == row.prompt_tokens)
        print(
            f"{row.engine:12} {row.weights:7} {row.prompt_tokens:6} {row.prefill_tok_s:14.1f} "
            f"{row.prefill_tok_s / base.prefill_tok_s:6.2f} {row.decode_tok_s:13.1f} "
            f"{row.decode_tok_s / base.decode_tok_s:6.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"cpu_smollm2_{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "date": stamp,
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
