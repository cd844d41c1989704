"""Triton source of the GGUF kernels (gguf_launch.py launches them): the block decoders, the GEMV
and the dequantize-to-scratch kernel. Imported only where Triton is.

A tile is [BLOCK_N rows, S sub-blocks, W, V]: sub-block s of a row holds its values s*L .. s*L + L - 1
(L = 32 for the types whose scales go by 32 values, 16 for Q2_K, Q3_K and Q6_K), value j = V * w + b
of a sub-block at [.., w, b]. V is the unit the code bytes are read by: an int32 (V = 4) or int16
(V = 2) load where the type's blocks align its codes so, bytes for MXFP4. A decoder loads each
scale once per sub-block ([BLOCK_N, S, 1, 1]) and each unit of codes once, takes the codes out of a
unit by shifts and masks on the whole unit and then one constant shift a byte, and turns them into
floats by the exponent trick (_exact_float). It keeps gguf.py's order of float32 operations, so the
dequantize kernel (launched without FMA contraction) gives the reference's values bit for bit.

Everything is integer arithmetic on int32 (the same on a GPU and in the interpreter); fp16 scales
are put together from their two bytes, and bfloat16 results are rounded on their bits (`rounded`),
where the interpreter would truncate. The decoders' loads are not masked: callers pass real rows
and sub-blocks only (clamped), and mask the inputs and the stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

# GGML type ids (formats.GGUF_TYPES): the decoder is picked by the type id itself, a constexpr.
Q4_0: tl.constexpr = tl.constexpr(2)
Q4_1: tl.constexpr = tl.constexpr(3)
Q5_0: tl.constexpr = tl.constexpr(6)
Q5_1: tl.constexpr = tl.constexpr(7)
Q8_0: tl.constexpr = tl.constexpr(8)
Q2_K: tl.constexpr = tl.constexpr(10)
Q3_K: tl.constexpr = tl.constexpr(11)
Q4_K: tl.constexpr = tl.constexpr(12)
Q5_K: tl.constexpr = tl.constexpr(13)
Q6_K: tl.constexpr = tl.constexpr(14)
IQ4_NL: tl.constexpr = tl.constexpr(20)
IQ4_XS: tl.constexpr = tl.constexpr(23)
MXFP4: tl.constexpr = tl.constexpr(39)
Q8_0_ROWS: tl.constexpr = tl.constexpr(-8)  # formats.Q8_0_ROWS: a GPU's Q8_0, codes and scales apart


@triton.jit
def _byte(ptr):
    """The uint8 at ptr as int32. Unmasked: callers clamp rows and sub-blocks to real ones."""
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _half(ptr):
    """The little-endian fp16 at ptr, as float32."""
    bits = _byte(ptr) | (_byte(ptr + 1) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _exact_float(q, offset: tl.constexpr):
    """float32(q - offset), exactly, for int32 0 <= q < 2^22 and a constant 0 <= offset < 2^22: the
    float with bits 2^23's | q is 2^23 + q, less 2^23 + offset. Two full-rate instructions where an
    int-to-float conversion runs at a quarter of the rate on the GPU, once per weight value."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _signed_float(b):
    """A byte (int32 0..255) read as int8, as float32."""
    return _exact_float(b ^ 128, 128)


@triton.jit
def rounded(v, DTYPE: tl.constexpr):
    """float32 v rounded to DTYPE (to nearest, ties to even), still float32. bfloat16 is rounded on
    the bits, because Triton's interpreter truncates a float32 to bfloat16 where a GPU rounds: this
    way both give the same values (finite inputs; a value past bfloat16's largest becomes inf)."""
    if tl.bfloat16 == DTYPE:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        r = bits.to(tl.float32, bitcast=True)
    else:
        r = v.to(DTYPE).to(tl.float32)
    return r


@triton.jit
def cast(v, DTYPE: tl.constexpr):
    """float32 v as a DTYPE tensor, rounded to nearest even: bfloat16 through its bits (see
    `rounded`; the interpreter also flushes bfloat16 subnormals that a GPU keeps)."""
    if tl.bfloat16 == DTYPE:
        bits = rounded(v, DTYPE).to(tl.int32, bitcast=True)
        r = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        r = v.to(DTYPE)
    return r


