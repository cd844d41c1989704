"""DeepSeek-V4's few-query ops on a GPU, at the shapes of a graphed verify step or prompt piece.

    PYTHONPATH=. python3 bench/v4_piece_ops.py [--out bench/results]

For T = 2, 5, 9, 16 queries (Flash's attention shapes: 64 heads of 512, a window of 128; the V4
synthetic model's entries at span 1024: 8 HCA entries, 256 CSA entries all picked): prefill
attention under several blockings (LAUNCH_CONFIG, the few-query FEW_QUERIES_CONFIG and others),
one query of the decode attention kernel for comparison, the indexer's scores under several
entry blocks and in eager torch ops, and a top-k of all 256 scores. Each op is captured ten times
in one CUDA graph and timed by CUDA events (median per op over 20 replays). Prints one line per
op and writes bench/results/v4_piece_ops_<date>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from ds4desk.engine.kernels.deepseek_v4 import decode_attention as v4_decode_attention
from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as v4_prefill_attention

HEADS, DIM, WINDOW = 64, 512, 128


def timed(fn, replays: int = 20) -> float:
    """Microseconds a call: ten calls in one graph, the median replay over `replays`."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / 10)
    return statistics.median(samples)


Record = Callable[..., None]


def measure(count: int, record: Record) -> None:
    """Every op at `count` queries."""
    dev, bf = "cuda", torch.bfloat16
    kernel = v4_prefill_attention._triton_kernel()
    assert kernel is not None
    blockings = [
        dict(v4_prefill_attention.LAUNCH_CONFIG),
        dict(v4_prefill_attention.FEW_QUERIES_CONFIG),
        {"block_h": 16},
        {"block_h": 64, "num_warps": 8},
        {"block_n": 64},
    ]
    q = torch.randn(count, HEADS, DIM, device=dev, dtype=bf)
    keys = torch.randn(WINDOW - 1 + count, DIM, device=dev, dtype=bf)
    sinks = torch.randn(HEADS, device=dev)
    pad = torch.zeros(1, dtype=torch.long, device=dev)
    for kind, total, picked in (("sliding", 0, 0), ("hca", 8, 0), ("csa", 256, 256)):
        entries = torch.randn(total, DIM, device=dev, dtype=bf) if total else None
        picks = None
        if picked:
            picks = torch.stack([torch.randperm(total, device=dev)[:picked] for _ in range(count)])
        bias = torch.zeros(count, picked or total, device=dev) if total else None
        arguments = (q, keys, pad, entries, picks, bias, sinks, 0.05)
        for config in blockings:
            us = timed(functools.partial(kernel, *arguments, **config))
            record("prefill_attention", count, us, kind=kind, config=config)
    ring = torch.randn(WINDOW, DIM, device=dev, dtype=bf)
    steps = torch.arange(WINDOW, device=dev)
    entries = torch.randn(256, DIM, device=dev, dtype=bf)
    ready = torch.arange(256, device=dev) * 4 + 3
    picks_one = torch.randperm(256, device=dev)
    pos = torch.tensor([1000], device=dev)
    turn = torch.complex(torch.ones(1, 32, device=dev), torch.zeros(1, 32, device=dev))
    one = (q[0], ring, steps, entries, ready, picks_one, sinks, pos, 0.05, turn)
    us = timed(functools.partial(v4_decode_attention.decode_attention, *one))
    record("decode_attention (one query)", count, us, kind="csa")
    qi = torch.randn(count, 64, 128, device=dev, dtype=bf)
    ki = torch.randn(256, 128, device=dev, dtype=bf)
    wi = torch.randn(count, 64, device=dev)
    default = v4_index_scores._FEW_BLOCK_E
    for block in (16, 32, 64, 128):
        v4_index_scores._FEW_BLOCK_E = block
        us = timed(functools.partial(v4_index_scores.index_scores, qi, ki, wi, 1024, 4))
        record("index_scores", count, us, entries=256, block_e=block)
    v4_index_scores._FEW_BLOCK_E = default
    everything = torch.ones(count, 256, dtype=torch.bool, device=dev)

    def eager() -> torch.Tensor:
        part = torch.relu_(torch.matmul(qi, ki.t()).float())
        return torch.where(everything, torch.bmm(wi.unsqueeze(1), part).squeeze(1), -1e30)

    record("index scores in torch ops", count, timed(eager), entries=256)
    scores = torch.randn(count, 256, device=dev)
    record("topk 256 of 256", count, timed(functools.partial(torch.topk, scores, 256, dim=-1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    rows: list[dict] = []

    def record(op: str, count: int, us: float, **what: object) -> None:
        rows.append({"op": op, "queries": count, "us": us, **what})
        print(f"{op} T={count} {what}: {us:6.1f} us")

    for count in (2, 5, 9, 16):
        measure(count, record)
    date = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    meta = {"date": date, "machine": platform.platform(), "torch": torch.__version__}
    meta["device"] = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"v4_piece_ops_{date}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
