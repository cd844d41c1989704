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
gguf_matmul never sends here). `reference_*` are the same math in torch, for the tests. This module
holds the kernels' switch and the calls that check their arguments; gguf_tiles.py the settings they
run with, gguf_launch.py the launchers, gguf_experts.py the stacked experts' GEMV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4desk.engine.formats import GGUF_TYPES, Q8_0_ROWS, gguf_packed_bytes, gguf_type
from ds4desk.engine.kernels.launch import Switch, Where
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.kernels.quant.common import nvidia_cuda
from ds4desk.engine.kernels.quant.gguf_launch import kernels
from ds4desk.engine.kernels.quant.gguf_tiles import (
    DTYPES,
    GEMV_MAX_ROWS,
    INPUT_NORM,
    ONE_ROW_GROUPS,
    READ_ORDER_TYPES,
    TILES,
    one_row_fits,
    one_row_plan,
)

# Default: the kernels for CUDA tensors on NVIDIA GPUs with Triton. Forced on: whatever the device
# (TRITON_INTERPRET=1 runs them on CPU tensors: the tests); off: gguf_matmul's reference path.
SWITCH = Switch("quant.gguf_triton", "the GGUF block-type GEMV and dequantize kernels", nvidia_cuda)
# Elements of one dequantized slice of the weight (64 MB in bf16): bounds the prefill scratch.
SCRATCH_ELEMENTS = 1 << 25


def enabled(where: Where) -> bool:
    """Whether the GGUF kernels run for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where) and kernels() is not None


def covers(type_id: int, dtype: torch.dtype) -> bool:
    """Whether `matmul` runs this type for CUDA activations of `dtype`."""
    try:
        name = gguf_type(type_id).name
    except ValueError:
        return False
    return name in TILES and dtype in DTYPES and enabled(torch.device("cuda"))


def one_row(x: torch.Tensor, type_id: int) -> bool:
    """Whether the fused one-row forms (`gemv_add_`, `norm_gemv`) run for x [1, K]."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and x.dtype in DTYPES
        and gguf_type(type_id).name in TILES
        and enabled(x)
    )


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
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in DTYPES or norm.shape != (x.shape[1],):
        raise ValueError(f"normed_row takes one float row and its norm weight, got {list(x.shape)}")
    run = kernels()
    assert run is not None
    out = torch.empty_like(x)
    run.prepare(x.contiguous(), norm, eps, x.shape[1], out, INPUT_NORM)
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
    run = kernels()
    assert run is not None
    row = torch.empty_like(x)
    name = gguf_type(type_id).name
    prepared = torch.empty(one_row_plan(name, weight.shape[0], cols)[2], device=x.device)
    order = (type_id, groups, cols // ONE_ROW_GROUPS[name])
    run.prepare(x.contiguous(), norm, eps, cols, prepared, INPUT_NORM, order, row)
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
    return one_row_plan(name, weight.shape[0], cols)[0][1]


def prepared_input(weight: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """A buffer for the input of the one-row GEMV of this weight (a type in READ_ORDER_TYPES) as a
    kernel before it writes it (norm_gemv_silu, the fused decode attention), for `gemv_prepared`:
    float32 in the GEMV's read order. Zeros: the entries past the row's groups are never written and
    must read as 0. Allocate it once, outside a captured graph."""
    name = gguf_type(type_id).name
    if name not in READ_ORDER_TYPES:
        raise ValueError(f"{name}'s one-row GEMV reads its input as it is")
    size = one_row_plan(name, weight.shape[0], cols)[2]
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
    run = kernels()
    assert run is not None
    # `out` stands in for the input row: with `prepared` given, the launcher reads only its shape.
    run.gemv(out, weight, type_id, cols, out, None, 0.0, False, False, residual, prepared)
    return out


def stacked_rows_gemv(x: torch.Tensor, weight: torch.Tensor, cols: int, out: torch.Tensor) -> torch.Tensor:
    """out [G, R] = x [G, cols] times the G matrices stacked in weight [G R, ...] (Q8_0_ROWS), each
    row of x by its own matrix, in one launch of the rows GEMV (DeepSeek-V4's grouped output
    projection at one token)."""
    _check_weight(weight, Q8_0_ROWS.type_id, cols)
    matrices = x.shape[0]
    if x.dim() != 2 or x.shape[1] != cols or x.stride(1) != 1 or x.dtype not in DTYPES:
        raise ValueError(f"x must be float [G, {cols}] with rows contiguous, got {list(x.shape)}")
    rows = weight.shape[0] // matrices
    if weight.shape[0] % matrices or out.shape != (matrices, rows) or out.stride(1) != 1:
        raise ValueError(f"out must be [{matrices}, {rows}] with rows contiguous, got {list(out.shape)}")
    run = kernels()
    assert run is not None
    run.stacked_rows(x, weight, cols, out)
    return out


def dequantize_into(weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """out [rows, cols] (float32, bfloat16 or float16) = dequantize(weight), rounded once to out's
    dtype: equal to gguf.dequantize(...).to(out.dtype)."""
    _check_weight(weight, type_id, cols)
    if out.shape != (weight.shape[0], cols) or out.stride(1) != 1 or out.dtype not in DTYPES:
        raise ValueError(f"dequantize_into: out must be [{weight.shape[0]}, {cols}] with rows contiguous")
    run = kernels()
    assert run is not None
    run.dequantize(weight, type_id, cols, out)
    return out


def _check_weight(weight: torch.Tensor, type_id: int, cols: int) -> None:
    kind = gguf_type(type_id)
    if kind.name not in TILES:
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
    if x.dim() != 2 or x.shape[1] != x_cols or x.dtype not in DTYPES:
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
    run = kernels()
    assert run is not None
    run.gemv(x, weight, type_id, cols, out, norm, eps, silu, with_norm, residual, None, pair)
    return out