@triton.jit
def _units(ptr, j, k=None):
    """[BLOCK_N, S, W, 1] int32: the code units of V bytes (j: [1, 1, W, V]; V = 4, 2 or 1) at ptr
    ([BLOCK_N, S, 1, 1] byte pointers aligned to V), little-endian, one load per V codes: unit w of
    the W, or unit k[w] (k: [1, 1, W, 1]) where given."""
    if k is None:
        k = tl.arange(0, j.shape[2])[None, None, :, None]
    if j.shape[3] == 4:
        u = tl.load(ptr.to(tl.pointer_type(tl.int32)) + k)
    elif j.shape[3] == 2:
        u = tl.load(ptr.to(tl.pointer_type(tl.int16)) + k).to(tl.int32) & 0xFFFF
    else:
        u = tl.load(ptr + k).to(tl.int32)
    return u


@triton.jit
def _unit_bytes(u, j):
    """[BLOCK_N, S, W, V]: byte b of each unit in u ([.., W, 1] int32), a constant shift a byte."""
    return (u >> (tl.arange(0, j.shape[3]) * 8)[None, None, None, :]) & 0xFF


@triton.jit
def _nibbles32(codes, j):
    """The 4-bit codes of a 32-value block whose 16 code bytes start at `codes`: value j < 16 is the
    low nibble of byte j, value j >= 16 the high nibble of byte j - 16 (gguf._nibbles32)."""
    per_half: tl.constexpr = 16 // j.shape[3]  # units in 16 bytes
    w = tl.arange(0, j.shape[2])[None, None, :, None]
    u = _units(codes, j, w % per_half)
    return _unit_bytes((u >> ((w // per_half) * 4)) & 0x0F0F0F0F, j)


@triton.jit
def _codebook(code, c0, c1, c2, c3):
    """Entry `code` (int32 0..15) of a 16-entry int8 codebook packed little-endian into four int32
    words (IQ4_NL's values, MXFP4's doubled e2m1): Triton has no gather from registers."""
    word = tl.where(code < 4, c0, tl.where(code < 8, c1, tl.where(code < 12, c2, c3)))
    return _signed_float((word >> ((code % 4) * 8)) & 255)


@triton.jit
def _k_scale_min(w, base, i):
    """Q4_K / Q5_K: the 6-bit scale and minimum of sub-block i (0..7) from the 12 bytes at base + 4
    (gguf._k_scales_mins)."""
    a = _byte(w + base + 4 + i)  # byte i
    b = _byte(w + base + 8 + i)  # byte i + 4
    c = _byte(w + base + 4 + (i % 4))  # byte i - 4 for i >= 4
    scale = tl.where(i < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    minimum = tl.where(i < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def decode(w, row_off, s, j, c0, c1, c2, c3, KIND: tl.constexpr):
    """float32 [BLOCK_N, S, W, V]: the values of sub-blocks s ([1, S, 1, 1] int32, along a row) of
    the rows at byte offsets row_off ([BLOCK_N, 1, 1, 1] int64) of the packed weight w, all of them
    real (the loads are not masked: no zero-fill per load, and whole vectors). Value j = V * w + b of
    a sub-block is at [.., w, b] (j: [1, 1, W, V]); the codes are read V bytes at a time (V: the
    alignment of the type's code bytes, gguf_tiles.TILES). c0..c3: the codebook of IQ4_NL, IQ4_XS
    and MXFP4 (see _codebook); for Q8_0_ROWS, c0 is the byte where the row's scales start."""
    if KIND == Q8_0_ROWS:  # the row's int8 codes | the row's fp16 scales: q * d, as Q8_0
        d = _half(w + row_off + c0 + 2 * s)
        v = _signed_float(_unit_bytes(_units(w + row_off + s * 32, j), j)) * d
    elif KIND == Q8_0:  # d | 32 int8 codes: q * d
        base = row_off + s * 34
        d = _half(w + base)
        v = _signed_float(_unit_bytes(_units(w + base + 2, j), j)) * d
    elif KIND == Q4_0:  # d | 16 code bytes: d * (q - 8)
        base = row_off + s * 18
        d = _half(w + base)
        v = d * _exact_float(_nibbles32(w + base + 2, j), 8)
    elif KIND == Q4_1:  # d | m | 16 code bytes: d * q + m
        base = row_off + s * 20
        d = _half(w + base)
        m = _half(w + base + 2)
        v = d * _exact_float(_nibbles32(w + base + 4, j), 0) + m
    elif KIND == Q5_0:  # d | 4 bytes of fifth bits | 16 code bytes: d * (q - 16)
        base = row_off + s * 22
        d = _half(w + base)
        fifth = (_byte(w + base + 2 + j // 8) >> (j % 8)) & 1
        q = _nibbles32(w + base + 6, j) | (fifth << 4)
        v = d * _exact_float(q, 16)
    elif KIND == Q5_1:  # d | m | 4 bytes of fifth bits | 16 code bytes: d * q + m
        base = row_off + s * 24
        d = _half(w + base)
        m = _half(w + base + 2)
        fifth = (_byte(w + base + 4 + j // 8) >> (j % 8)) & 1
        q = _nibbles32(w + base + 8, j) | (fifth << 4)
        v = d * _exact_float(q, 0) + m
    elif KIND == IQ4_NL:  # d | 16 code bytes: d * IQ4_NL_VALUES[q]
        base = row_off + s * 18
        d = _half(w + base)
        v = d * _codebook(_nibbles32(w + base + 2, j), c0, c1, c2, c3)
    elif KIND == MXFP4:  # e | 16 code bytes: 2^(e - 128) * (2 * e2m1[q]), as gguf._mxfp4
        base = row_off + s * 17
        e = _byte(w + base)
        half_scale = tl.where(e < 2, (e + 1) << 21, (e - 1) << 23).to(tl.float32, bitcast=True)
        v = half_scale * _codebook(_nibbles32(w + base + 1, j), c0, c1, c2, c3)
    elif KIND == Q4_K:  # d | dmin | 12 scale bytes | 128 code bytes; 8 sub-blocks of 32
        i = s % 8
        base = row_off + (s // 8) * 144
        d = _half(w + base)
        dmin = _half(w + base + 2)
        scale, minimum = _k_scale_min(w, base, i)
        # Sub-blocks 2c and 2c + 1 are the low and high nibbles of the same 32 bytes.
        codes = _units(w + base + 16 + (i // 2) * 32, j)
        q = _unit_bytes((codes >> ((i % 2) * 4)) & 0x0F0F0F0F, j)
        v = (d * scale) * _exact_float(q, 0) - dmin * minimum
    elif KIND == Q5_K:  # d | dmin | 12 scale bytes | 32 bytes of fifth bits | 128 code bytes
        i = s % 8
        base = row_off + (s // 8) * 176
        d = _half(w + base)
        dmin = _half(w + base + 2)
        scale, minimum = _k_scale_min(w, base, i)
        low = (_units(w + base + 48 + (i // 2) * 32, j) >> ((i % 2) * 4)) & 0x0F0F0F0F
        fifth = (_units(w + base + 16, j) >> i) & 0x01010101  # bit i of byte j: value 32i + j's
        q = _unit_bytes(low | (fifth << 4), j)
        v = (d * scale) * _exact_float(q, 0) - dmin * minimum
    elif KIND == Q6_K:  # 128 low-nibble bytes | 64 high-pair bytes | 16 int8 scales | d; 16 x 16
        # Value p of a half of 128: low nibble in byte p % 64 (the high nibble from p = 64 on), high
        # pair in byte p % 32, bits 2 * (p // 32): for sub-block i, p = 16 * (i % 8) + j.
        i = s % 16
        base = row_off + (s // 16) * 210
        half = i // 8
        low = _units(w + base + half * 64 + (i % 4) * 16, j) >> (((i % 8) // 4) * 4)
        high = _units(w + base + 128 + half * 32 + (i % 2) * 16, j) >> (((i % 8) // 2) * 2)
        q = _unit_bytes((low & 0x0F0F0F0F) | ((high & 0x03030303) << 4), j)
        scale = _signed_float(_byte(w + base + 192 + i))
        d = _half(w + base + 208)
        v = (d * scale) * _exact_float(q, 32)
    elif KIND == Q2_K:  # 16 scale bytes | 64 code bytes | d | dmin; 16 x 16
        # Code p of a half of 128 (p = 16 * (i % 8) + j): byte p % 32, bits 2 * (p // 32).
        i = s % 16
        base = row_off + (s // 16) * 84
        packed = _byte(w + base + i)
        d = _half(w + base + 80)
        dmin = _half(w + base + 82)
        codes = _units(w + base + 16 + (i // 8) * 32 + (i % 2) * 16, j) >> (((i % 8) // 2) * 2)
        q = _unit_bytes(codes & 0x03030303, j)
        v = (d * (packed & 15).to(tl.float32)) * _exact_float(q, 0) - dmin * (packed >> 4).to(tl.float32)
    elif KIND == Q3_K:  # 32 bytes of high bits | 64 bytes of low pairs | 12 scale bytes | d; 16 x 16
        # Value 16i + j: its high bit is bit (16i + j) // 32 = i // 2 of byte (i % 2) * 16 + j; its
        # low pair as Q2_K's codes.
        i = s % 16
        base = row_off + (s // 16) * 110
        high = (_units(w + base + (i % 2) * 16, j) >> (i // 2)) & 0x01010101
        low = _units(w + base + 32 + (i // 8) * 32 + (i % 2) * 16, j) >> (((i % 8) // 2) * 2)
        q = _unit_bytes((low & 0x03030303) | (high << 2), j)
        scale_low = (_byte(w + base + 96 + (i % 8)) >> ((i // 8) * 4)) & 15
        scale_top = (_byte(w + base + 104 + (i % 4)) >> ((i // 4) * 2)) & 3
        scale = ((scale_low | (scale_top << 4)) - 32).to(tl.float32)
        d = _half(w + base + 108)
        v = (d * scale) * _exact_float(q, 4)  # low - 4 where the high bit is clear
    else:  # IQ4_XS: d | 2 bytes of scale pairs | 4 bytes of scale nibbles | 128 code bytes; 8 x 32
        tl.static_assert(KIND == IQ4_XS)
        i = s % 8
        base = row_off + (s // 8) * 136
        d = _half(w + base)
        top = (_byte(w + base + 2 + i // 4) >> ((i % 4) * 2)) & 3
        low = (_byte(w + base + 4 + i // 2) >> ((i % 2) * 4)) & 15
        scale = ((low | (top << 4)) - 32).to(tl.float32)
        v = (d * scale) * _codebook(_nibbles32(w + base + 8 + i * 16, j), c0, c1, c2, c3)
    return v


@triton.jit
def _values(L: tl.constexpr, V: tl.constexpr):
    """[L / V, V] int32: the values of a sub-block, j = V * unit + byte. Tiles keep the V codes of a
    unit of code bytes (an int32 or int16 load) on their last axis, so a decoder takes them out of
    one register by constant shifts."""
    return tl.arange(0, L // V)[:, None] * V + tl.arange(0, V)[None, :]


@triton.jit
def _input(
    x,
    norm,
    s,
    rstd,
    L: tl.constexpr,
    V: tl.constexpr,
    N_SUB: tl.constexpr,
    COLS: tl.constexpr,
    SILU: tl.constexpr,
    NORM: tl.constexpr,
):
    """float32 [S, L / V, V]: the input row's columns of sub-blocks s ([S] int32), 0 past the row's
    end. SILU: x holds gate | up and the input is SiLU(gate) · up; NORM: x · rstd · norm. Both rounded
    to x's dtype, as torch's activated or normed row would be."""
    col = s[:, None, None] * L + _values(L, V)[None, :, :]
    ok = s[:, None, None] < N_SUB
    if SILU:
        g = tl.load(x + col, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x + COLS + col, mask=ok, other=0.0).to(tl.float32)
        v = rounded(g * tl.sigmoid(g) * u, x.dtype.element_ty)
    elif NORM:
        v = tl.load(x + col, mask=ok, other=0.0).to(tl.float32) * rstd
        v = rounded(v * tl.load(norm + col, mask=ok, other=0.0).to(tl.float32), x.dtype.element_ty)
    else:
        v = tl.load(x + col, mask=ok, other=0.0).to(tl.float32)
    return v


@triton.jit
def gemv_kernel(
    x,
    w,
    out,
    norm,
    rows,
    row_bytes,
    stride_x,
    stride_out,
    eps,
    c0,
    c1,
    c2,
    c3,
    KIND: tl.constexpr,
    L: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    N_SUB: tl.constexpr,
    COLS: tl.constexpr,
    T: tl.constexpr,
    T_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SILU: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    ids=None,
    expert_bytes=0,
    x_step=0,
    out_step=0,
    EXPERTS: tl.constexpr = False,
):
    """out[t, n] (+)= sum over columns of input_t · W[n] for BLOCK_N rows n, every row of x (T of
    them) against one decoded tile, so each weight byte is read once. A program walks its rows' whole
    length (no split of the columns: the result is one sum, rounded once). PDL: launched early
    (programmatic dependent launch, as dense/gemv.py): wait for the kernel before, which writes x
    and the residual, then let the next one launch. EXPERTS: w holds stacked matrices of
    `expert_bytes` each, and program_id(1) is a slot of `ids` (read on the device): the slot's
    matrix, its input row (x_step apart; 0: one row for all) and its output row (out_step apart)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if EXPERTS:
        slot = tl.program_id(1)
        w += tl.load(ids + slot).to(tl.int64) * expert_bytes
        x += slot * x_step
        out += slot * out_step
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the end read the last row again (stores are masked), and sub-blocks past the row's
    # end the last sub-block (their inputs are 0): the weight loads need no mask.
    row_off = tl.minimum(n, rows - 1)[:, None, None, None].to(tl.int64) * row_bytes
    sub = tl.arange(0, S)
    j = _values(L, V)[None, None, :, :]
    rstd = 1.0
    if NORM:  # one input row (T == 1), a few KB and hot in L2: every program computes its norm
        squares = tl.zeros((S, L // V, V), dtype=tl.float32)
        for s0 in range(0, N_SUB, S):
            v = _input(x, x, s0 + sub, 1.0, L, V, N_SUB, COLS, False, False)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(tl.sum(tl.sum(squares, axis=2), axis=1), axis=0) / COLS + eps)
    if T == 1:
        acc = tl.zeros((BLOCK_N, S, L // V, V), dtype=tl.float32)
        for s0 in range(0, N_SUB, S):
            s = s0 + sub
            s4 = tl.minimum(s, N_SUB - 1)[None, :, None, None]
            values = decode(w, row_off, s4, j, c0, c1, c2, c3, KIND)
            acc += values * _input(x, norm, s, rstd, L, V, N_SUB, COLS, SILU, NORM)[None, :, :, :]
        y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
        if RESIDUAL:
            y += tl.load(out + n, mask=n < rows, other=0.0).to(tl.float32)
        tl.store(out + n, cast(y, out.dtype.element_ty), mask=n < rows)
    else:
        t = tl.arange(0, T_PAD)[:, None]
        acc = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
        for s0 in range(0, N_SUB, S):
            s = s0 + sub
            s4 = tl.minimum(s, N_SUB - 1)[None, :, None, None]
            values = decode(w, row_off, s4, j, c0, c1, c2, c3, KIND)
            for row in tl.static_range(T):
                v = _input(x + row * stride_x, norm, s, rstd, L, V, N_SUB, COLS, SILU, NORM)
                part = tl.sum(tl.sum(tl.sum(values * v[None, :, :, :], axis=3), axis=2), axis=1)
                acc += tl.where(t == row, part[None, :], 0.0)
        at = out + t.to(tl.int64) * stride_out + n[None, :]
        ok = (t < T) & (n[None, :] < rows)
        if RESIDUAL:
            acc += tl.load(at, mask=ok, other=0.0).to(tl.float32)
        tl.store(at, cast(acc, out.dtype.element_ty), mask=ok)


@triton.jit
def dequantize_kernel(
    w,
    out,
    rows,
    row_bytes,
    stride_out,
    c0,
    c1,
    c2,
    c3,
    KIND: tl.constexpr,
    L: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    N_SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[n, :] = the values of packed row n, in out's dtype (launched without FMA contraction:
    equal to gguf.dequantize's float32 values, then rounded once)."""
    n4 = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N))[:, None, None, None]
    s4 = (tl.program_id(1) * S + tl.arange(0, S))[None, :, None, None]
    j = _values(L, V)[None, None, :, :]
    ok = (n4 < rows) & (s4 < N_SUB)
    row_off = tl.minimum(n4, rows - 1).to(tl.int64) * row_bytes  # loads of real rows: see gemv_kernel
    values = decode(w, row_off, tl.minimum(s4, N_SUB - 1), j, c0, c1, c2, c3, KIND)
    at = out + n4.to(tl.int64) * stride_out + s4 * L + j
    tl.store(at, cast(values, out.dtype.element_ty), mask=ok)
