"""Triton (CUDA) kernels for matmuls on GGUF-packed weights: y = x @ dequantize(weight)ᵀ.

`weight` is uint8 [rows, row_bytes], the file's GGML blocks (blocks run along a row); the kernel
source is gguf_blocks_triton.py. Two paths, picked by the rows of x (shapes only: no host sync, so
both can be captured in a CUDA graph):

- up to GEMV_MAX_ROWS rows (decode): a GEMV that decodes each tile of the weight in registers once
  and multiplies it by every row of x. A program takes a few weight rows whole (no split of the
  columns, so a result is one sum rounded once), and there are enough programs for every SM.
  The decode step's fused forms mirror dense/gemv.py: `gemv_add_` adds into the residual in place
  (optionally reading SiLU(gate) · up from a gate/up row), `norm_gemv` reads RMSNorm(x) · norm.
  One row of x times a tall Q8_0, Q4_K or Q6_K matrix (`one_row_fits`) takes the one-row GEMV of
  gguf_gemv1_triton.py instead, with the (normed or activated) input row prepared once by its own
  kernel (for Q4_K and Q6_K in float32 and in the order the GEMV's threads read it; `normed_row`
  gives the normed row to a q/k/v group whose parts differ in type).
- longer x (prefill): the weight is dequantized into a scratch of x's dtype, a slice of rows at a
  time, and multiplied by one torch.mm (cuBLAS). The dequantize kernel keeps gguf.py's float32
  operations in order and runs without FMA contraction: its values equal the reference's bit for
  bit after the cast to x's dtype.

The kernels cover every GGUF block type ds4desk reads except the plain floats (F32, F16, BF16, which
gguf_matmul never sends here). `reference_*` are the same math in torch, for the tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4desk.engine.formats import E2M1_VALUES, GGUF_TYPES, IQ4_NL_VALUES, gguf_packed_bytes, gguf_type
from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, on_its_device, pdl
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.kernels.quant.common import device_sms, nvidia_cuda

# Default: the kernels for CUDA tensors on NVIDIA GPUs with Triton. Forced on: whatever the device
# (TRITON_INTERPRET=1 runs them on CPU tensors: the tests); off: gguf_matmul's reference path.
SWITCH = Switch("quant.gguf_triton", "the GGUF block-type GEMV and dequantize kernels", nvidia_cuda)

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
# Elements of one dequantized slice of the weight (64 MB in bf16): bounds the prefill scratch.
SCRATCH_ELEMENTS = 1 << 25
# (BLOCK_N, values per row per iteration, num_warps) forced for every GEMV: what the sweep tries.
OVERRIDE: tuple[int, int, int] | None = None
# (BLOCK_N, values per row per iteration, num_warps) of experts_gemv's general kernel by block type,
# where a sweep on an H200 (bench/gguf_experts_gemv.py, Flash's expert shapes, 6 of 256 experts)
# beat gemv_config: Q2_K 35.4 -> 29.6 us (gate/up) and 34.9 -> 28.6 us (down), Q3_K 43.6 -> 35.0 and
# 46.3 -> 33.3 us (13-15% of the copy bandwidth). On a GPU these two types now take EXPERTS_ONE_ROW.
EXPERTS_TILES: dict[str, tuple[int, int, int]] = {"Q2_K": (4, 512, 2), "Q3_K": (4, 256, 2)}
# The types experts_gemv runs on gguf_experts_triton's kernel (groups of 64 values, input in read
# order), and its (BLOCK_N, groups a tile, num_warps): the one-row GEMV's usual shape (a warp a
# program, a few rows), not yet swept on a GPU. EXPERTS_OVERRIDE forces one (the sweep, the tests).
EXPERTS_ONE_ROW: dict[str, tuple[int, int, int]] = {"Q2_K": (4, 32, 1), "Q3_K": (4, 32, 1)}
EXPERTS_OVERRIDE: tuple[int, int, int] | None = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Each type's tile (L, V): L values per sub-block (the run that shares one scale), and V, the bytes
# its codes are read by (int32 or int16 units: the alignment its blocks give its code bytes; Q8_0's
# 34-byte blocks put them at even addresses only, MXFP4's 17-byte blocks at any).
_TILES = {
    "Q4_0": (32, 2),
    "Q4_1": (32, 4),
    "Q5_0": (32, 2),
    "Q5_1": (32, 4),
    "Q8_0": (32, 2),
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
_MXFP4_DOUBLED = _E2M1_DOUBLED + tuple(-v for v in _E2M1_DOUBLED)
_DEQUANT_BLOCK_N = 8  # rows a dequantize program writes (by 256 values)


def _codebook_words(values: Sequence[int]) -> tuple[int, int, int, int]:
    """16 int8 values packed little-endian into four int32 words (signed, to pass as i32)."""
    raw = [int(v) & 0xFF for v in values]
    words = [sum(raw[4 * i + j] << (8 * j) for j in range(4)) for i in range(4)]
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return signed[0], signed[1], signed[2], signed[3]


# The codebook words each table type's kernel takes (see gguf_blocks_triton._codebook).
_CODEBOOK_WORDS = {
    "IQ4_NL": _codebook_words(IQ4_NL_VALUES),
    "IQ4_XS": _codebook_words(IQ4_NL_VALUES),
    "MXFP4": _codebook_words(_MXFP4_DOUBLED),
}


def enabled(where: Where) -> bool:
    """Whether the GGUF kernels run for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where) and _kernels() is not None


