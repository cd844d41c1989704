"""Time the GGUF-packed GEMV kernels (ds4desk/engine/kernels/quant/gguf_triton.py) on the 1.07B
benchmark model's shapes (bench/gpu_speed.py: hidden 2048, 32 heads and 8 KV heads of 64, FFN 8192,
vocabulary 49,152), against a bf16 torch.mm GEMV on the same shape and the device's copy bandwidth.

    PYTHONPATH=. python3 bench/gguf_gemv.py [--types Q8_0,Q4_K,Q6_K,Q8_0_ROWS] [--sweep] [--out FILE.json]

Each timing replays a CUDA graph of 40 calls that cycle through enough copies of the weight to exceed
the L2 cache (a decode step streams every weight from memory), median of 5 replays. Per type and
shape it prints one JSON line: microseconds a call and GB/s of packed bytes for the GEMV (T = 1,
with and without programmatic dependent launch, and T = 4) and for the fused form the decode graph
would use there (RMSNorm input on q, k/v, gate/up and the head, residual add on o, SiLU(gate)·up
input + residual add on down); the same for a bf16 torch.mm (x @ Wᵀ, W bf16); the fraction of the
copy bandwidth the GEMV reaches; its error against the reference (dequantize + float32 matmul,
norm-relative, T = 4); prefill (T = 512: dequantize to a bf16 scratch + mm) against a bf16 mm; and
whether the dequantized scratch equals the reference bit for bit. --sweep also times every
(BLOCK_N, values per iteration, warps) setting of the GEMV and keeps the best three.
Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from ds4desk.engine.formats import GGUF_TYPES, ROW_LAYOUT_SOURCES, ROW_LAYOUTS, gguf_packed_bytes
from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.launch import next_power_of_two
from ds4desk.engine.kernels.quant import gguf, gguf_tiles
from ds4desk.engine.kernels.quant import gguf_triton as gt

HIDDEN, FFN, KV, VOCAB = 2048, 8192, 512, 49152
# (name, rows, cols, fused form timed besides the plain GEMV)
SHAPES = [
    ("q", HIDDEN, HIDDEN, "norm"),
    ("k_v", KV, HIDDEN, "norm"),
    ("o", HIDDEN, HIDDEN, "add"),
    ("gate_up", FFN, HIDDEN, "norm"),
    ("down", HIDDEN, FFN, "silu_add"),
    ("head", VOCAB, HIDDEN, "norm"),
]
CALLS = 40
L2_BYTES = 256 << 20
SWEPT_SHAPES = ("q", "k_v", "gate_up", "down", "head")  # --sweep: the shapes whose settings are tried
ONE_ROW_TYPES = tuple(
    gguf_tiles.ONE_ROW_GROUPS
)  # the types with their own one-row kernel (gguf_gemv1_triton)
# (BLOCK_N, values per row per iteration, num_warps) of the general kernel tried by --sweep
# (values a tile, warps) of the one-row kernel tried by --sweep, with 1-16 rows a program: a tile wider
# than the row is cut to the row (so on a 2048-column row, more warps share the same groups).
ONE_ROW_TILES = ((1024, 1), (2048, 1), (2048, 2), (2048, 4), (4096, 2), (4096, 4), (8192, 4), (8192, 8))
GENERAL_CONFIGS = list(itertools.product((1, 2, 4, 8), (256, 512, 1024), (4, 8)))
PREFILL_ROWS = 512
BY_NAME = {t.name: t for t in GGUF_TYPES.values()} | {
    layout.name: layout for layout, _ in ROW_LAYOUTS.values()
}


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


def event_time(fn: Callable[[], None], reps: int = 10) -> float:
    """Seconds per call of fn, timed with events (eager launches: the prefill path)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = event_time(lambda: dst.copy_(src), reps=20)
    return 2 * (1 << 30) / seconds / 1e9


