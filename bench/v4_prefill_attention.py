"""DeepSeek-V4 prefill attention on a GPU: the eager form against the fused Triton kernel.

    PYTHONPATH=. python3 bench/v4_prefill_attention.py [--tokens 4096] [--no-sweep] [--out bench/results]

Flash shapes (bf16, 64 heads of 512, one shared K = V head, a raw window of 128) for one chunk of
T tokens that starts at position T (the second chunk of a 2T prompt: pad = 0, ring rows in the
window): a sliding layer, an HCA layer (E = 2T / 128 entries, 64 at T = 4096) and a CSA layer
(E = 2T / 4 entries of which each query scores its k = 512 indexer picks). Each path is timed with
CUDA events (median of several runs after a warm-up that compiles the kernel); the fused output is
checked against the eager one. The sweep times other blockings (heads per program, keys per tile,
warps, stages). Writes bench/results/v4_prefill_attention.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as pa

HEADS, DIM, WINDOW, TOPK = 64, 512, 128, 512
RATES = {"hca": 128, "csa": 4}
DTYPE = torch.bfloat16
RUNS, REPEATS = 5, 5

Args = tuple[
    torch.Tensor,
    torch.Tensor,
    int,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor,
]


def inputs(kind: str, tokens: int, device: torch.device) -> Args:
    """One chunk at positions tokens .. 2 tokens - 1, as _attention hands it over."""
    gen = torch.Generator(device=device).manual_seed(0)
    start = tokens

    def normed(*shape: int) -> torch.Tensor:  # RMS-normed rows, as the model's q and keys
        x = torch.randn(shape, device=device, generator=gen)
        return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(DTYPE)

    q = normed(tokens, HEADS, DIM)
    keys = normed(WINDOW - 1 + tokens, DIM)
    sinks = torch.randn(HEADS, device=device, generator=gen)
    if kind == "sliding":
        return q, keys, 0, None, None, None, sinks
    rate = RATES[kind]
    total = (start + tokens) // rate
    entries = normed(total, DIM)
    positions = torch.arange(start, start + tokens, device=device)
    visible = torch.arange(total, device=device).unsqueeze(0) < ((positions + 1) // rate).unsqueeze(1)
    picks = None
    if kind == "csa":
        # Distinct visible picks per query, as the indexer's top-k.
        scores = torch.rand((tokens, total), device=device, generator=gen).masked_fill_(~visible, -1.0)
        picks = scores.topk(min(TOPK, total), dim=-1).indices
        visible = visible.gather(1, picks)
    bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, -math.inf)
    return q, keys, 0, entries, picks, bias, sinks


def time_ms(call: Callable[[], torch.Tensor]) -> float:
    for _ in range(2):  # compile, allocate
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(RUNS):
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / RUNS)
    return statistics.median(samples)


def bench_kind(kind: str, tokens: int, sweep: bool) -> list[dict[str, object]]:
    device = torch.device("cuda")
    args = inputs(kind, tokens, device)
    scale = DIM**-0.5
    extra = 0 if args[5] is None else args[5].shape[1]
    flops = 4 * tokens * HEADS * (WINDOW + extra) * DIM  # q·k and p·v, 2 flops a multiply-add
    rows: list[dict[str, object]] = []

    def record(path: str, ms: float, **more: object) -> None:
        row = {"kind": kind, "tokens": tokens, "keys_per_query": WINDOW + extra, "path": path}
        row |= {"ms": round(ms, 3), "TFLOP_per_s": round(flops / ms / 1e9, 1), **more}
        rows.append(row)
        print(json.dumps(row), flush=True)

    expected = pa.reference(*args, scale)
    record("eager", time_ms(lambda: pa.reference(*args, scale)))
    kernel = pa._triton_kernel()
    assert kernel is not None, "Triton is not importable"
    configs = [dict(pa.LAUNCH_CONFIG)]
    if sweep:
        for block_h in (32, 64):
            for block_n in (16, 32, 64):
                for warps in (4, 8):
                    for stages in (1, 2):  # 3: more shared memory than a [32 x 512] key tile x 3 leaves
                        config = {"block_h": block_h, "block_n": block_n, "num_warps": warps}
                        config["num_stages"] = stages
                        if config != configs[0]:
                            configs.append(config)
    for config in configs:
        try:
            out = kernel(*args, scale, **config)
            error = float((out.float() - expected.float()).norm() / expected.float().norm())
            ms = time_ms(lambda config=config: kernel(*args, scale, **config))
        except Exception as exc:  # a blocking the GPU cannot run (shared memory, registers)
            print(json.dumps({"kind": kind, "config": config, "failed": repr(exc)[:200]}), flush=True)
            continue
        record("fused", ms, config=config, relative_error=round(error, 6))
        del out
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--kinds", default="sliding,hca,csa", help="which layer kinds to time")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parsed = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("a CUDA GPU is needed")
    rows = []
    kinds = parsed.kinds.split(",")
    for kind in kinds:
        rows += bench_kind(kind, parsed.tokens, not parsed.no_sweep)
        torch.cuda.empty_cache()
    best = {}
    for kind in kinds:
        eager = next(r for r in rows if r["kind"] == kind and r["path"] == "eager")
        fused = [r for r in rows if r["kind"] == kind and r["path"] == "fused"]
        if fused:
            top = min(fused, key=lambda r: float(r["ms"]))  # type: ignore[arg-type]
            best[kind] = {"eager_ms": eager["ms"], "fused_ms": top["ms"], "config": top["config"]}
    print(json.dumps({"best": best}, indent=2))
    parsed.out.mkdir(parents=True, exist_ok=True)
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
        "best": best,
    }
    (parsed.out / "v4_prefill_attention.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
