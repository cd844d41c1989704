"""Triton source of the experts GEMV for the 2- and 3-bit K-quants (Q2_K, Q3_K: the routed experts of
a DeepSeek-V4 GGUF mix), out[slot] = x_slot @ dequantize(W[ids[slot]])ᵀ; gguf_experts.experts_gemv
launches it. The general kernel (gguf_blocks_triton.gemv_kernel) decodes a tile [rows, sub-blocks,
units, bytes] and issues about 15 instructions a weight value; this one follows the one-row GEMV of
gguf_gemv1_triton: tiles [G groups, BLOCK_N rows], a thread holds one group of every row of its
program, walks the group's code units in an unrolled loop and reads each unit's inputs once for all
its rows.

A group is 64 values of one half (128 values) of a 256-value super-block: the 16 code bytes
t .. t + 15 (t = 0 or 16) of the half's 32, whose four 2-bit fields k = 0..3 hold values
128 h + 32 k + t + p (p = 0..15), four sub-blocks of 16 (8 h + 2 k + t / 16). Q3_K's third bit of
those values is bit 4 h + k of its high-bit bytes t .. t + 15. A code byte becomes a float by one
PRMT under 2^23's exponent and one subtraction; the scales multiply each sub-block's sum once, and
Q2_K's minimums multiply the sub-block's sum of inputs.

The input is read in the kernel's own order (gguf_experts.read_order): for each unrolled step the G values the
G threads of a tile need lie side by side, where in the row's own order they lie 16-256 values apart
and a warp's load touches up to 32 lines. gguf_experts.experts_input writes that order with one index_select.

experts_swiglu_kernel runs a gate and up pair on one tile (their rows side by side) and writes the
clamped SwiGLU of each row pair, where the down projection's kernel reads it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4desk.engine.kernels.quant.gguf_blocks_triton import Q2_K, Q3_K, cast
from ds4desk.engine.kernels.quant.gguf_gemv1_triton import MAGIC, _bytes, _fp16, _int16_units

GROUP_VALUES = 64  # values a group: a quarter of a super-block


@triton.jit
def _in(xs, step, G: tl.constexpr):
    """float32 [G, 1]: the inputs of read step `step` (xs: the tile's G base pointers)."""
    return tl.load(xs + step * G).to(tl.float32)


@triton.jit
def _dot4(codes, xs, step, G: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr):
    """(Σ (q_b - OFFSET) x_b, Σ x_b) over the four code bytes b of `codes` (int32, each byte a
    code) and the inputs of read steps step .. step + 3."""
    f0, f1, f2, f3 = _bytes(codes, 4, ASM)
    x0, x1 = _in(xs, step, G), _in(xs, step + 1, G)
    x2, x3 = _in(xs, step + 2, G), _in(xs, step + 3, G)
    dot = (f0 - (MAGIC + OFFSET)) * x0 + (f1 - (MAGIC + OFFSET)) * x1
    dot += (f2 - (MAGIC + OFFSET)) * x2 + (f3 - (MAGIC + OFFSET)) * x3
    return dot, (x0 + x1) + (x2 + x3)


@triton.jit
def _dot2(codes, xs, step, G: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr):
    """_dot4 for the two code bytes of an int16 unit (no sum of inputs)."""
    f0, f1, _, _ = _bytes(codes, 2, ASM)
    return (f0 - (MAGIC + OFFSET)) * _in(xs, step, G) + (f1 - (MAGIC + OFFSET)) * _in(xs, step + 1, G)


@triton.jit
def _byte_of(word, b):
    """Byte b (an int32 tensor) of each int32 in word."""
    return (word >> (b * 8)) & 255


@triton.jit
def _rows_dot(
    x,
    row,
    KIND: tl.constexpr,
    G: tl.constexpr,
    N_GROUPS: tl.constexpr,
    WIDTH: tl.constexpr,
    ASM: tl.constexpr,
):
    """float32 [WIDTH]: each row's products with x (in read order), for the row pointers row [1, WIDTH]."""
    total = tl.zeros((G, WIDTH), dtype=tl.float32)
    for g0 in range(0, N_GROUPS, G):
        group = (g0 + tl.arange(0, G))[:, None]
        half = (group % 4) // 2
        t = (group % 2) * 16
        xs = x + g0 * 64 + tl.arange(0, G)[:, None]
        if KIND == Q2_K:  # 84-byte super-blocks: 16 scale bytes | 64 code bytes | d | dmin
            block = row + (group // 4) * 84
            codes = (block + 16 + half * 32 + t).to(tl.pointer_type(tl.int32))
            acc0 = tl.zeros((G, WIDTH), dtype=tl.float32)
            acc1 = tl.zeros((G, WIDTH), dtype=tl.float32)
            acc2 = tl.zeros((G, WIDTH), dtype=tl.float32)
            acc3 = tl.zeros((G, WIDTH), dtype=tl.float32)
            sum0 = tl.zeros((G, 1), dtype=tl.float32)
            sum1 = tl.zeros((G, 1), dtype=tl.float32)
            sum2 = tl.zeros((G, 1), dtype=tl.float32)
            sum3 = tl.zeros((G, 1), dtype=tl.float32)
            for u in tl.static_range(4):
                v = tl.load(codes + u)
                dot, s = _dot4(v & 0x03030303, xs, 16 * u, G, 0, ASM)
                acc0 += dot
                sum0 += s
                dot, s = _dot4((v >> 2) & 0x03030303, xs, 16 * u + 4, G, 0, ASM)
                acc1 += dot
                sum1 += s
                dot, s = _dot4((v >> 4) & 0x03030303, xs, 16 * u + 8, G, 0, ASM)
                acc2 += dot
                sum2 += s
                dot, s = _dot4((v >> 6) & 0x03030303, xs, 16 * u + 12, G, 0, ASM)
                acc3 += dot
                sum3 += s
            # Sub-block 8 h + 2 k + t / 16's scale byte (low nibble scale, high nibble minimum).
            scales = (block + half * 8).to(tl.pointer_type(tl.int32))
            first, second = tl.load(scales), tl.load(scales + 1)
            b = t // 16
            c0, c1 = _byte_of(first, b), _byte_of(first, b + 2)
            c2, c3 = _byte_of(second, b), _byte_of(second, b + 2)
            head = tl.load((block + 80).to(tl.pointer_type(tl.int32)))
            d, dmin = _fp16(head), _fp16(head >> 16)
            scaled = (c0 & 15).to(tl.float32) * acc0 + (c1 & 15).to(tl.float32) * acc1
            scaled += (c2 & 15).to(tl.float32) * acc2 + (c3 & 15).to(tl.float32) * acc3
            mins = (c0 >> 4).to(tl.float32) * sum0 + (c1 >> 4).to(tl.float32) * sum1
            mins += (c2 >> 4).to(tl.float32) * sum2 + (c3 >> 4).to(tl.float32) * sum3
            total += d * scaled - dmin * mins
        else:  # Q3_K, 110-byte super-blocks: 32 high-bit bytes | 64 code bytes | 12 scale bytes | d
            tl.static_assert(KIND == Q3_K)
            block = row + (group // 4) * 110
            codes = block + 32 + half * 32 + t
            highs = block + t
            shift = half * 4  # the high bit of field k is bit 4 h + k
            acc0 = tl.zeros((G, WIDTH), dtype=tl.float32)
            acc1 = tl.zeros((G, WIDTH), dtype=tl.float32)
            acc2 = tl.zeros((G, WIDTH), dtype=tl.float32)
            acc3 = tl.zeros((G, WIDTH), dtype=tl.float32)
            for u in tl.static_range(8):  # int16 units: the blocks put the codes at even addresses
                low = _int16_units(codes + 2 * u)
                high = _int16_units(highs + 2 * u) >> shift
                step = 16 * (u // 2) + 2 * (u % 2)
                acc0 += _dot2((low & 0x0303) | ((high & 0x0101) << 2), xs, step, G, 4, ASM)
                acc1 += _dot2(((low >> 2) & 0x0303) | ((high & 0x0202) << 1), xs, step + 4, G, 4, ASM)
                acc2 += _dot2(((low >> 4) & 0x0303) | (high & 0x0404), xs, step + 8, G, 4, ASM)
                acc3 += _dot2(((low >> 6) & 0x0303) | ((high & 0x0808) >> 1), xs, step + 12, G, 4, ASM)
            # Sub-block i = 8 h + 2 k + t / 16: low nibble h of byte 2 k + t / 16 of the first 8 scale
            # bytes, top pair (2 h + k // 2) of byte 2 (k % 2) + t / 16 of the last 4; less 32.
            b = t // 16
            tops0 = _int16_units(block + 104)
            tops1 = _int16_units(block + 106)
            s0 = (_byte_of(_int16_units(block + 96), b) >> shift) & 15
            s1 = (_byte_of(_int16_units(block + 98), b) >> shift) & 15
            s2 = (_byte_of(_int16_units(block + 100), b) >> shift) & 15
            s3 = (_byte_of(_int16_units(block + 102), b) >> shift) & 15
            s0 |= ((_byte_of(tops0, b) >> (half * 4)) & 3) << 4
            s1 |= ((_byte_of(tops1, b) >> (half * 4)) & 3) << 4
            s2 |= ((_byte_of(tops0, b) >> (half * 4 + 2)) & 3) << 4
            s3 |= ((_byte_of(tops1, b) >> (half * 4 + 2)) & 3) << 4
            d = _fp16(_int16_units(block + 108))
            scaled = (s0 - 32).to(tl.float32) * acc0 + (s1 - 32).to(tl.float32) * acc1
            scaled += (s2 - 32).to(tl.float32) * acc2 + (s3 - 32).to(tl.float32) * acc3
            total += d * scaled
    return tl.sum(total, axis=0)


@triton.jit
def experts_kernel(
    x,
    ids,
    w,
    out,
    rows,
    row_bytes,
    expert_bytes,
    x_step,
    out_step,
    KIND: tl.constexpr,
    G: tl.constexpr,
    N_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):
    """out[slot, n] = Σ_c x[slot, c] · W_e[n, c] for the BLOCK_N rows n of program_id(0), expert
    e = ids[slot] (slot = program_id(1), read on the device). W holds stacked matrices of
    expert_bytes each; x is the input in read order (x_step apart a slot, 0: one row for all), a
    whole number of tiles; out's rows are out_step apart. Rows past the end read the last row again
    (the stores are masked), so the weight loads need no mask."""
    slot = tl.program_id(1)
    w += tl.load(ids + slot).to(tl.int64) * expert_bytes
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w + tl.minimum(n, rows - 1).to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N]
    ys = _rows_dot(x + slot * x_step, row, KIND, G, N_GROUPS, BLOCK_N, ASM)
    tl.store(out + slot * out_step + n, cast(ys, out.dtype.element_ty), mask=n < rows)


@triton.jit
def experts_swiglu_kernel(
    x,
    ids,
    gate_w,
    up_w,
    out,
    positions,
    rows,
    row_bytes,
    expert_bytes,
    x_step,
    out_step,
    limit,
    KIND: tl.constexpr,
    G: tl.constexpr,
    N_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):
    """The clamped SwiGLU of experts_kernel's gate and up rows, out[slot, positions[n]] =
    silu(min(g, limit)) · clamp(u, ±limit) for g, u = rows n of x_slot @ Gateᵀ, x_slot @ Upᵀ of
    expert ids[slot], each rounded to out's dtype first and SiLU's result too (as the unfused gate,
    up and swiglu kernels round). One tile holds a program's gate and up rows side by side (column 2 i
    + 0 / 1: row i of gate / up), so each input value read serves both; `positions` puts the result
    where the down projection's kernel reads it (its read order), or in order."""
    slot = tl.program_id(1)
    expert = tl.load(ids + slot).to(tl.int64) * expert_bytes
    j = tl.arange(0, 2 * BLOCK_N)
    n = tl.program_id(0) * BLOCK_N + j // 2
    base = tl.where(j % 2 == 0, gate_w + expert, up_w + expert)
    row = (base + tl.minimum(n, rows - 1).to(tl.int64) * row_bytes)[None, :]  # [1, 2 BLOCK_N]
    ys = _rows_dot(x + slot * x_step, row, KIND, G, N_GROUPS, 2 * BLOCK_N, ASM)
    gate, up = tl.split(tl.reshape(ys, (BLOCK_N, 2)))
    dtype = out.dtype.element_ty
    g = tl.minimum(cast(gate, dtype).to(tl.float32), limit)
    u = cast(up, dtype).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = cast(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
    m = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = m < rows
    at = tl.load(positions + m, mask=live, other=0)
    tl.store(out + slot * out_step + at, cast(act * u, dtype), mask=live)
