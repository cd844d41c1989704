"""DeepSeek-V4's routed experts on GGUF blocks: `experts_gemv` multiplies each picked expert of a
stacked [experts, rows, row_bytes] weight by its input row, reading the picked experts in place by
id on the device (no copy of their blocks, no host read: a decode step captures it in its graph).
Q2_K and Q3_K experts take gguf_experts_triton.py's kernel, whose input is read in its own order
(`experts_input`, `read_order`); the other types the general GEMV's stacked form
(gguf_blocks_triton.py). `experts_swiglu` runs a Q2_K / Q3_K gate and up pair as one kernel with
the clamped SwiGLU folded in, writing its result where the down projection's kernel reads it. The
kernels' switch and reference are gguf_triton.py's."""

from __future__ import annotations

import functools

import torch

from ds4desk.engine.formats import gguf_packed_bytes, gguf_type
from ds4desk.engine.kernels.quant.gguf_launch import kernels
from ds4desk.engine.kernels.quant.gguf_tiles import DTYPES, TILES, experts_one_row_config


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
    if kind.name not in TILES:
        raise ValueError(f"the GGUF kernels do not take {kind.name}")
    k = ids.shape[0]
    _check_stack(weight, ids, type_id, cols)
    _check_rows(x, out, k, cols, weight.shape[1])
    if k:
        run = kernels()
        assert run is not None
        config = experts_one_row_config(kind.name, cols, x.is_cuda)
        if config is None:
            run.experts_gemv(x, ids, weight, type_id, cols, out)
        else:
            x_read = x if ordered else experts_input(x, type_id, cols)
            run.experts_one_row(x_read, ids, weight, type_id, cols, out, config)
    return out


def swiglu_fits(gate_type: int, up_type: int, cols: int, x: torch.Tensor) -> bool:
    """Whether experts_swiglu takes these gate and up projections for inputs like x: one type, which
    gguf_experts_triton's kernel runs on x's device."""
    name = gguf_type(gate_type).name
    return up_type == gate_type and experts_one_row_config(name, cols, x.is_cuda) is not None


def experts_swiglu(
    x_read: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    type_id: int,
    cols: int,
    limit: float,
    out: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """out [k, rows]: silu(min(g, limit)) · clamp(u, ±limit) for slot j's gate and up rows g, u =
    x_j @ dequantize(gate[ids[j]])ᵀ, x_j @ dequantize(up[ids[j]])ᵀ (each rounded to out's dtype, as
    experts_gemv and the swiglu kernel round), one kernel for both projections. x_read is
    experts_input(x, type_id, cols); the value of row n goes to column positions[n] of out (int32
    [rows]: write_order puts it where the down projection's kernel reads it; pass out to
    experts_gemv with ordered=True). Where swiglu_fits."""
    k = ids.shape[0]
    name = gguf_type(type_id).name
    _check_stack(gate, ids, type_id, cols)
    _check_stack(up, ids, type_id, cols)
    if up.shape != gate.shape:
        raise ValueError("experts_swiglu needs gate and up stacks of one shape")
    if positions.shape != (gate.shape[1],) or positions.dtype != torch.int32:
        raise ValueError(f"positions must be int32 [{gate.shape[1]}]")
    _check_rows(x_read, out, k, cols, gate.shape[1])
    config = experts_one_row_config(name, cols, x_read.is_cuda)
    if config is None:
        raise ValueError(f"experts_swiglu does not run {name} on {x_read.device}: see swiglu_fits")
    if k:
        run = kernels()
        assert run is not None
        run.experts_swiglu(x_read, ids, gate, up, type_id, cols, float(limit), out, positions, config)
    return out


def _check_stack(weight: torch.Tensor, ids: torch.Tensor, type_id: int, cols: int) -> None:
    row_bytes = gguf_packed_bytes(type_id, (cols,))
    if weight.dtype != torch.uint8 or weight.dim() != 3 or weight.shape[2] != row_bytes:
        name = gguf_type(type_id).name
        raise ValueError(f"stacked {name} experts of {cols} columns: uint8 [experts, rows, {row_bytes}]")
    if not weight.is_contiguous() or ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError("the experts kernels need contiguous stacked experts and int64 ids [k]")


def _check_rows(x: torch.Tensor, out: torch.Tensor, k: int, cols: int, rows: int) -> None:
    if x.dim() != 2 or x.shape[0] not in (1, k) or x.shape[1] != cols or x.stride(1) != 1:
        raise ValueError(f"x must be [1 or {k}, {cols}] with rows contiguous, got {list(x.shape)}")
    if x.dtype not in DTYPES or out.dtype != x.dtype:
        raise ValueError(f"x and out must be float32, bfloat16 or float16, got {x.dtype} and {out.dtype}")
    if out.shape != (k, rows) or out.stride(1) != 1:
        raise ValueError(f"out must be [{k}, {rows}] with rows contiguous, got {list(out.shape)}")


def write_order(cols: int, type_id: int, device: torch.device) -> torch.Tensor:
    """int32 [cols]: where value c of a row goes in what experts_gemv reads for a `type_id` matrix of
    `cols` columns (experts_input's order, inverted; the identity where its kernel takes the row as it is)."""
    config = experts_one_row_config(gguf_type(type_id).name, cols, device.type == "cuda")
    return _positions(cols, None if config is None else config[1], device)


@functools.cache
def _positions(cols: int, groups: int | None, device: torch.device) -> torch.Tensor:
    positions = torch.arange(cols, device=device, dtype=torch.int32)
    if groups is None:
        return positions
    inverse = torch.empty_like(positions)
    inverse[read_order(cols, groups, device)] = positions
    return inverse


def experts_input(x: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """x [r, cols] as experts_gemv's kernel for this type reads it: in gguf_experts_triton's read
    order (one index_select) where that kernel runs, else x itself. Pass it with ordered=True."""
    order = input_order(type_id, cols, x)
    return x if order is None else x.index_select(1, order)


def input_order(type_id: int, cols: int, x: torch.Tensor) -> torch.Tensor | None:
    """The columns of inputs like x in the order experts_gemv's kernel reads a `type_id` matrix of
    `cols` columns (int64 [cols]; experts_input takes x in it), None where it reads x as it is."""
    config = experts_one_row_config(gguf_type(type_id).name, cols, x.is_cuda)
    return None if config is None else read_order(cols, config[1], x.device)


@functools.cache
def read_order(cols: int, groups: int, device: torch.device) -> torch.Tensor:
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
