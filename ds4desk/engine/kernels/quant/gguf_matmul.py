"""Matmuls on GGUF-packed weights: y = x @ dequantize(weight)ᵀ without a float copy of the weight.

`weight` is a uint8 tensor [rows, row_bytes] holding the GGUF blocks of a [rows, cols] matrix as the
file stores them (blocks run along a row, so any subset of rows is itself a valid packed tensor).
Each device picks its own kernel, and every kernel is held to the reference: `gguf.dequantize`
followed by a float32 matmul, to accumulation-order error.

- CUDA: Triton kernels (gguf_triton.py) that dequantize inside the tile: a GEMV for a few rows of
  x (decode), and for longer x the weight dequantized into a scratch of x's dtype and one cuBLAS mm.
- CPU: the C kernels (gguf_cpu.py) where they were built and cover the type; elsewhere the weight is
  dequantized slice by slice, never whole, so memory stays near the packed size.
"""

from __future__ import annotations

import torch

from ds4desk.engine.kernels.quant import gguf, gguf_cpu, gguf_triton

# Rows dequantized at a time by the fallback: bounds its float32 scratch (rows x cols x 4 bytes).
_FALLBACK_ROWS = 2048


def gguf_matmul(
    x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, cols] (float32, bfloat16 or float16) times the packed [rows, cols] weight transposed:
    [T, rows] in x's dtype, written into `out` when given."""
    rows = weight.shape[0]
    if out is None:
        out = torch.empty((x.shape[0], rows), device=x.device, dtype=x.dtype)
    if x.is_cuda and gguf_triton.covers(type_id, x.dtype):
        return gguf_triton.matmul(x, weight, type_id, cols, out)
    if x.is_cpu and gguf_cpu.covers(type_id, x.dtype):
        return gguf_cpu.matmul(x, weight, type_id, cols, out)
    return reference_matmul(x, weight, type_id, cols, out)


def reference_matmul(
    x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor
) -> torch.Tensor:
    """The exact definition, slice by slice of rows: dequantize to float32, matmul in float32."""
    rows = weight.shape[0]
    x32 = x.float()
    for start in range(0, rows, _FALLBACK_ROWS):
        stop = min(rows, start + _FALLBACK_ROWS)
        w = gguf.dequantize(weight[start:stop], type_id, (stop - start, cols))
        out[:, start:stop].copy_(x32 @ w.t())
    return out


def dequantize_rows(weight: torch.Tensor, ids: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """The float32 rows `ids` of a packed [rows, cols] weight: an embedding lookup on packed rows."""
    picked = weight.index_select(0, ids.reshape(-1))
    return gguf.dequantize(picked, type_id, (picked.shape[0], cols)).view(*ids.shape, cols)
