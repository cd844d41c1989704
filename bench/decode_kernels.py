"""Time the dense decode step's fused GEMVs (ds4desk/engine/kernels/dense/gemv.py) against the
cuBLAS calls they replace, on the 1.07B benchmark model's shapes, inside CUDA graphs (as the step runs).

    PYTHONPATH=. python3 bench/decode_kernels.py [--sweep] [--out FILE.json]

Each timing replays a graph of 40 calls that cycle through enough copies of the weight to exceed the
L2 cache (a real step streams 2 GB of weights: nothing is L2-resident), median of 5 replays.
torch's side: RMSNorm + mm (the norm rows), addmm_ into the residual (o / down: SiLU·up first for
down), the head's norm + mm + float. --sweep tries every (BLOCK_N, BLOCK_K, warps) and prints the
best per shape (what gemv_config's rule follows).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.dense import gemv as kd

HIDDEN, FFN, QKV, VOCAB = 2048, 8192, 3072, 49152
# (name, N, K, kind): kind says what the torch side and the kernel do.
SHAPES = [
    ("qkv", QKV, HIDDEN, "norm"),
    ("o", HIDDEN, HIDDEN, "add"),
    ("gate_up", 2 * FFN, HIDDEN, "norm"),
    ("down", HIDDEN, FFN, "silu_add"),
    ("head", VOCAB, HIDDEN, "head"),
]
CALLS = 40
L2_BYTES = 256 << 20


def graph_time(fn: Callable[[int], None], copies: int) -> float:
    """Seconds per call of fn(i) (i cycles over the weight copies), replayed from one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(CALLS):
            fn(i % copies)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times[1:])


def bench_shape(name: str, n: int, k: int, kind: str, configs: list[tuple[int, int, int]] | None) -> dict:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    size = n * k * 2
    copies = max(2, -(-L2_BYTES // size))
    weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
    norm = torch.ones(k, device=device, dtype=dtype)
    width = 2 * k if kind == "silu_add" else k
    x = torch.randn(1, width, device=device, dtype=dtype)
    residual = torch.randn(1, n, device=device, dtype=dtype)
    out = torch.empty(1, n, device=device, dtype=torch.float32 if kind == "head" else dtype)

    def torch_side(i: int) -> None:
        w = weights[i]
        if kind in ("norm", "head"):
            h = F.rms_norm(x, (k,), norm, 1e-5)
            y = torch.mm(h, w.t())
            out.copy_(y.float() if kind == "head" else y)
        elif kind == "add":
            residual.addmm_(x, w.t())
        else:
            act = F.silu(x[:, :k]) * x[:, k:]
            residual.addmm_(act, w.t())

    def kernel_side(i: int) -> None:
        w = weights[i]
        if kind in ("norm", "head"):
            kd.norm_gemv(x, norm, w, None, 1e-5, out=out)
        else:
            kd.gemv_add_(residual, x, w, None, silu=kind == "silu_add")

    row: dict[str, object] = {"shape": name, "n": n, "k": k, "mbytes": size / 1e6}
    row["torch_us"] = graph_time(torch_side, copies) * 1e6
    kd.OVERRIDE = None
    row["default_config"] = list(kd.gemv_config(n, k))
    row["kernel_us"] = graph_time(kernel_side, copies) * 1e6
    with launch.PDL.force(False):
        row["kernel_no_pdl_us"] = graph_time(kernel_side, copies) * 1e6
    row["kernel_tb_s"] = size / row["kernel_us"] / 1e6
    row["torch_tb_s"] = size / row["torch_us"] / 1e6
    if configs:
        tried = []
        for config in configs:
            block_n, block_k, _ = config
            if n % block_n or k % block_k:
                continue
            kd.OVERRIDE = config
            try:
                tried.append((graph_time(kernel_side, copies) * 1e6, config))
            except Exception as exc:  # a setting that does not compile is skipped, not fatal
                print(f"  {name} {config}: {type(exc).__name__}", flush=True)
        kd.OVERRIDE = None
        tried.sort()
        row["best"] = [{"us": us, "config": list(c)} for us, c in tried[:5]]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_kernels.json"))
    args = parser.parse_args()
    configs = None
    if args.sweep:
        configs = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)))
    rows = [bench_shape(*shape, configs) for shape in SHAPES]
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    total_torch = sum(r["torch_us"] for r in rows)
    total_kernel = sum(r["kernel_us"] for r in rows)
    no_pdl = sum(r["kernel_no_pdl_us"] for r in rows)
    print(
        f"sum over the five shapes: torch {total_torch:.1f} us, kernels {total_kernel:.1f} us "
        f"({no_pdl:.1f} us without programmatic dependent launch)"
    )


if __name__ == "__main__":
    main()
