"""One decode token's attention on a GPU: the graphed step's matmul path against the Triton kernel.

    PYTHONPATH=. python3 bench/decode_attention.py [--spans 512 1024 4096] [--no-sweep] [--out bench/results]

Shapes of the 1.07B dense model of bench/gpu_speed.py (bf16, 8 kv heads, 4 query heads each, head
size 64), at pos = span - 1. Like the model, every one of LAYERS calls reads its own layer of a
[layers, 2, KV, context, D] cache (so the keys come from memory, not from L2, and the views carry
the cache's strides), and the LAYERS calls are captured in one CUDA graph, replayed many times and
timed with CUDA events: the time per call is what one layer's attention costs inside the graphed
decode step. The matmul path gets its -inf bias built once outside the graph, as the model builds
it once per step for all layers. The sweep times the kernel's block size and programs per SM.
Writes bench/results/decode_attention.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4desk.engine.kernels.dense import decode_attention as da

KV, GROUP, DIM, LAYERS = 8, 4, 64, 16
DTYPE = torch.bfloat16
REPLAYS, REPEATS = 100, 7


def matmul_attention(q, keys, values, bias, scale) -> torch.Tensor:
    """decode_graphable's "matmul" branch, verbatim."""
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, values)


def sdpa_attention(q, keys, values, bias) -> torch.Tensor:
    """decode_graphable's "sdpa" branch."""
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=bias[None])[0]


def time_graph(step: Callable[[], list[torch.Tensor]]) -> tuple[float, list[torch.Tensor]]:
    """Microseconds per call of `step` (which makes LAYERS calls), captured in one graph; and the
    graph's outputs after the timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile the kernels, allocate cuBLAS workspaces: never inside a capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (REPLAYS * LAYERS))
    return statistics.median(samples), outputs


def bench_span(span: int, context: int, sweep: bool) -> list[dict[str, object]]:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(span)
    cache = torch.randn((LAYERS, 2, KV, context, DIM), device=device, dtype=DTYPE, generator=gen)
    qs = torch.randn((LAYERS, KV, GROUP, DIM), device=device, dtype=DTYPE, generator=gen)
    scale = DIM**-0.5
    keys = [cache[i, 0, :, :span] for i in range(LAYERS)]
    values = [cache[i, 1, :, :span] for i in range(LAYERS)]
    rows: list[dict[str, object]] = []

    def record(name: str, pos: int, micros: float, **extra: object) -> None:
        read = 2 * KV * (pos + 1) * DIM * cache.element_size()  # the visible keys and values
        row = {"span": span, "pos": pos, "path": name, "us_per_layer": round(micros, 3)}
        row |= {"GB_per_s": round(read / micros / 1e3, 1), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    last = span - 1
    bias = torch.zeros(span, device=device, dtype=DTYPE).expand(KV, GROUP, span)  # pos = span - 1
    micros, _ = time_graph(
        lambda: [matmul_attention(qs[i], keys[i], values[i], bias, scale) for i in range(LAYERS)]
    )
    record("matmul", last, micros)
    micros, _ = time_graph(lambda: [sdpa_attention(qs[i], keys[i], values[i], bias) for i in range(LAYERS)])
    record("sdpa", last, micros)

    default = (da.BLOCK_N, da.PROGRAMS_PER_SM)
    configs = [(last, default)]
    if sweep:
        configs += [(last, (b, p)) for b in (32, 64, 128) for p in (1, 2, 4) if (b, p) != default]
    configs.append((span // 2, default))  # half the splits past the position: they skip their loads
    for at, (block, per_sm) in configs:
        here = torch.tensor([at], device=device)
        da.BLOCK_N, da.PROGRAMS_PER_SM = block, per_sm
        try:
            splits = da.plan_splits(span, KV, sms)[0]
            micros, outs = time_graph(
                lambda here=here: [
                    da.decode_attention(qs[i], keys[i], values[i], here, scale) for i in range(LAYERS)
                ]
            )
        finally:
            da.BLOCK_N, da.PROGRAMS_PER_SM = default
        expected = [da.reference(qs[i], keys[i], values[i], here, scale, None) for i in range(LAYERS)]
        error = max(float((o.float() - e.float()).abs().max()) for o, e in zip(outs, expected, strict=True))
        name = "triton" if (block, per_sm) == default else f"triton-b{block}-p{per_sm}"
        record(name, at, micros, block=block, programs_per_sm=per_sm, splits=splits, max_err=error)
        if error > 2e-2:
            raise SystemExit(f"{name} at span {span}, pos {at}: the kernel is off by {error}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--no-sweep", action="store_true", help="time only the default block / programs")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not da.enabled(torch.device("cuda")):
        raise SystemExit("needs an NVIDIA GPU with Triton")
    rows: list[dict[str, object]] = []
    with torch.inference_mode():
        for span in args.spans:
            rows += bench_span(span, max(args.spans), not args.no_sweep)
    import triton

    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"kv_heads": KV, "group": GROUP, "head_dim": DIM, "layers": LAYERS, "dtype": str(DTYPE)},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode_attention.json"
    path.write_text(json.dumps(result, indent=2))
    for span in args.spans:
        base = next(r for r in rows if r["span"] == span and r["path"] == "matmul")
        fused = next(r for r in rows if r["span"] == span and r["path"] == "triton" and r["pos"] == span - 1)
        print(f"span {span}: matmul {base['us_per_layer']} us, triton {fused['us_per_layer']} us per layer")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