def covers(type_id: int, dtype: torch.dtype) -> bool:
    """Whether `matmul` runs this type for CUDA activations of `dtype`."""
    try:
        name = gguf_type(type_id).name
    except ValueError:
        return False
    return name in _TILES and dtype in _DTYPES and enabled(torch.device("cuda"))


def one_row(x: torch.Tensor, type_id: int) -> bool:
    """Whether the fused one-row forms (`gemv_add_`, `norm_gemv`) run for x [1, K]."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and x.dtype in _DTYPES
        and gguf_type(type_id).name in _TILES
        and enabled(x)
    )


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


def _one_row_plan(name: str, rows: int, cols: int) -> tuple[tuple[int, int, int], int, int]:
    """((BLOCK_N, groups a tile, num_warps), groups a row, entries of the prepared input) of the
    one-row kernel (a read-order input holds whole tiles, to a power of two; a row-order one, cols)."""
    block_n, groups, warps = one_row_config(name, rows, cols)
    n_groups = cols // ONE_ROW_GROUPS[name]
    groups = min(groups, next_power_of_two(n_groups))
    size = cols
    if name in READ_ORDER_TYPES:
        size = next_power_of_two(-(-n_groups // groups) * groups * ONE_ROW_GROUPS[name])
    return (block_n, groups, warps), n_groups, size


# --- torch forms (the tests' reference) -----------------------------------------------------------


def reference_matmul(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """x @ dequantize(weight)ᵀ in float32."""
    return x.float() @ gguf.dequantize(weight, type_id, (weight.shape[0], cols)).t()


def reference_gemv_add_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, silu: bool
) -> torch.Tensor:
    if silu:
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate) * up).to(x.dtype)
    return residual.copy_(residual.float() + reference_matmul(x, weight, type_id, cols))


def reference_norm_gemv(
    x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, eps: float
) -> torch.Tensor:
    h = F.rms_norm(x.float(), (cols,), norm.float(), eps).to(x.dtype)
    return reference_matmul(h, weight, type_id, cols)


# --- the launchers --------------------------------------------------------------------------------


def matmul(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, rows] = x [T, cols] @ dequantize(weight [rows, row_bytes])ᵀ, in out's dtype."""
    _check(x, weight, type_id, cols, cols)
    if x.shape[0] == 0:
        return out
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, weight, type_id, cols, out)
    rows = weight.shape[0]
    chunk = max(1, min(rows, SCRATCH_ELEMENTS // cols))
    scratch = torch.empty((chunk, cols), device=x.device, dtype=x.dtype)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        w = dequantize_into(weight[start:stop], type_id, cols, scratch[: stop - start])
        if start == 0 and stop == rows and out.is_contiguous():
            torch.mm(x, w.t(), out=out)
        else:
            out[:, start:stop].copy_(torch.mm(x, w.t()))
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """out [T, rows] = x [T, cols] @ Wᵀ for T <= GEMV_MAX_ROWS, in out's dtype."""
    _check(x, weight, type_id, cols, cols)
    return _launch(x, weight, type_id, cols, out, None, 0.0, silu=False, with_norm=False, residual=False)


def experts_gemv(
    x: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor,
    type_id: int,
    cols: int,
    out: torch.Tensor,
    ordered: bool = False,
) -> torch.Tensor:
    """out [k, rows]: slot j's row is x_j @ dequantize(weight[ids[j]])ᵀ, for the stacked packed
    matrices weight [experts, rows, row_bytes] and the k expert ids `ids` (int64, on the device: no
    host read, no copy of the picked blocks). x is [1, cols] (one row for every slot: the experts'
    gate and up projections) or [k, cols] (a row a slot: their down projection). `ordered`: x is
    already what experts_input gave for this type and width (gate and up then share one)."""
    kind = gguf_type(type_id)
    if kind.name not in _TILES:
        raise ValueError(f"the GGUF kernels do not take {kind.name}")
    k = ids.shape[0]
    row_bytes = gguf_packed_bytes(type_id, (cols,))
    if weight.dtype != torch.uint8 or weight.dim() != 3 or weight.shape[2] != row_bytes:
        raise ValueError(f"stacked {kind.name} experts of {cols} columns: uint8 [experts, rows, {row_bytes}]")
    if not weight.is_contiguous() or ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError("experts_gemv needs contiguous stacked experts and int64 ids [k]")
    if x.dim() != 2 or x.shape[0] not in (1, k) or x.shape[1] != cols or x.stride(1) != 1:
        raise ValueError(f"x must be [1 or {k}, {cols}] with rows contiguous, got {list(x.shape)}")
    if x.dtype not in _DTYPES or out.dtype != x.dtype:
        raise ValueError(f"x and out must be float32, bfloat16 or float16, got {x.dtype} and {out.dtype}")
    if out.shape != (k, weight.shape[1]) or out.stride(1) != 1:
        raise ValueError(f"out must be [{k}, {weight.shape[1]}] with rows contiguous, got {list(out.shape)}")
    if k:
        kernels = _kernels()
        assert kernels is not None
        config = experts_one_row_config(kind.name, cols, x.is_cuda)
        if config is None:
            kernels.experts_gemv(x, ids, weight, type_id, cols, out)
        else:
            x_read = x if ordered else experts_input(x, type_id, cols)
            kernels.experts_one_row(x_read, ids, weight, type_id, cols, out, config)
    return out


def experts_input(x: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """x [r, cols] as experts_gemv's kernel for this type reads it: in gguf_experts_triton's read
    order (one index_select) where that kernel runs, else x itself. Pass it with ordered=True."""
    config = experts_one_row_config(gguf_type(type_id).name, cols, x.is_cuda)
    return x if config is None else x.index_select(1, _read_order(cols, config[1], x.device))


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


@functools.cache
def _read_order(cols: int, groups: int, device: torch.device) -> torch.Tensor:
    """The columns of a row in the order gguf_experts_triton's kernel reads them, with tiles of
    `groups` groups: entry tile · 64 G + step · G + i is the value group tile · G + i reads at
    `step` (0..63), whose 4-byte code word step // 16 holds it in field (step // 4) % 4, byte step % 4.
    The group of quarter q of super-block b holds half q // 2's values from 16 (q % 2) on."""
    d = torch.arange(cols, device=device)
    tile, rest = d // (groups * 64), d % (groups * 64)
    step, group = rest // groups, tile * groups + rest % groups
    byte = 4 * (step // 16) + step % 4
    field = (step // 4) % 4
    return (group // 4) * 256 + ((group % 4) // 2) * 128 + 32 * field + (group % 2) * 16 + byte


def gemv_add_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, silu: bool = False
) -> torch.Tensor:
    """residual [1, rows] += x @ Wᵀ in place, rounded once; silu: x is [1, 2 cols] gate | up and the
    input is SiLU(gate) · up rounded to x's dtype."""
    _check(x, weight, type_id, cols, 2 * cols if silu else cols)
    return _launch(x, weight, type_id, cols, residual, None, 0.0, silu=silu, with_norm=False, residual=True)


def norm_gemv(
    x: torch.Tensor,
    norm: torch.Tensor,
    weight: torch.Tensor,
    type_id: int,
    cols: int,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [1, rows] = RMSNorm(x [1, cols]; norm, eps) rounded to x's dtype, @ Wᵀ."""
    _check(x, weight, type_id, cols, cols)
    if x.shape[0] != 1:
        raise ValueError(f"norm_gemv takes one row, got {x.shape[0]}")
    return _launch(x, weight, type_id, cols, out, norm, eps, silu=False, with_norm=True, residual=False)


def normed_row(x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x [1, cols]; norm, eps) in x's dtype, in one kernel: the input of a group of packed
    projections whose types differ (each part then runs its own GEMV on it)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in _DTYPES or norm.shape != (x.shape[1],):
        raise ValueError(f"normed_row takes one float row and its norm weight, got {list(x.shape)}")
    kernels = _kernels()
    assert kernels is not None
    out = torch.empty_like(x)
    kernels.prepare(x.contiguous(), norm, eps, x.shape[1], out, INPUT_NORM)
    return out


def normed_row_and_input(
    x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor, type_id: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """normed_row, and in the same kernel the same row as the input of the one-row GEMV of `weight`
    in its read order (read_order_groups must not be None), for `gemv_prepared`: the first part of a
    group whose parts differ in type then needs no input kernel of its own."""
    groups = read_order_groups(weight, type_id, cols)
    if groups is None or x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != cols:
        raise ValueError("normed_row_and_input takes one row and a weight whose GEMV reads in read order")
    kernels = _kernels()
    assert kernels is not None
    row = torch.empty_like(x)
    name = gguf_type(type_id).name
    prepared = torch.empty(_one_row_plan(name, weight.shape[0], cols)[2], device=x.device)
    order = (type_id, groups, cols // ONE_ROW_GROUPS[name])
    kernels.prepare(x.contiguous(), norm, eps, cols, prepared, INPUT_NORM, order, row)
    return row, prepared


def _type_name(type_id: int) -> str:
    """The GGUF type's name, "" for an id ds4desk does not read (no one-row kernel takes it)."""
    kind = GGUF_TYPES.get(type_id)
    return kind.name if kind is not None else ""


def silu_pair_fits(gate_up: torch.Tensor, gate_up_type: int, down: torch.Tensor, down_type: int) -> bool:
    """Whether a one-row gate | up GEMV can write its down projection's input itself
    (`norm_gemv_silu`, then `gemv_prepared`): both Q4_K or Q6_K (the K-quant mixes) on the one-row
    kernel. The Q8_0 pair measured slower on an H200 (its 16 rows a program spilled registers); a
    Q8_0 down keeps its own input kernel."""
    names = [_type_name(gate_up_type), _type_name(down_type)]
    return (
        gate_up.shape[0] % 2 == 0
        and all(name in READ_ORDER_TYPES for name in names)
        and one_row_fits(names[0], gate_up.shape[0])
        and one_row_fits(names[1], down.shape[0])
        and enabled(gate_up)
    )


def read_order_groups(weight: torch.Tensor, type_id: int, cols: int) -> int | None:
    """The groups a tile of the one-row GEMV of this weight, where that GEMV reads its input in read
    order (gguf_gemv1_triton.slot_col; a kernel before it can write that input itself); else None."""
    name = _type_name(type_id)
    if name not in READ_ORDER_TYPES or not one_row_fits(name, weight.shape[0]) or not enabled(weight):
        return None
    return _one_row_plan(name, weight.shape[0], cols)[0][1]


def prepared_input(weight: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """A buffer for the input of the one-row GEMV of this weight (a type in READ_ORDER_TYPES) as a
    kernel before it writes it (norm_gemv_silu, the fused decode attention), for `gemv_prepared`:
    float32 in the GEMV's read order. Zeros: the entries past the row's groups are never written and
    must read as 0. Allocate it once, outside a captured graph."""
    name = gguf_type(type_id).name
    if name not in READ_ORDER_TYPES:
        raise ValueError(f"{name}'s one-row GEMV reads its input as it is")
    size = _one_row_plan(name, weight.shape[0], cols)[2]
    return torch.zeros(size, device=weight.device, dtype=torch.float32)


def norm_gemv_silu(
    x: torch.Tensor,
    norm: torch.Tensor,
    weight: torch.Tensor,
    type_id: int,
    cols: int,
    eps: float,
    out: torch.Tensor,
    act: torch.Tensor,
    down: torch.Tensor,
    down_type: int,
) -> torch.Tensor:
    """norm_gemv for a gate | up weight [2 F, ...] that also writes act = SiLU(gate) · up (rounded to
    x's dtype) as the prepared input of the down projection `down` (see prepared_input): the down's own
    input kernel is saved. out gets gate | up as norm_gemv would."""
    _check(x, weight, type_id, cols, cols)
    if x.shape[0] != 1 or not silu_pair_fits(weight, type_id, down, down_type):
        raise ValueError("norm_gemv_silu takes one row and a gate | up / down pair that silu_pair_fits")
    pair = (act, down_type, down.shape[0])
    return _launch(
        x,
        weight,
        type_id,
        cols,
        out,
        norm,
        eps,
        silu=False,
        with_norm=True,
        residual=False,
        pair=pair,
    )


def gemv_prepared(
    prepared: torch.Tensor,
    weight: torch.Tensor,
    type_id: int,
    cols: int,
    out: torch.Tensor,
    residual: bool = False,
) -> torch.Tensor:
    """out [1, rows] (+)= input @ Wᵀ (residual: added in place), where `prepared` is the input as a
    kernel before wrote it for this weight's one-row GEMV (see prepared_input)."""
    _check_weight(weight, type_id, cols)
    if out.dim() != 2 or out.shape != (1, weight.shape[0]):
        raise ValueError(f"out must be [1, {weight.shape[0]}], got {list(out.shape)}")
    kernels = _kernels()
    assert kernels is not None
    # `out` stands in for the input row: with `prepared` given, the launcher reads only its shape.
    kernels.gemv(out, weight, type_id, cols, out, None, 0.0, False, False, residual, prepared)
    return out


def dequantize_into(weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """out [rows, cols] (float32, bfloat16 or float16) = dequantize(weight), rounded once to out's
    dtype: equal to gguf.dequantize(...).to(out.dtype)."""
    _check_weight(weight, type_id, cols)
    if out.shape != (weight.shape[0], cols) or out.stride(1) != 1 or out.dtype not in _DTYPES:
        raise ValueError(f"dequantize_into: out must be [{weight.shape[0]}, {cols}] with rows contiguous")
    kernels = _kernels()
    assert kernels is not None
    kernels.dequantize(weight, type_id, cols, out)
    return out


def _check_weight(weight: torch.Tensor, type_id: int, cols: int) -> None:
    kind = gguf_type(type_id)
    if kind.name not in _TILES:
        raise ValueError(f"the GGUF kernels do not take {kind.name}")
    row_bytes = gguf_packed_bytes(type_id, (cols,))
    if (
        weight.dtype != torch.uint8
        or weight.dim() != 2
        or weight.shape[1] != row_bytes
        or weight.stride(1) != 1
    ):
        raise ValueError(
            f"a packed {kind.name} weight of {cols} columns is uint8 [rows, {row_bytes}], got "
            f"{weight.dtype} {list(weight.shape)}"
        )


def _check(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, x_cols: int) -> None:
    _check_weight(weight, type_id, cols)
    if x.dim() != 2 or x.shape[1] != x_cols or x.dtype not in _DTYPES:
        raise ValueError(f"x must be float [T, {x_cols}], got {x.dtype} {list(x.shape)}")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    type_id: int,
    cols: int,
    out: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    *,
    silu: bool,
    with_norm: bool,
    residual: bool,
    pair: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    if x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"the GGUF GEMV takes up to {GEMV_MAX_ROWS} rows of x, got {x.shape[0]}")
    if out.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"out must be [{x.shape[0]}, {weight.shape[0]}], got {list(out.shape)}")
    kernels = _kernels()
    assert kernels is not None
    kernels.gemv(x, weight, type_id, cols, out, norm, eps, silu, with_norm, residual, None, pair)
    return out


def _aligned(weight: torch.Tensor) -> torch.Tensor:
    """The weight at a 16-byte aligned address: the kernels read code bytes as int32 / int16 units
    (a copy only for a view that starts mid-allocation at an odd place, which the loader never
    makes: its rows start at multiples of the row bytes)."""
    return weight if weight.data_ptr() % 16 == 0 else weight.clone()


@dataclass(slots=True)
class _Kernels:
    gemv: Callable[..., None]
    dequantize: Callable[..., None]
    prepare: Callable[..., None]
    experts_gemv: Callable[..., None]
    experts_one_row: Callable[..., None]


@functools.cache
def _kernels() -> _Kernels | None:
    try:
        from ds4desk.engine.kernels.quant import gguf_blocks_triton as source
        from ds4desk.engine.kernels.quant import gguf_experts_triton as experts_source
        from ds4desk.engine.kernels.quant import gguf_gemv1_triton as one_row_source
    except Exception:  # no Triton: gguf_matmul's reference path runs
        return None

    def launch_gemv(
        x: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        cols: int,
        out: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        silu: bool,
        with_norm: bool,
        residual: bool,
        prepared: torch.Tensor | None = None,
        pair: tuple[torch.Tensor, int, int] | None = None,
    ) -> None:
        rows, t = weight.shape[0], x.shape[0]
        if rows == 0 or t == 0:
            return
        weight = _aligned(weight)
        name = gguf_type(type_id).name
        if prepared is not None and not (t == 1 and one_row_fits(name, rows)):
            raise ValueError(f"only the one-row GEMV reads a prepared input, not a {rows}-row {name}")
        if t == 1 and one_row_fits(name, rows):
            x = x if x.stride(1) == 1 else x.contiguous()
            target = out if out.stride(1) == 1 else out.contiguous()  # a residual is read, too
            mode = INPUT_SILU if silu else INPUT_NORM if with_norm else INPUT_COPY
            config, n_groups, size = _one_row_plan(name, rows, cols)
            # The input row, prepared once for every program: in the order the GEMV reads it, or
            # (Q8_0, and a plain row) as it is. A given `prepared` was written by the kernel before.
            if prepared is not None:
                x = prepared
            elif name in READ_ORDER_TYPES:
                x_order = torch.empty(size, device=x.device, dtype=torch.float32)
                launch_input(x, norm, eps, cols, x_order, mode, (type_id, config[1], n_groups))
                x = x_order
            elif mode != INPUT_COPY:
                x_row = torch.empty((1, cols), device=x.device, dtype=x.dtype)
                launch_input(x, norm, eps, cols, x_row, mode)
                x = x_row
            launch_one_row(x, weight, type_id, config, n_groups, target, residual, pair)
            if target is not out:
                out.copy_(target)
            return
        x = x if x.stride(1) == 1 else x.contiguous()
        target = out if out.stride(1) == 1 else out.contiguous()  # a residual is read, too
        launch_blocks(x, weight, type_id, cols, target, norm, eps, silu, with_norm, residual, pdl(x))
        if target is not out:
            out.copy_(target)

    def launch_blocks(
        x: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        cols: int,
        out: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        silu: bool,
        with_norm: bool,
        residual: bool,
        use_pdl: bool,
        ids: torch.Tensor | None = None,
    ) -> None:
        """gemv_kernel on weight [rows, row_bytes], every row of x; with `ids`, on stacked matrices
        [experts, rows, row_bytes], one input row (or x's only one) and output row a slot of ids."""
        rows = weight.shape[-2]
        name = gguf_type(type_id).name
        sub, unit = _TILES[name]
        sms = device_sms(x)
        tiles = gemv_config(rows, cols, sms) if ids is None else experts_config(name, rows, cols, sms)
        block_n, values, warps = tiles
        values = max(values, sub)
        t, grid, experts = x.shape[0], (-(-rows // block_n),), {}
        if ids is not None:
            t, grid = 1, (*grid, ids.shape[0])
            x_step = x.stride(0) if x.shape[0] > 1 else 0
            experts = {"ids": ids, "expert_bytes": weight.stride(0), "x_step": x_step}
            experts |= {"out_step": out.stride(0), "EXPERTS": True}
        source.gemv_kernel[grid](
            x,
            weight,
            out,
            norm if norm is not None else x,
            rows,
            weight.stride(-2),
            x.stride(0),
            out.stride(0),
            eps,
            *_CODEBOOK_WORDS.get(name, (0, 0, 0, 0)),
            KIND=type_id,
            L=sub,
            V=unit,
            S=values // sub,
            N_SUB=cols // sub,
            COLS=cols,
            T=t,
            T_PAD=next_power_of_two(t),
            BLOCK_N=block_n,
            SILU=silu,
            NORM=with_norm,
            RESIDUAL=residual,
            PDL=use_pdl,
            num_warps=warps,
            launch_pdl=use_pdl,
            **experts,
        )

    def launch_one_row(
        x: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        config: tuple[int, int, int],
        n_groups: int,
        out: torch.Tensor,
        residual: bool,
        pair: tuple[torch.Tensor, int, int] | None,
    ) -> None:
        """pair: (the down projection's prepared input, its type id, its rows): weight is gate | up,
        and the programs also write SiLU(gate) · up there (gemv1_kernel's PAIRED)."""
        rows = weight.shape[0]
        block_n, groups, warps = config
        use_pdl = pdl(x)
        act, act_kind, act_groups, programs = out, 0, 1, -(-rows // block_n)
        if pair is not None:
            act, act_kind, act_rows = pair
            act_groups = _one_row_plan(gguf_type(act_kind).name, act_rows, rows // 2)[0][1]
            programs = -(-(rows // 2) // block_n)
            block_n *= 2  # block_n units: their gate rows and their up rows
        one_row_source.gemv1_kernel[(programs,)](
            x,
            weight,
            out,
            rows,
            weight.stride(0),
            KIND=type_id,
            G=groups,
            N_GROUPS=n_groups,
            BLOCK_N=block_n,
            RESIDUAL=residual,
            PDL=use_pdl,
            ASM=x.is_cuda,  # PTX where it compiles for a GPU; Triton's interpreter runs CPU tensors
            act=act,
            half_rows=rows // 2,
            PAIRED=pair is not None,
            ACT_KIND=act_kind,
            ACT_G=act_groups,
            num_warps=warps,
            launch_pdl=use_pdl,
        )

    def launch_input(
        x: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        cols: int,
        out: torch.Tensor,
        mode: int,
        order: tuple[int, int, int] | None = None,
        row_out: torch.Tensor | None = None,
    ) -> None:
        """order: (type id, groups a tile, groups a row) of the one-row GEMV that reads `out` (float32,
        in its read order), and row_out the row in row order too (optional); None: `out` in row order
        and x's dtype."""
        use_pdl = pdl(x)
        block = next_power_of_two(cols)
        kind, groups, n_groups = order if order is not None else (0, 1, 0)
        group_values = ONE_ROW_GROUPS[gguf_type(kind).name] if order is not None else 1
        one_row_source.input_kernel[(1,)](
            x,
            norm if norm is not None else x,
            out,
            eps,
            COLS=cols,
            BLOCK=block,
            MODE=mode,
            PDL=use_pdl,
            KIND=kind,
            G=groups,
            V=group_values,
            N_GROUPS=n_groups,
            OUT_BLOCK=out.numel() if order is not None else 0,
            row_out=row_out,
            num_warps=min(16, max(4, max(block, out.numel()) // 512)),  # out: the row, or more in read order
            launch_pdl=use_pdl,
        )

    def launch_dequantize(weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> None:
        rows = weight.shape[0]
        if rows == 0:
            return
        weight = _aligned(weight)
        name = gguf_type(type_id).name
        sub, unit = _TILES[name]
        per_program = 256 // sub  # sub-blocks: 256 values of each of _DEQUANT_BLOCK_N rows
        n_sub = cols // sub
        grid = (-(-rows // _DEQUANT_BLOCK_N), -(-n_sub // per_program))
        source.dequantize_kernel[grid](
            weight,
            out,
            rows,
            weight.stride(0),
            out.stride(0),
            *_CODEBOOK_WORDS.get(name, (0, 0, 0, 0)),
            KIND=type_id,
            L=sub,
            V=unit,
            S=per_program,
            N_SUB=n_sub,
            BLOCK_N=_DEQUANT_BLOCK_N,
            num_warps=4,
            # Without contraction a * b - c stays two roundings, as in the torch reference.
            enable_fp_fusion=False,
        )

    def launch_experts(
        x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor
    ) -> None:
        launch_blocks(x, _aligned(weight), type_id, cols, out, None, 0.0, False, False, False, False, ids)

    def launch_experts_one_row(
        x_read: torch.Tensor,
        ids: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        cols: int,
        out: torch.Tensor,
        config: tuple[int, int, int],
    ) -> None:
        block_n, groups, warps = config
        rows = weight.shape[1]
        experts_source.experts_kernel[(-(-rows // block_n), ids.shape[0])](
            x_read,
            ids,
            _aligned(weight),
            out,
            rows,
            weight.stride(1),
            weight.stride(0),
            x_read.stride(0) if x_read.shape[0] > 1 else 0,
            out.stride(0),
            KIND=type_id,
            G=groups,
            N_GROUPS=cols // 64,
            BLOCK_N=block_n,
            ASM=x_read.is_cuda,  # PTX where it compiles for a GPU; Triton's interpreter runs CPU tensors
            num_warps=warps,
        )

    return _Kernels(
        on_its_device(launch_gemv),
        on_its_device(launch_dequantize),
        on_its_device(launch_input),
        on_its_device(launch_experts),
        on_its_device(launch_experts_one_row),
    )
