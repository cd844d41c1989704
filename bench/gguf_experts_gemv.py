"""Time the GGUF experts GEMV (gguf_experts.experts_gemv: the decode step's picked experts read in place
by id) on DeepSeek-V4-Flash's expert shapes, over a sweep of its tile settings.

    PYTHONPATH=. python3 bench/gguf_experts_gemv.py [--types Q2_K,Q3_K] [--general] [--layer] [--out F]

256 stacked experts of a projection (gate/up: 2048 x 4096, down: 4096 x 2048), 6 picked a call, the
picks drawn anew for each of the graph's calls (the stack is many times the L2 cache, as a layer's
experts are). Each setting is replayed from one CUDA graph, median of 5 replays. Two kernels: the
general GEMV in its experts form (gguf_blocks_triton; (BLOCK_N, values per iteration, warps)) and,
for the types in gguf_tiles.EXPERTS_ONE_ROW, gguf_experts_triton's (BLOCK_N, groups a tile, warps),
which experts_gemv runs for them (its time includes the index_select that writes the input in its
read order). One JSON line a type, shape and kernel with the default's time, the best three and the
picked bytes' GB/s against the copy bandwidth; a type's setting with the least time over both shapes
goes in "tiles" (general, gguf_tiles.EXPERTS_TILES) and "one_row_tiles" (EXPERTS_ONE_ROW), which
bench/flash_one_gpu.py --experts-tiles FILE runs with. The general kernel is swept with --general;
without, only its current setting is timed, beside the other kernel. --layer also times a decode
step's whole routed experts (Q2_K gate and up, Q3_K down, one graph): gate, up, the SwiGLU and down
as four kernels (plus down's input order) against gate and up as one kernel with the SwiGLU folded
in (experts_swiglu) and down, over the pair kernel's settings ("layer" in the JSON). Without CUDA it
prints why and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_gemv import BY_NAME, copy_bandwidth, graph_time, packed_weight  # a sibling script

from ds4desk.engine.formats import gguf_packed_bytes
from ds4desk.engine.kernels.deepseek_v4 import moe_tail
from ds4desk.engine.kernels.quant import gguf_experts, gguf_launch, gguf_tiles
from ds4desk.engine.kernels.quant import gguf_triton as gt

EXPERTS, PICKED, HIDDEN, WIDTH = 256, 6, 4096, 2048
SHAPES = (("gate/up", WIDTH, HIDDEN, 1), ("down", HIDDEN, WIDTH, PICKED))  # (name, rows, cols, x rows)
GENERAL_SETTINGS = list(itertools.product((1, 2, 4), (256, 512, 1024), (2, 4, 8)))
ONE_ROW_SETTINGS = [
    (block_n, groups, warps)
    for block_n, groups, warps in itertools.product((2, 4, 8), (16, 32, 64), (1, 2, 4))
    if block_n * groups >= 32 * warps  # no thread without an element of the tile
]
DRAWS = 16  # pick sets cycled through by the graph


def bench(name: str, shape: tuple[str, int, int, int], bandwidth: float, kernel: str, sweep: bool) -> dict:
    label, rows, cols, x_rows = shape
    kind = BY_NAME[name]
    stacked = packed_weight(name, EXPERTS * rows, cols, seed=rows).view(EXPERTS, rows, -1)
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(EXPERTS, generator=gen)[:PICKED].cuda() for _ in range(DRAWS)]
    x = torch.randn(x_rows, cols, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(PICKED, rows, device="cuda", dtype=torch.bfloat16)
    picked_bytes = PICKED * rows * gguf_packed_bytes(kind.type_id, (cols,))

    def call(i: int) -> None:
        gguf_experts.experts_gemv(x, picks[i], stacked, kind.type_id, cols, out)

    one_row = gguf_tiles.EXPERTS_ONE_ROW.pop(name, None)  # the general kernel runs while it is out
    general = kernel == "general"
    if not general:
        gguf_tiles.EXPERTS_ONE_ROW[name] = one_row
    settings = (GENERAL_SETTINGS if general else ONE_ROW_SETTINGS) if sweep else []
    timings = {}
    for setting in [None, *settings]:
        gguf_tiles.OVERRIDE, gguf_tiles.EXPERTS_OVERRIDE = (setting, None) if general else (None, setting)
        try:
            timings[setting] = graph_time(call, DRAWS)
        except Exception as error:  # a setting the compiler refuses (registers, shared memory)
            print(f"  {name} {label} {setting}: {type(error).__name__}", file=sys.stderr)
    gguf_tiles.OVERRIDE = gguf_tiles.EXPERTS_OVERRIDE = None
    if one_row is not None:
        gguf_tiles.EXPERTS_ONE_ROW[name] = one_row
    default = timings.pop(None)
    current = (
        gguf_tiles.experts_config(name, rows, cols, 132)
        if general
        else gguf_tiles.experts_one_row_config(name, cols)
    )
    timings.setdefault(tuple(current), default)
    every = {",".join(map(str, s)): t * 1e6 for s, t in timings.items()}
    best = sorted(timings.items(), key=lambda item: item[1])[:3]
    return {
        "type": name,
        "shape": label,
        "kernel": kernel,
        "rows": rows,
        "cols": cols,
        "picked_bytes": picked_bytes,
        "default_us": default * 1e6,
        "default_gb_s": picked_bytes / default / 1e9,
        "best": [{"setting": list(s), "us": t * 1e6, "gb_s": picked_bytes / t / 1e9} for s, t in best],
        "best_of_copy_bandwidth": picked_bytes / best[0][1] / 1e9 / bandwidth,
        "every_us": every,
    }


def bench_layer() -> dict:
    """A decode step's routed experts, Q2_K gate and up, Q3_K down: the separate kernels against the
    gate and up pair with its SwiGLU, at the pair's current setting and over its sweep."""
    gate_type, down_type = BY_NAME["Q2_K"].type_id, BY_NAME["Q3_K"].type_id
    gate, up = (
        packed_weight("Q2_K", EXPERTS * WIDTH, HIDDEN, seed=s).view(EXPERTS, WIDTH, -1) for s in (1, 2)
    )
    down = packed_weight("Q3_K", EXPERTS * HIDDEN, WIDTH, seed=3).view(EXPERTS, HIDDEN, -1)
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(EXPERTS, generator=gen)[:PICKED].cuda() for _ in range(DRAWS)]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gate_out, up_out, act = (torch.empty(PICKED, WIDTH, device="cuda", dtype=x.dtype) for _ in range(3))
    out = torch.empty(PICKED, HIDDEN, device="cuda", dtype=x.dtype)
    limit = 10.0
    positions = gguf_experts.write_order(WIDTH, down_type, x.device)

    def separate(i: int) -> None:
        x_read = gguf_experts.experts_input(x, gate_type, HIDDEN)
        gguf_experts.experts_gemv(x_read, picks[i], gate, gate_type, HIDDEN, gate_out, ordered=True)
        gguf_experts.experts_gemv(x_read, picks[i], up, gate_type, HIDDEN, up_out, ordered=True)
        activated = moe_tail.swiglu(gate_out, up_out, limit)
        gguf_experts.experts_gemv(activated, picks[i], down, down_type, WIDTH, out)

    def paired(setting: tuple[int, int, int]) -> Callable[[int], None]:
        order = gguf_experts.read_order(HIDDEN, setting[1], x.device)
        run = gguf_launch.kernels()

        def call(i: int) -> None:
            x_read = x.index_select(1, order)
            run.experts_swiglu(x_read, picks[i], gate, up, gate_type, HIDDEN, limit, act, positions, setting)
            gguf_experts.experts_gemv(act, picks[i], down, down_type, WIDTH, out, ordered=True)

        return call

    current = tuple(gguf_tiles.experts_one_row_config("Q2_K", HIDDEN))
    timings = {"separate": graph_time(separate, DRAWS)}
    for setting in dict.fromkeys([current, *ONE_ROW_SETTINGS]):
        try:
            timings[",".join(map(str, setting))] = graph_time(paired(setting), DRAWS)
        except Exception as error:  # a setting the compiler refuses
            print(f"  pair {setting}: {type(error).__name__}", file=sys.stderr)
    key = ",".join(map(str, current))
    best = min((k for k in timings if k != "separate"), key=timings.get)
    return {
        "separate_us": timings["separate"] * 1e6,
        "paired_current": key,
        "paired_current_us": timings[key] * 1e6,
        "paired_best": best,
        "paired_best_us": timings[best] * 1e6,
        "every_us": {k: t * 1e6 for k, t in timings.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q2_K,Q3_K")
    parser.add_argument("--general", action="store_true", help="sweep the general kernel's settings too")
    parser.add_argument(
        "--layer", action="store_true", help="also time a step's routed experts, paired or not"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (torch.cuda.is_available() and gt.enabled(torch.device("cuda"))):
        print("needs an NVIDIA GPU with Triton")
        return 0
    bandwidth = copy_bandwidth()
    result = {
        "date": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
        "device": torch.cuda.get_device_name(),
        "copy_gb_s": bandwidth,
        "rows": [],
        "tiles": {},
        "one_row_tiles": {},
    }
    for name in filter(None, args.types.split(",")):  # --types "": only --layer
        kernels = [("general", "tiles", args.general)]
        if name in gguf_tiles.EXPERTS_ONE_ROW:
            kernels.append(("one_row", "one_row_tiles", True))
        for kernel, key, sweep in kernels:
            rows = [bench(name, shape, bandwidth, kernel, sweep) for shape in SHAPES]
            for row in rows:
                print(json.dumps({k: v for k, v in row.items() if k != "every_us"}), flush=True)
            common = set.intersection(*(set(row["every_us"]) for row in rows))
            best = min(common, key=lambda key: sum(row["every_us"][key] for row in rows))
            result[key][name] = [int(v) for v in best.split(",")]
            result["rows"] += rows
    print(json.dumps({"tiles": result["tiles"], "one_row_tiles": result["one_row_tiles"]}), flush=True)
    if args.layer:
        result["layer"] = bench_layer()
        print(json.dumps({k: v for k, v in result["layer"].items() if k != "every_us"}), flush=True)
    out = args.out or Path(__file__).resolve().parent / "results" / f"gguf_experts_gemv_{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
