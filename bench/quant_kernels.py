"""The quantized matmul kernels of ds4desk/engine/kernels/quant/ (fp8.py, fp4.py) on one NVIDIA GPU.

    PYTHONPATH=. python3 bench/quant_kernels.py [--sweep] [--out bench/results/quant_kernels.json]

For DeepSeek-V4-Flash's FP8 linear shapes: fp8_linear at 1 row (the Triton GEMV) and at 512 / 4096
rows (torch._scaled_mm with block-quantized activations) against bf16 `x @ w.t()` on the dequantized
weight; fp4_experts_gemv (6 of 256 experts, the batch-1 MoE) against six bf16 GEMVs on dense
experts; fp4_dequantize (one expert, prefill) against the torch form. These are captured in a CUDA
graph of back-to-back calls that cycle through enough weight copies to overflow the L2 cache (so a
GEMV reads its weights from HBM, as in a decode step), timed with CUDA events. GB/s is bytes of
weights read (FP8 + scales, packed FP4 + scales, or bf16) over the time; fp4_dequantize also counts
the bf16 it writes. Then fp4_grouped_matmul (a 4096-token prefill through 6 of 256 experts, eager)
against per-expert fp4_dequantize + bf16 matmul, in TFLOP/s. Every case reports its error against
the dequantized reference.

--sweep also times the FP8 GEMV and the FP4 GEMV under alternative launch settings
(fp8.OVERRIDES, fp4.OVERRIDES) and reports the best per shape, to tune fp8_config / fp4_config.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4desk.engine.kernels.quant import fp4, fp8

# (N, K) of the FP8 linears: wkv, wq_a, wo_b / shared experts, wo_a-ish, wq_b, indexer.wq_b, ...
FP8_SHAPES = [
    (512, 4096),
    (1024, 4096),
    (4096, 4096),
    (8192, 4096),
    (32768, 4096),
    (32768, 1024),
    (8192, 1024),
    (4096, 2048),
]
FP8_ROWS = (1, 512, 4096)
# Flash's one-row FP8 linears: q_a, q_b, kv, o_b, the shared expert's gate / up and down, indexer q_b.
FLASH_FP8_SHAPES = [
    (1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048), (8192, 1024)
]  # fmt: skip
# (N, K) of one routed expert: down (D x I) and gate+up (2I x D).
FP4_SHAPES = [(4096, 2048), (4096, 4096)]
EXPERTS, ACTIVE = 256, 6
PREFILL_TOKENS = 4096
L2_FLUSH_BYTES = 256 << 20  # copies cycled per graph: well over the H200's 50 MB L2
CALLS_PER_GRAPH = 64


def time_graph(fn: Callable[[int], object], copies: int, replays: int = 5) -> float:
    """Seconds per call of fn(i) (i cycling over the copies), from CUDA graph replays."""
    for i in range(min(copies, 3)):  # compile and warm up outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(CALLS_PER_GRAPH):
            fn(call % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / CALLS_PER_GRAPH)
    return best


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def fp8_weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(copies):
        w = (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
        scale = torch.exp2(torch.randint(-12, -4, (n // 128, k // 128), device="cuda").float())
        out.append((w, scale))
    return out


def bench_fp8(n: int, k: int, results: list[dict[str, Any]]) -> None:
    fp8_bytes = n * k + 4 * (n // 128) * (k // 128)
    copies = max(2, min(64, math.ceil(L2_FLUSH_BYTES / fp8_bytes)))
    weights = fp8_weights(n, k, copies)
    dense_copies = max(2, min(64, math.ceil(L2_FLUSH_BYTES / (2 * n * k))))
    dense = [fp8.fp8_dequantize(w, s, torch.bfloat16) for w, s in weights[:dense_copies]]
    for m in FP8_ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        path = "triton_gemv" if m <= fp8.GEMV_MAX_ROWS else "scaled_mm"
        got = fp8.fp8_linear(x, *weights[0])
        err = rel_error(got, x.float() @ dense[0].float().t())
        ours = time_graph(lambda i, x=x: fp8.fp8_linear(x, *weights[i]), copies)
        base = time_graph(lambda i, x=x: x @ dense[i].t(), dense_copies)
        flops = 2 * m * n * k
        row = {
            "op": "fp8_linear", "path": path, "rows": m, "n": n, "k": k,
            "us": ours * 1e6, "gbps": fp8_bytes / ours / 1e9, "tflops": flops / ours / 1e12,
            "bf16_us": base * 1e6, "bf16_gbps": 2 * n * k / base / 1e9, "bf16_tflops": flops / base / 1e12,
            "speedup": base / ours, "rel_error": err,
        }  # fmt: skip
        results.append(row)
        print(
            f"fp8_linear {path:11s} M={m:5d} N={n:6d} K={k:5d}: {ours * 1e6:8.1f} us {row['gbps']:7.0f} GB/s "
            f"{row['tflops']:7.1f} TF/s | bf16 {base * 1e6:8.1f} us {row['bf16_gbps']:7.0f} GB/s "
            f"{row['bf16_tflops']:7.1f} TF/s | x{row['speedup']:.2f} err {err:.1e}",
            flush=True,
        )


def fp4_experts(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (EXPERTS, n, k // 2), device="cuda", dtype=torch.uint8)
    scale = torch.randint(118, 127, (EXPERTS, n, k // 32), device="cuda", dtype=torch.uint8)
    return packed, scale


def bench_fp4(n: int, k: int, results: list[dict[str, Any]]) -> None:
    packed, scale = fp4_experts(n, k)
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(EXPERTS, generator=gen)[:ACTIVE] for _ in range(CALLS_PER_GRAPH)]
    ids = [p.cuda() for p in picks]
    expert_bytes = n * k // 2 + n * k // 32
    for shared in (True, False):
        x = torch.randn(1 if shared else ACTIVE, k, device="cuda", dtype=torch.bfloat16)
        got = fp4.fp4_experts_gemv(x, ids[0], packed, scale)
        dense0 = fp4.fp4_dequantize_many(
            packed.index_select(0, ids[0]), scale.index_select(0, ids[0]), torch.float32
        )
        want = torch.bmm(dense0, x.float().expand(ACTIVE, k).unsqueeze(-1)).squeeze(-1)
        err = rel_error(got, want)
        ours = time_graph(lambda i, x=x: fp4.fp4_experts_gemv(x, ids[i], packed, scale), len(ids))
        row = {
            "op": "fp4_experts_gemv", "shared_x": shared, "experts": ACTIVE, "n": n, "k": k,
            "us": ours * 1e6, "gbps": ACTIVE * expert_bytes / ours / 1e9,
            "tflops": 2 * ACTIVE * n * k / ours / 1e12, "rel_error": err,
        }  # fmt: skip
        results.append(row)
        print(
            f"fp4_experts_gemv shared={shared!s:5s} N={n} K={k}: {ours * 1e6:7.1f} us "
            f"{row['gbps']:6.0f} GB/s err {err:.1e}",
            flush=True,
        )
    # The bf16 floor: six GEMVs on dense experts (a dense copy of 32 experts, cycled: 6 x 32 x 2 N K
    # bytes, over the L2 cache).
    pool = min(32, EXPERTS)
    dense = fp4.fp4_dequantize_many(packed[:pool], scale[:pool], torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    base = time_graph(lambda i: [x @ dense[(i * ACTIVE + j) % pool].t() for j in range(ACTIVE)], 64)
    results.append(
        {"op": "bf16_6_gemv", "n": n, "k": k, "us": base * 1e6, "gbps": ACTIVE * 2 * n * k / base / 1e9}
    )
    print(f"bf16 6 GEMVs N={n} K={k}: {base * 1e6:7.1f} us {results[-1]['gbps']:6.0f} GB/s", flush=True)

    # fp4_dequantize: one expert to bf16 (prefill), against the torch form.
    copies = max(2, min(64, math.ceil(L2_FLUSH_BYTES / (expert_bytes + 2 * n * k))))
    got = fp4.fp4_dequantize(packed[0], scale[0], torch.bfloat16)
    err = rel_error(got, fp4.fp4_dequantize_many(packed[:1], scale[:1], torch.float32)[0])
    ours = time_graph(lambda i: fp4.fp4_dequantize(packed[i], scale[i], torch.bfloat16), copies)
    torch_form = time_graph(
        lambda i: fp4.fp4_dequantize_many(packed[i : i + 1], scale[i : i + 1], torch.bfloat16), copies
    )
    traffic = expert_bytes + 2 * n * k
    row = {
        "op": "fp4_dequantize", "n": n, "k": k, "us": ours * 1e6, "gbps": traffic / ours / 1e9,
        "torch_us": torch_form * 1e6, "speedup": torch_form / ours, "rel_error": err,
    }  # fmt: skip
    results.append(row)
    print(
        f"fp4_dequantize N={n} K={k}: {ours * 1e6:7.1f} us {row['gbps']:6.0f} GB/s (read + write) | "
        f"torch {torch_form * 1e6:7.1f} us | x{row['speedup']:.1f} err {err:.1e}",
        flush=True,
    )


def bench_grouped(n: int, k: int, results: list[dict[str, Any]]) -> None:
    """Prefill through the experts: 4096 tokens x 6 experts of 256 (about 96 rows each), the grouped
    kernel against per-expert fp4_dequantize + bf16 matmul."""
    packed, scale = fp4_experts(n, k)
    gen = torch.Generator().manual_seed(2)
    picks = torch.randint(0, EXPERTS, (PREFILL_TOKENS * ACTIVE,), generator=gen)
    sizes = torch.bincount(picks, minlength=EXPERTS).tolist()
    x = torch.randn(sum(sizes), k, device="cuda", dtype=torch.bfloat16)
    got = fp4.fp4_grouped_matmul(x, sizes, packed, scale)
    first = sizes[0]
    dense0 = fp4.fp4_dequantize_many(packed[:1], scale[:1], torch.float32)[0]
    err = rel_error(got[:first], x[:first].float() @ dense0.t())

    def per_expert() -> torch.Tensor:
        out = x.new_empty((x.shape[0], n))
        start = 0
        for expert, size in enumerate(sizes):
            weight = fp4.fp4_dequantize(packed[expert], scale[expert], torch.bfloat16)
            torch.matmul(x[start : start + size], weight.t(), out=out[start : start + size])
            start += size
        return out

    ours = _time_eager(lambda: fp4.fp4_grouped_matmul(x, sizes, packed, scale))
    base = _time_eager(per_expert)
    flops = 2 * x.shape[0] * n * k
    row = {
        "op": "fp4_grouped_matmul", "rows": x.shape[0], "n": n, "k": k, "ms": ours * 1e3,
        "tflops": flops / ours / 1e12, "per_expert_ms": base * 1e3, "per_expert_tflops": flops / base / 1e12,
        "speedup": base / ours, "rel_error": err,
    }  # fmt: skip
    results.append(row)
    print(
        f"fp4_grouped_matmul R={x.shape[0]} N={n} K={k}: {ours * 1e3:7.2f} ms {row['tflops']:6.1f} TF/s | "
        f"per-expert dequantize + matmul {base * 1e3:7.2f} ms {row['per_expert_tflops']:6.1f} TF/s | "
        f"x{row['speedup']:.2f} err {err:.1e}",
        flush=True,
    )


def _time_eager(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


GROUPED_CONFIGS = [
    (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 128, 8, 3),
    (128, 128, 128, 8, 2),
    (128, 256, 64, 8, 3),
]


def sweep_grouped(results: list[dict[str, Any]]) -> None:
    """Time the grouped FP4 prefill kernel under each of GROUPED_CONFIGS (BLOCK_M, BLOCK_N, BLOCK_K,
    warps, stages) at the Flash shapes; the best is what fp4.GROUPED_BLOCK should hold."""
    default = fp4.GROUPED_BLOCK
    gen = torch.Generator().manual_seed(2)
    picks = torch.randint(0, EXPERTS, (PREFILL_TOKENS * ACTIVE,), generator=gen)
    sizes = torch.bincount(picks, minlength=EXPERTS).tolist()
    for n, k in FP4_SHAPES:
        packed, scale = fp4_experts(n, k)
        x = torch.randn(sum(sizes), k, device="cuda", dtype=torch.bfloat16)
        fp4.GROUPED_BLOCK = default
        want = fp4.fp4_grouped_matmul(x, sizes, packed, scale)
        timed = []

        def call(x: torch.Tensor = x, packed: torch.Tensor = packed, scale: torch.Tensor = scale) -> object:
            return fp4.fp4_grouped_matmul(x, sizes, packed, scale)

        for config in GROUPED_CONFIGS:
            fp4.GROUPED_BLOCK = config
            try:
                err = rel_error(call(), want.float())
                seconds = _time_eager(call)
            except Exception as exc:  # a setting that does not compile or fit is skipped
                print(f"  grouped {config}: {type(exc).__name__}", flush=True)
                continue
            timed.append((seconds, config, err))
        fp4.GROUPED_BLOCK = default
        timed.sort()
        flops = 2 * x.shape[0] * n * k
        rows = [
            {"config": list(c), "ms": t * 1e3, "tflops": flops / t / 1e12, "rel_error": e}
            for t, c, e in timed
        ]
        row = {"op": "sweep_fp4_grouped", "n": n, "k": k, "results": rows}
        results.append(row)
        best = row["results"][0]
        print(
            f"sweep grouped N={n} K={k}: best {best['config']} {best['ms']:.2f} ms {best['tflops']:.0f} TF/s",
            flush=True,
        )


def sweep(results: list[dict[str, Any]]) -> None:
    """Time alternative launch settings of the two GEMVs; the best per shape is what to put in
    fp8_config / fp4_config."""
    for n, k in FP8_SHAPES:
        results.append(sweep_fp8(n, k))
    for n, k in FP4_SHAPES:
        results.append(sweep_fp4(n, k))


def sweep_fp8(n: int, k: int) -> dict[str, Any]:
    copies = max(2, min(64, math.ceil(L2_FLUSH_BYTES / (n * k))))
    weights = fp8_weights(n, k, copies)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def call(i: int) -> object:
        return fp8.fp8_linear(x, *weights[i])

    settings = [
        (block_n, split, warps, stages)
        for block_n in (16, 32)
        for split in (1, 2, 4, 8)
        for warps in (4, 8)
        for stages in (2, 4)
        if n % block_n == 0 and (k // 128) % split == 0
    ]
    best_t, best = _best(settings, "fp8", call, copies)
    default = time_graph(call, copies, replays=3)
    print(
        f"sweep fp8 N={n} K={k}: best {best} {best_t * 1e6:.1f} us vs default {default * 1e6:.1f} us",
        flush=True,
    )
    return {
        "op": "sweep_fp8_gemv", "n": n, "k": k, "best": best, "best_us": best_t * 1e6,
        "best_gbps": n * k / best_t / 1e9, "default": fp8.fp8_config(1, n, k, _sms()),
        "default_us": default * 1e6,
    }  # fmt: skip


def sweep_fp4(n: int, k: int) -> dict[str, Any]:
    packed, scale = fp4_experts(n, k)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randperm(EXPERTS, generator=gen)[:ACTIVE].cuda() for _ in range(CALLS_PER_GRAPH)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def call(i: int) -> object:
        return fp4.fp4_experts_gemv(x, ids[i], packed, scale)

    settings = [
        (block_n, block_k, warps, stages)
        for block_n in (16, 32, 64)
        for block_k in (128, 256, 512)
        for warps in (4, 8)
        for stages in (2, 3)
    ]
    best_t, best = _best(settings, "fp4", call, len(ids))
    default = time_graph(call, len(ids), replays=3)
    moved = ACTIVE * (n * k // 2 + n * k // 32)
    print(
        f"sweep fp4 N={n} K={k}: best {best} {best_t * 1e6:.1f} us vs default {default * 1e6:.1f} us",
        flush=True,
    )
    return {
        "op": "sweep_fp4_gemv", "n": n, "k": k, "best": best, "best_us": best_t * 1e6,
        "best_gbps": moved / best_t / 1e9, "default": fp4.fp4_config(ACTIVE, n, k, _sms()),
        "default_us": default * 1e6,
    }  # fmt: skip


def decode_sweep(results: list[dict[str, Any]]) -> None:
    """The batch-1 kernels only: the one-row FP8 GEMV against the split-K one and under other tiles;
    the FP4 experts GEMV under its default and other tiles."""
    for n, k in FLASH_FP8_SHAPES:
        copies = max(2, min(64, math.ceil(L2_FLUSH_BYTES / (n * k))))
        weights = fp8_weights(n, k, copies)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ fp8.fp8_dequantize(*weights[0], torch.float32).t()

        def call(i: int, x: torch.Tensor = x, weights: list = weights) -> object:
            return fp8.fp8_linear(x, *weights[i])

        timed: dict[str, float] = {}
        for row_kernel in (False, True):
            fp8.FP8_ROW = row_kernel
            timed["row" if row_kernel else "split"] = time_graph(call, copies, replays=3)
        err = rel_error(call(0), want)  # the one-row kernel's (FP8_ROW is left on)
        settings = [
            (block_n, block_k, warps)
            for block_n in (4, 8, 16)
            for block_k in (512, 1024)
            for warps in (4, 8)
            if k % block_k == 0
        ]
        best_t, best = _best(settings, "fp8_row", call, copies)
        row = {
            "op": "decode_fp8_gemv", "n": n, "k": k, "split_us": timed["split"] * 1e6,
            "row_us": timed["row"] * 1e6, "row_default": fp8.fp8_row_config(n, k), "best": best,
            "best_us": best_t * 1e6, "best_gbps": n * k / best_t / 1e9, "rel_error": err,
        }  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    for n, k in FP4_SHAPES:
        packed, scale = fp4_experts(n, k)
        gen = torch.Generator().manual_seed(1)
        ids = [torch.randperm(EXPERTS, generator=gen)[:ACTIVE].cuda() for _ in range(CALLS_PER_GRAPH)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        dense = fp4.fp4_dequantize_many(packed[ids[0]], scale[ids[0]], torch.float32)
        want = torch.einsum("enk,k->en", dense, x[0].float())

        def call4(i: int, x: torch.Tensor = x, packed=packed, scale=scale, ids=ids) -> object:  # type: ignore[no-untyped-def]
            return fp4.fp4_experts_gemv(x, ids[i], packed, scale)

        row4: dict[str, Any] = {"op": "decode_fp4_gemv", "n": n, "k": k}
        moved = ACTIVE * (n * k // 2 + n * k // 32)
        t = time_graph(call4, len(ids), replays=3)
        row4 |= {"us": t * 1e6, "gbps": moved / t / 1e9, "rel_error": rel_error(call4(0), want)}
        settings4 = [
            (block_n, block_k, warps, 3) for block_n in (16, 32) for block_k in (128, 256) for warps in (4, 8)
        ]
        best_t, best4 = _best(settings4, "fp4", call4, len(ids))
        row4 |= {"best": best4, "best_us": best_t * 1e6, "best_gbps": moved / best_t / 1e9}
        results.append(row4)
        print(json.dumps(row4), flush=True)


def _best(
    settings: list[tuple[int, ...]], kind: str, call: Callable[[int], object], copies: int
) -> tuple[float, tuple[int, ...]]:
    timings = []
    try:
        for setting in settings:
            (fp4 if kind == "fp4" else fp8).OVERRIDES[kind] = setting
            try:
                timings.append((time_graph(call, copies, replays=3), setting))
            except Exception as exc:  # a setting the compiler rejects: skip it
                print(f"  {kind} {setting} failed: {exc}", flush=True)
    finally:
        (fp4 if kind == "fp4" else fp8).OVERRIDES[kind] = None
    return min(timings)


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also time alternative GEMV launch settings")
    parser.add_argument("--grouped-only", action="store_true", help="only sweep the grouped prefill kernel")
    parser.add_argument("--decode-only", action="store_true", help="only the batch-1 GEMVs")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "quant_kernels.json"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.version.hip is not None:
        raise SystemExit("needs an NVIDIA GPU")
    import triton

    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    if args.grouped_only or args.decode_only:
        (sweep_grouped if args.grouped_only else decode_sweep)(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"device": torch.cuda.get_device_name(0), "results": results}, indent=1)
        )
        return
    for n, k in FP8_SHAPES:
        bench_fp8(n, k, results)
    for n, k in FP4_SHAPES:
        bench_fp4(n, k, results)
    for n, k in FP4_SHAPES:
        bench_grouped(n, k, results)
    if args.sweep:
        sweep(results)
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
