"""What the GGUF Triton kernels run with: each block type's tile, the GEMVs' launch settings (the
values an H200 sweep picked, and the overrides a sweep or a test sets), and which kernel takes a
matrix: the general GEMV of gguf_blocks_triton.py, the one-row GEMV of gguf_gemv1_triton.py, or for
stacked experts gguf_experts_triton.py. Plain data and pure functions of shapes: gguf_launch.py
launches with them, gguf_triton.py and gguf_experts.py choose with them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4desk.engine.formats import E2M1_VALUES, IQ4_NL_VALUES
from ds4desk.engine.kernels.launch import next_power_of_two

# The one-row GEMV of gguf_gemv1_triton: the values in a group of each type it takes (the run that
# shares its scales), the rows from which a matrix takes it (measured on an H200 with
# bench/gguf_gemv.py: below, its programs are too few to hide the loads and the general kernel is
# faster; empty: never), and the (BLOCK_N, groups a tile, num_warps) forced for it (the sweep).
ONE_ROW_GROUPS = {"Q8_0": 32, "Q4_K": 64, "Q6_K": 64}
ONE_ROW_MIN_ROWS = {"Q8_0": 1024, "Q4_K": 1024, "Q6_K": 1024}
ONE_ROW_OVERRIDE: tuple[int, int, int] | None = None
INPUT_COPY, INPUT_NORM, INPUT_SILU = 0, 1, 2  # gguf_gemv1_triton.input_kernel's MODE
# The one-row types whose GEMV reads its input in read order (gguf_gemv1_triton.slot_col). Q8_0 reads
# the row as it is: on an H200 its GEMV was 1.4-1.6x slower in read order (bench/gguf_gemv.py),
# where Q4_K's gate/up and head were 1.4-1.6x faster.
READ_ORDER_TYPES = ("Q4_K", "Q6_K")
# Rows of x up to which the GEMV runs; beyond, dequantize + cuBLAS, whose cost does not grow with T.
GEMV_MAX_ROWS = 8
# (BLOCK_N, values per row per iteration, num_warps) forced for every GEMV: what the sweep tries.
OVERRIDE: tuple[int, int, int] | None = None
# (BLOCK_N, values per row per iteration, num_warps) of experts_gemv's general kernel by block type,
# where a sweep on an H200 (bench/gguf_experts_gemv.py, Flash's expert shapes, 6 of 256 experts)
# beat gemv_config: Q2_K 35.4 -> 29.6 us (gate/up) and 34.9 -> 28.6 us (down), Q3_K 43.6 -> 35.0 and
# 46.3 -> 33.3 us (13-15% of the copy bandwidth). On a GPU these two types now take EXPERTS_ONE_ROW.
EXPERTS_TILES: dict[str, tuple[int, int, int]] = {"Q2_K": (4, 512, 2), "Q3_K": (4, 256, 2)}
# The types experts_gemv runs on gguf_experts_triton's kernel (groups of 64 values, input in read
# order), and its (BLOCK_N, groups a tile, num_warps): the least time over Flash's two expert shapes
# in an H200 sweep (bench/gguf_experts_gemv.py, 2026-12-05: 19-26 us a call of six experts, against
# 33-35 us on the general GEMV). EXPERTS_OVERRIDE forces one (the sweep, the tests).
EXPERTS_ONE_ROW: dict[str, tuple[int, int, int]] = {"Q2_K": (4, 32, 1), "Q3_K": (2, 32, 1)}
EXPERTS_OVERRIDE: tuple[int, int, int] | None = None

# The one-row GEMV on Q8_0_ROWS (gguf_rows_triton): (BLOCK_N, BLOCK_K, num_warps) forced for it (the
# sweep, the tests), and the rows up to which its programs compute their normed or activated input
# themselves (each reads the row from L2: on an H100 that cost 0.5 µs on 2048 rows, 3 µs on 16,384
# and 6 µs on the 49,152-row head, where an input kernel costs 1.1-1.6 µs).
ROWS_OVERRIDE: tuple[int, int, int] | None = None
ROWS_OWN_INPUT_MAX_ROWS = 8192

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Each type's tile (L, V): L values per sub-block (the run that shares one scale), and V, the bytes
# its codes are read by (int32 or int16 units: the alignment its blocks give its code bytes; Q8_0's
# 34-byte blocks put them at even addresses only, MXFP4's 17-byte blocks at any).
TILES = {
    "Q4_0": (32, 2),
    "Q4_1": (32, 4),
    "Q5_0": (32, 2),
    "Q5_1": (32, 4),
    "Q8_0": (32, 2),
    "Q8_0_ROWS": (32, 4),
    "Q2_K": (16, 4),
    "Q3_K": (16, 2),
    "Q4_K": (32, 4),
    "Q5_K": (32, 4),
    "Q6_K": (16, 2),
    "IQ4_NL": (32, 2),
    "IQ4_XS": (32, 4),
    "MXFP4": (32, 1),
}
# MXFP4's e2m1 values doubled (integers; code 8, "-0", gives +0 as in GGML), see gguf._mxfp4.
_E2M1_DOUBLED = tuple(int(2 * v) for v in E2M1_VALUES)
MXFP4_DOUBLED = _E2M1_DOUBLED + tuple(-v for v in _E2M1_DOUBLED)
DEQUANT_BLOCK_N = 8  # rows a dequantize program writes (by 256 values)


def codebook_words(values: Sequence[int]) -> tuple[int, int, int, int]:
    """16 int8 values packed little-endian into four int32 words (signed, to pass as i32)."""
    raw = [int(v) & 0xFF for v in values]
    words = [sum(raw[4 * i + j] << (8 * j) for j in range(4)) for i in range(4)]
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return signed[0], signed[1], signed[2], signed[3]


# The codebook words each table type's kernel takes (see gguf_blocks_triton._codebook).
CODEBOOK_WORDS = {
    "IQ4_NL": codebook_words(IQ4_NL_VALUES),
    "IQ4_XS": codebook_words(IQ4_NL_VALUES),
    "MXFP4": codebook_words(MXFP4_DOUBLED),
}


def gemv_config(rows: int, cols: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, values per row per iteration, num_warps). Each iteration decodes up to 1024 values
    of each of its rows (about 0.5-1 KB of packed bytes a row in flight); BLOCK_N is the most rows
    (4, 2 or 1) that still gives every SM a program (the 512 rows of a k/v projection: 2 a program)."""
    if OVERRIDE is not None:
        return OVERRIDE
    values = min(1024, next_power_of_two(cols))
    block_n = next((b for b in (4, 2) if -(-rows // b) >= sms), 1)
    return block_n, values, 8 if block_n * values >= 4096 else 4


def experts_config(name: str, rows: int, cols: int, sms: int) -> tuple[int, int, int]:
    """experts_gemv's gemv_config for block type `name`: its EXPERTS_TILES setting, unless OVERRIDE."""
    tiles = EXPERTS_TILES.get(name)
    return gemv_config(rows, cols, sms) if tiles is None or OVERRIDE is not None else tiles


def one_row_fits(name: str, rows: int) -> bool:
    """Whether a one-row GEMV of this type and height takes gguf_gemv1_triton's kernel."""
    return name in ONE_ROW_MIN_ROWS and rows >= ONE_ROW_MIN_ROWS[name]


def one_row_config(name: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, groups a tile, num_warps) of the one-row kernel: the best of bench/gguf_gemv.py
    --sweep on an H200 for the benchmark model's shapes, within 5%. Few rows a program and, for a
    long row, tiles of 4096 values over 4 warps (the warps split the row, Triton sums them): a
    program per 4-8 rows of one warp left 0.5 waves of programs and 11% occupancy (Nsight Compute),
    too few loads in flight to cover the memory latency. Q8_0 keeps its earlier settings: 4 rows a
    program, 8 from 8192 rows and 16 from 32768 (the head), tiles of 2048 values (1024 at 16)."""
    if ONE_ROW_OVERRIDE is not None:
        return ONE_ROW_OVERRIDE
    if name == "Q4_K" and rows >= 32768:
        block_n, values, warps = 8, 1024, 1
    elif name == "Q4_K":
        block_n, values, warps = (4, 4096, 4) if cols >= 8192 else (2, 2048, 1)
    elif name == "Q6_K":
        block_n, values, warps = (1, 2048, 1) if cols >= 8192 else (2, 2048, 1)
    else:
        block_n = 16 if rows >= 32768 else 8 if rows >= 8192 else 4
        values, warps = 1024 if block_n == 16 else 2048, 1
    return block_n, values // ONE_ROW_GROUPS[name], warps


def rows_config(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the Q8_0_ROWS one-row GEMV, within 3% of the best of H100
    sweeps on the benchmark model's shapes in their fused forms (docs/BENCHMARKS.md): tiles of 2048
    values; 8 rows a program over 4 warps from 3072 rows (q/k/v, gate/up: 5.9 -> 4.5 µs on q/k/v
    against 4 rows over 2), over 2 warps for the head; 4 rows over 2 warps on 2048 (o) and 2 below
    (a k/v's 512 rows: a program for every SM); a row of more than one 2048-value tile (DeepSeek-V4's
    4096, 8192) 1024 values over 8 warps: the prefetched second tile of 8 x 2048 over fewer warps
    spills registers (V4's 129,280 x 4096 head took 18.1 ms, 247 µs so)."""
    if ROWS_OVERRIDE is not None:
        return ROWS_OVERRIDE
    block_k = next(size for size in (2048, 1024, 512, 256, 128, 64, 32) if cols % size == 0)
    if cols > 2048:
        return 4, min(block_k, 1024), 8
    if rows >= 32768:
        return 8, block_k, 2
    if rows >= 3072:
        return 8, block_k, 4
    return (4 if rows >= 2048 else 2), block_k, 2


def one_row_plan(name: str, rows: int, cols: int) -> tuple[tuple[int, int, int], int, int]:
    """((BLOCK_N, groups a tile, num_warps), groups a row, entries of the prepared input) of the
    one-row kernel (a read-order input holds whole tiles, to a power of two; a row-order one, cols)."""
    block_n, groups, warps = one_row_config(name, rows, cols)
    n_groups = cols // ONE_ROW_GROUPS[name]
    groups = min(groups, next_power_of_two(n_groups))
    size = cols
    if name in READ_ORDER_TYPES:
        size = next_power_of_two(-(-n_groups // groups) * groups * ONE_ROW_GROUPS[name])
    return (block_n, groups, warps), n_groups, size


def experts_one_row_config(name: str, cols: int, on_gpu: bool = True) -> tuple[int, int, int] | None:
    """(BLOCK_N, groups a tile, num_warps) of gguf_experts_triton's kernel for experts of this type
    and width, None where the general kernel runs them: another type, or CPU tensors (Triton's
    interpreter in the tests, which runs one program at a time: this kernel's many small programs
    took a model test from 2 minutes past 7; EXPERTS_OVERRIDE runs it there too). The groups a tile
    are halved until a row is a whole number of tiles (a row's 64-value groups come in fours)."""
    if name not in EXPERTS_ONE_ROW or not (on_gpu or EXPERTS_OVERRIDE is not None):
        return None
    block_n, groups, warps = EXPERTS_OVERRIDE if EXPERTS_OVERRIDE is not None else EXPERTS_ONE_ROW[name]
    while (cols // 64) % groups:
        groups //= 2
    return block_n, groups, warps
