"""Triton source of the one-row GEMV on Q8_0_ROWS, y = x @ dequantize(W)ᵀ for x [1, K]: Q8_0 as a GPU
holds it (formats.Q8_0_ROWS: each row's int8 codes, then its fp16 scales). gguf_launch.py launches it.

GGUF's 34-byte Q8_0 blocks align their codes to 2 bytes only, so a GEMV on them reads 2-byte units,
one load per two values, and needs many registers to keep enough of them in flight (the one-row
kernel of gguf_gemv1_triton.py, 246 registers a thread). With the codes of a row contiguous, this
kernel is dense/gemv.py's bf16 GEMV at half the bytes: tiles [BLOCK_N rows, BLOCK_K values] that
Triton reads in 16-byte loads, the next tile loaded while this one is summed, the first one before
the kernel waits on the one before it (programmatic dependent launch: the weights never change).

A code byte becomes a float by the exponent trick (2^23's bits | (code ^ 128), less 2^23 + 128:
exact, two full-rate instructions where an int8-to-float conversion runs at a quarter of the rate),
times its block's scale (exact: 8 by 11 significant bits), times the input: the values are
gguf.dequantize's, summed in another order (accumulation-order error, as the other GEMVs).

The input row is read as the layer hands it: plain (x), RMSNorm(x) · norm (NORM), or SiLU(gate) · up
from x = gate | up (SILU), each rounded to x's dtype as torch's normed or activated row would be;
every program computes it from the row (a few KB, hot in L2), so no input kernel runs before it (on
matrices of more rows than gguf_tiles.ROWS_OWN_INPUT_MAX_ROWS the launcher runs one instead: there
the programs' repeated reads cost more than the kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4desk.engine.kernels.quant.gguf_blocks_triton import cast, rounded


@triton.jit
def _input(x, norm, col, rstd, K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr):
    """float32 input values at columns `col`: x, RMSNorm(x) · norm or SiLU(gate) · up, rounded to x's
    dtype."""
    if SILU:
        g = tl.load(x + col).to(tl.float32)
        u = tl.load(x + K + col).to(tl.float32)
        v = rounded(g * tl.sigmoid(g) * u, x.dtype.element_ty)
    elif NORM:
        v = tl.load(x + col).to(tl.float32) * rstd
        v = rounded(v * tl.load(norm + col).to(tl.float32), x.dtype.element_ty)
    else:
        v = tl.load(x + col).to(tl.float32)
    return v


@triton.jit
def rows_gemv_kernel(
    x,
    w,
    out,
    norm,
    eps,
    rows,
    row_bytes,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    x_step=0,
    w_step=0,
    out_step=0,
):
    """out[0, n] (+)= Σ_k input_k · W[n, k] for the BLOCK_N rows n of this program (BLOCK_K divides
    K). Rows past the end read the last row again and are not stored, so no weight load is masked
    but the tile after the last. A second program axis takes stacked matrices, each times its own
    input row (DeepSeek-V4's grouped output projection): matrix g is w + g · w_step, its input
    x + g · x_step, its output out + g · out_step."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    matrix = tl.program_id(1)
    x += matrix * x_step
    w += matrix.to(tl.int64) * w_step
    out += matrix * out_step
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w + tl.minimum(n, rows - 1).to(tl.int64)[:, None, None] * row_bytes
    block = tl.arange(0, BLOCKS)[None, :, None]
    value = tl.arange(0, 32)[None, None, :]
    codes = row + block * 32 + value  # [BLOCK_N, BLOCKS, 32] bytes
    scales = (row + K + 2 * block).to(tl.pointer_type(tl.int16))  # [BLOCK_N, BLOCKS, 1]
    tile = tl.load(codes)
    scale = tl.load(scales)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    live = n < rows
    if RESIDUAL:  # read now: loaded after the sums, its latency was the program's last step
        prior = tl.load(out + n, mask=live, other=0.0).to(tl.float32)
    rstd = 1.0
    if NORM:
        kk = tl.arange(0, BLOCK_K)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x + k0 + kk).to(tl.float32)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCKS, 32), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        inputs = _input(x, norm, k0 + block * 32 + value, rstd, K, NORM, SILU)
        q = (tile.to(tl.int32) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        d = scale.to(tl.float16, bitcast=True).to(tl.float32)
        acc += (q * d) * inputs
        more = k0 + BLOCK_K < K
        tile = tl.load(codes + k0 + BLOCK_K, mask=more, other=0)
        scale = tl.load(scales + (k0 + BLOCK_K) // 32, mask=more, other=0)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if RESIDUAL:
        y += prior
    tl.store(out + n, cast(y, out.dtype.element_ty), mask=live)