def packed_weight(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random valid blocks of type `name`: random codes and sub-block scales, small fp16 scales
    (a row layout: such blocks of its file type, rearranged as a GPU holds them)."""
    if BY_NAME[name].type_id in ROW_LAYOUT_SOURCES:
        file_id = ROW_LAYOUT_SOURCES[BY_NAME[name].type_id][0]
        return gguf.device_rows(packed_weight(GGUF_TYPES[file_id].name, rows, cols, seed), file_id, cols)
    kind = BY_NAME[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    row_bytes = gguf_packed_bytes(kind.type_id, (cols,))
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    blocks = raw.view(-1, kind.block_bytes)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).cuda()
    for at in kind.fp16_scales:
        blocks[:, at : at + 2] = scale
    if name == "MXFP4":
        blocks[:, 0] = 120
    return raw


def bench(name: str, shape: tuple[str, int, int, str], configs: list[tuple[int, int, int]] | None) -> dict:
    label, rows, cols, fused = shape
    type_id = BY_NAME[name].type_id
    packed_bytes = gguf_packed_bytes(type_id, (rows, cols))
    bf16_bytes = rows * cols * 2
    copies = max(2, -(-L2_BYTES // packed_bytes))
    bf16_copies = max(2, -(-L2_BYTES // bf16_bytes))
    weights = [packed_weight(name, rows, cols, seed=i) for i in range(copies)]
    dense = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(bf16_copies)]
    x = torch.randn(4, 2 * cols, device="cuda", dtype=torch.bfloat16)
    x1, x4, gate_up = x[:1, :cols], x[:, :cols], x[:1]
    norm = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, rows, device="cuda", dtype=torch.bfloat16)
    out1 = out[:1]
    residual = torch.zeros(1, rows, device="cuda", dtype=torch.bfloat16)

    reference = gt.reference_matmul(x4, weights[0], type_id, cols)
    got = gt.matmul(x4.contiguous(), weights[0], type_id, cols, out)
    rel_err = float((got.float() - reference).norm() / reference.norm())
    got1 = gt.matmul(x1.contiguous(), weights[0], type_id, cols, out1.clone())
    rel_err1 = float((got1.float() - reference[:1]).norm() / reference[:1].norm())

    def gemv1(i: int) -> None:
        gt.gemv(x1, weights[i], type_id, cols, out1)

    def gemv4(i: int) -> None:
        gt.gemv(x4, weights[i], type_id, cols, out)

    def fused_form(i: int) -> None:
        if fused == "norm":
            gt.norm_gemv(x1, norm, weights[i], type_id, cols, 1e-5, out1)
        elif fused == "add":
            gt.gemv_add_(residual, x1, weights[i], type_id, cols)
        else:
            gt.gemv_add_(residual, gate_up, weights[i], type_id, cols, silu=True)

    def torch_gemv(i: int) -> None:
        torch.mm(x1, dense[i].t(), out=out1)

    row: dict[str, object] = {"type": name, "shape": label, "rows": rows, "cols": cols}
    row["packed_mb"] = packed_bytes / 1e6
    row["rel_err_t4"] = rel_err
    row["rel_err_t1"] = rel_err1
    gguf_tiles.OVERRIDE = None
    one_row = name in ONE_ROW_TYPES
    if one_row:
        row["one_row_config"] = list(gguf_tiles.one_row_config(name, rows, cols))
        kept, gguf_tiles.ONE_ROW_MIN_ROWS = (
            gguf_tiles.ONE_ROW_MIN_ROWS,
            {},
        )  # the general kernel, for comparison
        row["general_gemv_us"] = graph_time(gemv1, copies) * 1e6
        row[f"general_{fused}_gemv_us"] = graph_time(fused_form, copies) * 1e6
        gguf_tiles.ONE_ROW_MIN_ROWS = dict.fromkeys(kept, 0)  # the one-row kernel, whatever the height
        row["one_row_gemv_us"] = graph_time(gemv1, copies) * 1e6
        row[f"one_row_{fused}_gemv_us"] = graph_time(fused_form, copies) * 1e6
        gguf_tiles.ONE_ROW_MIN_ROWS = kept
    row["default_config"] = list(
        gguf_tiles.gemv_config(rows, cols, torch.cuda.get_device_properties(0).multi_processor_count)
    )
    row["gemv_us"] = graph_time(gemv1, copies) * 1e6
    row["gemv_gb_s"] = packed_bytes / row["gemv_us"] / 1e3
    with launch.PDL.force(False):
        row["gemv_no_pdl_us"] = graph_time(gemv1, copies) * 1e6
    row["gemv_t4_us"] = graph_time(gemv4, copies) * 1e6
    row[f"{fused}_gemv_us"] = graph_time(fused_form, copies) * 1e6
    row["bf16_mm_us"] = graph_time(torch_gemv, bf16_copies) * 1e6
    row["bf16_mm_gb_s"] = bf16_bytes / row["bf16_mm_us"] / 1e3
    row["speedup_vs_bf16"] = row["bf16_mm_us"] / row["gemv_us"]

    xp = torch.randn(PREFILL_ROWS, cols, device="cuda", dtype=torch.bfloat16)
    outp = torch.empty(PREFILL_ROWS, rows, device="cuda", dtype=torch.bfloat16)
    row["prefill_us"] = event_time(lambda: gt.matmul(xp, weights[0], type_id, cols, outp)) * 1e6
    row["prefill_bf16_mm_us"] = event_time(lambda: torch.mm(xp, dense[0].t(), out=outp)) * 1e6
    scratch = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    row["dequantize_us"] = event_time(lambda: gt.dequantize_into(weights[0], type_id, cols, scratch)) * 1e6
    exact = torch.equal(scratch, gguf.dequantize(weights[0], type_id, (rows, cols)).bfloat16())
    row["dequantize_exact"] = exact

    if configs and label in SWEPT_SHAPES:
        kept, gguf_tiles.ONE_ROW_MIN_ROWS = (
            gguf_tiles.ONE_ROW_MIN_ROWS,
            dict.fromkeys(gguf_tiles.ONE_ROW_MIN_ROWS, 0),
        )
        tried = []
        seen = set()
        for config in configs[name] if one_row else GENERAL_CONFIGS:
            if one_row:  # a tile wider than the row is cut to it: time each distinct setting once
                n_groups = cols // gguf_tiles.ONE_ROW_GROUPS[name]
                config = (config[0], min(config[1], next_power_of_two(n_groups)), config[2])
                if config in seen:
                    continue
                seen.add(config)
                gguf_tiles.ONE_ROW_OVERRIDE = config
            else:
                gguf_tiles.OVERRIDE = config
            try:
                tried.append((graph_time(gemv1, copies) * 1e6, config))
            except Exception as exc:  # a setting that does not compile is skipped, not fatal
                print(f"  {name} {label} {config}: {type(exc).__name__}", flush=True)
        gguf_tiles.OVERRIDE = gguf_tiles.ONE_ROW_OVERRIDE = None
        gguf_tiles.ONE_ROW_MIN_ROWS = kept
        tried.sort()
        row["best"] = [{"us": us, "gb_s": packed_bytes / us / 1e3, "config": list(c)} for us, c in tried[:3]]
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q8_0,Q4_K,Q6_K")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gguf_gemv.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the GGUF GEMV kernels run on NVIDIA GPUs"}))
        return 0
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in BY_NAME or not gt.covers(BY_NAME[t].type_id, torch.bfloat16)]
    if unknown:
        print(json.dumps({"error": f"not covered by the GGUF kernels here: {unknown}"}))
        return 1
    configs = None
    if args.sweep:  # (BLOCK_N, groups a tile, warps) of the one-row kernel, by type
        configs = {
            t: [
                (b, values // gguf_tiles.ONE_ROW_GROUPS[t], warps)
                for b, (values, warps) in itertools.product((1, 2, 4, 8, 16), ONE_ROW_TILES)
                if b * values <= 16384  # more spills registers
            ]
            for t in ONE_ROW_TYPES
        }
    copy_gb_s = copy_bandwidth()
    print(json.dumps({"copy_gb_s": copy_gb_s}), flush=True)
    rows = []
    for name in types:
        for shape in SHAPES:
            row = bench(name, shape, configs)
            row["fraction_of_copy_bandwidth"] = row["gemv_gb_s"] / copy_gb_s
            rows.append(row)
            torch.cuda.empty_cache()
    # A layer's seven linears: q, k, v, o, gate, up, down (the head once per step, not counted).
    per_layer = {"q": 1, "k_v": 2, "o": 1, "gate_up": 2, "down": 1}
    summary = {}
    for name in types:
        mine = [r for r in rows if r["type"] == name and r["shape"] in per_layer]
        summary[name] = {
            "layer_gemv_us": sum(per_layer[r["shape"]] * r["gemv_us"] for r in mine),
            "layer_bf16_mm_us": sum(per_layer[r["shape"]] * r["bf16_mm_us"] for r in mine),
        }
    result = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gb_s": copy_gb_s,
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": summary, "written": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
