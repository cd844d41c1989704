"""What a first cuBLAS call at a row count not seen before costs, and whether a warm-up can cover it.

    python3 bench/cublas_first_calls.py [--strides 64,16] [--out bench/results]

The dense family's prefill runs its projections through torch.mm / addmm (bf16, the weights
transposed views, the residual add in addmm) at the prompt's row count. This times, in a fresh
process on the Qwen3-0.6B-shaped projections, each call synchronously: a call at a row count
whose cuBLAS kernel has not run yet takes milliseconds, a repeat tens of microseconds. Then, per
stride, a fresh process warms every row count 16, 16 + stride, ... 4096 and counts how many of 60
random row counts still pay a first call. The environment's CUDA_MODULE_LOADING is reported (run
it once more with EAGER to see whether module loading is the cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

# (N, K, residual add) of Qwen3-0.6B's qkv, o, gate/up and down projections.
SHAPES = [(4096, 1024, False), (1024, 2048, True), (6144, 1024, False), (1024, 3072, True)]
SLOW_MS = 1.0  # a call this long is a first call (a warm one at 4,096 rows takes under 0.6 ms)
RANDOM_ROW_COUNTS = 60  # tried after a warm-up sweep, each on every shape


def measure(stride: int | None) -> dict:
    """In this process: first and repeated calls at a few row counts (stride None), or the warm-up
    sweep on `stride` and the first calls left afterwards."""
    device = torch.device("cuda")
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16).t() for n, k, _ in SHAPES]
    xs = torch.randn(4096, 3072, device=device, dtype=torch.bfloat16)
    residual = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)

    def timed(i: int, m: int) -> float:
        _, k, add = SHAPES[i]
        torch.cuda.synchronize()
        start = time.perf_counter()
        if add:
            torch.addmm(residual[:m], xs[:m, :k], weights[i])
        else:
            torch.mm(xs[:m, :k], weights[i])
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    for i in range(len(SHAPES)):  # cuBLAS's own start-up, not a row count's
        timed(i, 250)
    if stride is None:
        calls = []
        for m in (3000, 3000, 2713, 2713, 2900, 1500, 1501, 4096, 517, 3001):
            calls.append({"rows": m, "ms": [round(timed(i, m), 3) for i in range(len(SHAPES))]})
        return {"module_loading": os.environ.get("CUDA_MODULE_LOADING", "default (lazy)"), "calls": calls}
    started, slow = time.perf_counter(), 0
    for m in [*range(16, 4097, stride), 4096]:
        slow += sum(timed(i, m) > SLOW_MS for i in range(len(SHAPES)))
    warm_s = time.perf_counter() - started
    random.seed(0)
    missed = [
        [m, i, round(ms, 2)]
        for m in random.sample(range(17, 4097), RANDOM_ROW_COUNTS)
        for i in range(len(SHAPES))
        if (ms := timed(i, m)) > SLOW_MS
    ]
    tried = RANDOM_ROW_COUNTS * len(SHAPES)
    return {"stride": stride, "warm_s": warm_s, "slow_in_warm_up": slow, "tried": tried, "missed": missed}


def child(args: list[str], env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strides", default="64,16")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--child", nargs="?", const="calls")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(None if args.child == "calls" else int(args.child))))
        return
    lazy = child([])
    eager = child([], {**os.environ, "CUDA_MODULE_LOADING": "EAGER"})
    sweeps = [child([stride]) for stride in args.strides.split(",")]
    for run in (lazy, eager):
        print(f"module loading {run['module_loading']}:")
        for call in run["calls"]:
            print(f"  {call['rows']:5} rows: " + "  ".join(f"{ms:6.2f}" for ms in call["ms"]) + " ms")
    for sweep in sweeps:
        print(
            f"warm every {sweep['stride']} rows: {sweep['warm_s']:.2f} s, {sweep['slow_in_warm_up']} first "
            f"calls in it; then {len(sweep['missed'])} of {sweep['tried']} calls at random row counts "
            "were first calls"
        )
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cublas_first_calls_{stamp}.json"
    meta = {"date": stamp, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    path.write_text(json.dumps({**meta, "lazy": lazy, "eager": eager, "sweeps": sweeps}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
