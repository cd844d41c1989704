"""DeepSeek-V4's indexer pick of one decode query (kernels/deepseek_v4/decode_index.py): the eager math
(the weights' float32 cast and scale, bf16 product, ReLU, weighted sum, mask, torch's top-k) against
the two Triton kernels, each timed as CUDA-graph replays at Flash's shapes (64 heads of 128, top
512) for the candidate rows of a context (rate 4: 8k tokens are 2,048 rows), beside the floor: the
keys' bytes over the copy bandwidth; and the selection kernel alone at each setting (threshold bits
a round, warps) up to 4,096 rows.

    python3 bench/v4_decode_index.py [--rows 2048,4096,8192,16384] [--calls 50]

Writes bench/results/v4_decode_index_<time>.json (or --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from ds4desk.engine.kernels.deepseek_v4 import decode_index as v4_decode_index

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_one_gpu import copy_bandwidth  # a sibling script

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, DIM, TOPK, RATE = 64, 128, 512, 4


def graph_us(call: Callable[[], torch.Tensor], calls: int, repeats: int = 5) -> float:
    """Microseconds a call, from the best of `repeats` replays of a graph of `calls` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()  # compile and warm before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    best = math.inf
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) * 1e3 / calls)
    return best


def select_sweep(scores: torch.Tensor, calls: int) -> dict[str, float]:
    """The selection kernel alone on `scores`, microseconds a call for each setting "bits/warps"."""
    _, select_kernel = v4_decode_index._jit_kernels()
    picks = torch.empty(TOPK, dtype=torch.int64, device=scores.device)
    span = 1 << (scores.shape[0] - 1).bit_length()

    def select(bits: int, warps: int) -> torch.Tensor:
        select_kernel[(1,)](
            scores, picks, scores.shape[0], K=TOPK, EP=span, BITS=bits, PDL=False, num_warps=warps
        )
        return picks

    settings = [(bits, warps) for bits in (1, 2, 4) for warps in (4, 8, 16)]
    return {f"{b}/{w}": graph_us(functools.partial(select, b, w), calls) for b, w in settings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2048,4096,8192,16384")
    parser.add_argument("--calls", type=int, default=50, help="calls a captured graph")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"), 1 << 30)
    result: dict[str, object] = {
        "date": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gb_s": bandwidth / 1e9,
        "shapes": {"heads": HEADS, "dim": DIM, "topk": TOPK, "rate": RATE},
    }
    runs = []
    for rows in (int(n) for n in args.rows.split(",")):
        q = torch.randn(HEADS, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        keys = torch.randn(rows, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        # As the model hands them over: the projection's bf16 weights and the scale to fold in.
        weights = torch.randn(1, HEADS, device="cuda", generator=gen).to(torch.bfloat16)
        pos = torch.tensor([rows * RATE - 1], device="cuda")  # every row visible
        inputs = (q, keys, weights, pos, RATE, TOPK, HEADS**-0.5 * DIM**-0.5)
        eager = functools.partial(v4_decode_index.reference, *inputs)
        fused = functools.partial(v4_decode_index.decode_index, *inputs)
        run = {
            "rows": rows,
            "context_tokens": rows * RATE,
            "eager_us": graph_us(eager, args.calls),
            "fused_us": graph_us(fused, args.calls),
            "floor_us": (keys.numel() * keys.element_size() + q.numel() * 2) / bandwidth * 1e6,
            "picks_in_common": len(set(eager().tolist()) & set(fused().tolist())),
            "select_us_by_bits_warps": select_sweep(
                torch.randn(rows, device="cuda", generator=gen), args.calls
            ),
        }
        runs.append(run)
        print(json.dumps(run), flush=True)
    result["runs"] = runs
    out = args.out or RESULTS / f"v4_decode_index_{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
