"""CPU matmuls on GGUF-packed weights: y = x @ dequantize(W)ᵀ for float32 x, read from the blocks.

The kernels are C (gguf_cpu.c, built by setup.py into `_gguf_cpu`), called with raw data pointers
after this module has checked every dtype, shape and stride, and with the GIL released:

- a few rows of x (decode: T <= GEMV_MAX_T): one pass over the packed rows that decodes each block
  in registers and multiplies it into up to four rows of x at a time, split over torch's threads.
  It reads the packed bytes once per token and never makes a float copy of the weight.
- longer x (prefill): a tile of rows dequantized into a bounded float32 scratch, then torch.mm
  (oneDNN / MKL) on it, tile by tile, so a prompt goes as fast as it would on float weights.

Both dequantize with the same float32 operations as the reference (quant/gguf.py), so they differ
from `gguf_matmul.reference_matmul` only in the order of the sums.

Where the extension was not built (no C compiler at install time), `covers` is False for every type
and gguf_matmul falls back to the reference; a log line at import says so.
"""

from __future__ import annotations

import logging
import threading

import torch

from ds4desk.engine.formats import GGUF_TYPES

log = logging.getLogger(__name__)

try:  # torch is imported first on purpose: the extension then shares its OpenMP runtime (see the C file)
    from ds4desk.engine.kernels.quant import _gguf_cpu as _ext
except ImportError as error:  # an install without a C compiler
    _ext = None
    log.info("GGUF CPU kernels are not built (%s): packed CPU matmuls use the torch reference", error)

# Up to this many rows of x, the fused GEMV kernel; beyond, dequantized tiles and torch.mm.
GEMV_MAX_T = 8
# Floats in one prefill tile of dequantized rows (8 MiB), which bounds the scratch.
TILE_VALUES = 1 << 21

# Every GGUF type but F32 (whose bytes already are the float32 weight the reference multiplies).
_ROW_BYTES: dict[int, tuple[int, int]] = {
    t.type_id: (t.block_values, t.block_bytes) for t in GGUF_TYPES.values() if t.name != "F32"
}
_scratch = threading.local()
_F32, _U8 = torch.float32, torch.uint8


def available() -> bool:
    """Whether the C extension was built and imported."""
    return _ext is not None


def kernel_isa() -> str:
    """The instruction set the kernels run with: "avx512", "portable", or "missing"."""
    return _ext.kernel_isa() if _ext is not None else "missing"


def covers(type_id: int, dtype: torch.dtype) -> bool:
    """Whether `matmul` runs this type for activations of `dtype`."""
    return _ext is not None and dtype == torch.float32 and type_id in _ROW_BYTES


def matmul(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """x [T, cols] float32 times the packed [rows, cols] weight (uint8 [rows, row_bytes]) transposed,
    written into out [T, rows] float32 and returned. A ValueError for anything that does not fit."""
    # Decode calls this ~200 times a token, so the checks below are the cheap forms of each test
    # (a torch attribute costs ~0.1 us, `x.device.type` ~0.5 us); they guard the raw pointers.
    assert _ext is not None, "gguf_cpu.matmul called without the extension: check covers() first"
    block_values, block_bytes = _ROW_BYTES[type_id]
    x_shape, w_shape = x.shape, weight.shape
    if (
        len(x_shape) != 2
        or len(w_shape) != 2
        or x_shape[1] != cols
        or x.dtype is not _F32
        or out.dtype is not _F32
        or weight.dtype is not _U8
        or cols % block_values
        or w_shape[1] != cols // block_values * block_bytes
        or out.shape != (x_shape[0], w_shape[0])
        or not (x.is_cpu and weight.is_cpu and out.is_cpu)
    ):
        raise ValueError(
            f"gguf_cpu.matmul: x {tuple(x_shape)} {x.dtype}, weight {tuple(w_shape)} {weight.dtype}, "
            f"out {tuple(out.shape)} {out.dtype} do not fit a type {type_id} weight of {cols} columns"
        )
    tokens, rows = x_shape[0], w_shape[0]
    if tokens == 0 or rows == 0:
        return out
    x_strides = x.stride()
    if x_strides[1] != 1:
        x, x_strides = x.contiguous(), (cols, 1)
    w_strides = weight.stride()
    if w_strides[1] != 1:
        weight, w_strides = weight.contiguous(), (w_shape[1], 1)
    # The kernels write rows of y with a row stride: anything else gets a contiguous stand-in.
    out_strides = out.stride()
    target = out
    if out_strides[1] != 1 or (out_strides[0] < rows and tokens > 1):
        target, out_strides = torch.empty((tokens, rows), dtype=_F32), (rows, 1)
    threads = torch.get_num_threads()
    if tokens <= GEMV_MAX_T:
        _ext.gemv(
            type_id,
            weight.data_ptr(),
            w_strides[0],
            rows,
            cols,
            x.data_ptr(),
            tokens,
            x_strides[0],
            target.data_ptr(),
            out_strides[0],
            threads,
        )
    else:
        _tiled_matmul(x, weight, type_id, cols, target, threads)
    if target is not out:
        out.copy_(target)
    return out


def dequantize(weight: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """The float32 [rows, cols] weight, decoded by the C kernels (the prefill path's tile decoder)."""
    assert _ext is not None
    block_values, block_bytes = _ROW_BYTES[type_id]
    rows, row_bytes = weight.shape
    if weight.dtype != torch.uint8 or cols % block_values or row_bytes != cols // block_values * block_bytes:
        raise ValueError(f"gguf_cpu.dequantize: weight {tuple(weight.shape)} is not type {type_id} x {cols}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    dst = torch.empty((rows, cols), dtype=torch.float32)
    _ext.dequantize(
        type_id, weight.data_ptr(), weight.stride(0), rows, cols, dst.data_ptr(), torch.get_num_threads()
    )
    return dst


def _tiled_matmul(
    x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor, threads: int
) -> None:
    """out = x @ Wᵀ as tiles of rows: each dequantized into the scratch, then one torch.mm."""
    rows = weight.shape[0]
    tile = max(1, min(rows, TILE_VALUES // cols))
    scratch = _scratch_floats(tile * cols)
    x = x.contiguous()
    for start in range(0, rows, tile):
        stop = min(rows, start + tile)
        w = scratch[: (stop - start) * cols].view(stop - start, cols)
        _ext.dequantize(
            type_id,
            weight.data_ptr() + start * weight.stride(0),
            weight.stride(0),
            stop - start,
            cols,
            w.data_ptr(),
            threads,
        )
        if start == 0 and stop == rows and out.is_contiguous():
            torch.mm(x, w.t(), out=out)
        else:
            out[:, start:stop] = torch.mm(x, w.t())


def _scratch_floats(count: int) -> torch.Tensor:
    """This thread's float32 scratch of at least `count` values (kept between calls: prefill calls
    this for every layer, and a fresh multi-MiB buffer would be page-faulted in every time)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < count:
        buffer = torch.empty(count, dtype=torch.float32)
        _scratch.buffer = buffer
    return buffer
