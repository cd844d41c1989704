"""Triton source of the one-row GEMV for the GGUF types a decode step spends its time on (Q8_0, Q4_K,
Q6_K: Q8_0 files and the K-quant mixes), y = x @ dequantize(W)ᵀ for x [1, K], and of the kernel that
prepares its input row. gguf_triton.py launches them; the general kernel
(gguf_blocks_triton.gemv_kernel) takes the other types, more rows, and the small matrices.

At batch 1 the general kernel is bound by the instructions it issues per weight value, about 15,
not by the bytes. This one issues about 5:

- Tiles are [G groups, BLOCK_N rows] and a thread holds one group of every row of its program. A
  group is the run of values that share their scales: a Q8_0 block; a Q4_K pair of sub-blocks,
  whose codes are the low and high nibbles of the same 32 bytes; a Q6_K quarter of a super-block
  (16 bytes of low nibbles from each half of `ql` with their 16 bytes of high pairs in `qh`: 64
  values of four sub-blocks). A group's code units (int32 for Q4_K, whose codes are 16-byte
  aligned; int16 for Q8_0 and Q6_K, whose 34- and 210-byte blocks put them at even addresses) are
  walked in an unrolled loop, and each unit's inputs are read once for all the rows.
- A code byte becomes a float by one PRMT (PTX) that moves it under 2^23's exponent, then one
  subtraction and one fma; the scales are factored out of the sums (a group's sums are multiplied
  by its scale once), and Q4_K's minimums multiply the group's sum of inputs.
- The input row is normed or activated once, by `input_kernel`, not by every GEMV program.

The sums run in another order than the reference's (gguf.dequantize, then a float32 matmul):
results agree to accumulation-order error, as the general kernel's do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4desk.engine.kernels.quant.gguf_blocks_triton import Q4_K, Q6_K, Q8_0, _exact_float, cast


@triton.jit
def _fp16(bits):
    """The float16 in the low 16 bits of an int32, as float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int16_units(ptr):
    """int32 tile of the little-endian uint16 units at ptr (a tile of 2-aligned byte pointers)."""
    return tl.load(ptr.to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF


@triton.jit
def _int8(v):
    """The low byte of an int32 read as int8, as float32."""
    return _exact_float((v & 255) ^ 128, 128)


@triton.jit
def _in(x, col, ok):
    """float32 [G, 1] input values at columns `col`, 0 where not ok."""
    return tl.load(x + col, mask=ok, other=0.0).to(tl.float32)


# 2^23 as a float: a byte b placed in the low mantissa bits of 2^23's bit pattern is 2^23 + b.
MAGIC: tl.constexpr = tl.constexpr(8388608.0)


@triton.jit
def _bytes(v, N: tl.constexpr, ASM: tl.constexpr):
    """The N low bytes b of each int32 in v as the floats 2^23 + b (exact; subtract MAGIC). ASM: one
    PRMT a byte (it moves the byte under 2^23's exponent in one instruction, where shifts and masks
    take three); without it (Triton's interpreter), shifts and masks."""
    if ASM:
        if N == 4:
            f0, f1, f2, f3 = tl.inline_asm_elementwise(
                "prmt.b32 $0, $4, $5, 0x7440; prmt.b32 $1, $4, $5, 0x7441; "
                "prmt.b32 $2, $4, $5, 0x7442; prmt.b32 $3, $4, $5, 0x7443;",
                "=r,=r,=r,=r,r,r",
                [v, tl.full(v.shape, 0x4B000000, tl.int32)],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            f0, f1 = tl.inline_asm_elementwise(
                "prmt.b32 $0, $2, $3, 0x7440; prmt.b32 $1, $2, $3, 0x7441;",
                "=r,=r,r,r",
                [v, tl.full(v.shape, 0x4B000000, tl.int32)],
                dtype=(tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
            f2, f3 = f0, f1
    else:
        f0 = (v & 255) | 0x4B000000
        f1 = ((v >> 8) & 255) | 0x4B000000
        f2 = ((v >> 16) & 255) | 0x4B000000
        f3 = ((v >> 24) & 255) | 0x4B000000
    return (
        f0.to(tl.float32, bitcast=True),
        f1.to(tl.float32, bitcast=True),
        f2.to(tl.float32, bitcast=True),
        f3.to(tl.float32, bitcast=True),
    )


@triton.jit
def _k_scales(a, b, c, pair):
    """Q4_K: the 6-bit scales and minimums of sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high),
    from the super-block's scale bytes 0..3 (a), 4..7 (b) and 8..11 (c) (gguf._k_scales_mins): for
    i < 4 bytes i and i + 4; for i >= 4 the nibbles of byte i + 4 with the top bits of bytes i - 4, i."""
    k = (pair % 2) * 16  # bit offset of sub-block 2 pair's byte in its word of four
    early = pair < 2
    a0, a1 = (a >> k) & 255, (a >> (k + 8)) & 255
    b0, b1 = (b >> k) & 255, (b >> (k + 8)) & 255
    c0, c1 = (c >> k) & 255, (c >> (k + 8)) & 255
    s0 = tl.where(early, a0 & 63, (c0 & 15) | ((a0 >> 6) << 4)).to(tl.float32)
    s1 = tl.where(early, a1 & 63, (c1 & 15) | ((a1 >> 6) << 4)).to(tl.float32)
    m0 = tl.where(early, b0 & 63, (c0 >> 4) | ((b0 >> 6) << 4)).to(tl.float32)
    m1 = tl.where(early, b1 & 63, (c1 >> 4) | ((b1 >> 6) << 4)).to(tl.float32)
    return s0, s1, m0, m1


@triton.jit
def gemv1_kernel(
    x,
    w,
    out,
    rows,
    row_bytes,
    KIND: tl.constexpr,
    G: tl.constexpr,
    N_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
):
    """out[0, n] (+)= Σ_k x_k · W[n, k] for the BLOCK_N rows n of this program. Tiles are
    [G, BLOCK_N]: a thread holds one group of every row of the program (neither axis of a tile is
    contiguous in memory, so Triton spreads the first across the threads), walks the group's code
    units one at a time (an unrolled loop), reads each unit's inputs once for all its rows and keeps
    one running sum a row and sub-block; the rows are reduced across threads once, at the end. Rows
    past the end read the last row again (the stores are masked), groups past the row's end the
    last group (their inputs are 0), so the weight loads need no mask."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w + tl.minimum(n, rows - 1).to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N]
    total = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, N_GROUPS, G):
        gi = (g0 + tl.arange(0, G))[:, None]
        ok = gi < N_GROUPS
        gc = tl.minimum(gi, N_GROUPS - 1)
        if KIND == Q8_0:  # 34-byte blocks: d | 32 int8 codes; unit u holds codes 2u and 2u + 1
            block = row + gc * 34
            acc = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            for u in tl.static_range(16):
                q = _int16_units(block + 2 + 2 * u) ^ 0x8080  # int8 codes + 128
                f0, f1, _, _ = _bytes(q, 2, ASM)
                acc += (f0 - (MAGIC + 128)) * _in(x, gi * 32 + 2 * u, ok)
                acc += (f1 - (MAGIC + 128)) * _in(x, gi * 32 + 2 * u + 1, ok)
            total += _fp16(_int16_units(block)) * acc
        elif KIND == Q4_K:  # 144-byte super-blocks: d | dmin | 12 scale bytes | 128 code bytes
            # Group = a pair of sub-blocks: 32 code bytes whose low nibbles are sub-block 2 pair's
            # values and whose high nibbles are sub-block 2 pair + 1's.
            pair = gc % 4
            words = (row + gc // 4 * 144).to(tl.pointer_type(tl.int32))
            head = tl.load(words)
            s0, s1, m0, m1 = _k_scales(tl.load(words + 1), tl.load(words + 2), tl.load(words + 3), pair)
            col = gi // 4 * 256 + gi % 4 * 64
            low = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            high = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            low_inputs = tl.zeros((G, 1), dtype=tl.float32)  # for the minimums
            high_inputs = tl.zeros((G, 1), dtype=tl.float32)
            for u in tl.static_range(8):
                v = tl.load(words + 4 + pair * 8 + u)
                f0, f1, f2, f3 = _bytes(v & 0x0F0F0F0F, 4, ASM)
                x0, x1 = _in(x, col + 4 * u, ok), _in(x, col + 4 * u + 1, ok)
                x2, x3 = _in(x, col + 4 * u + 2, ok), _in(x, col + 4 * u + 3, ok)
                low += (f0 - MAGIC) * x0
                low += (f1 - MAGIC) * x1
                low += (f2 - MAGIC) * x2
                low += (f3 - MAGIC) * x3
                low_inputs += x0 + x1 + x2 + x3
                f0, f1, f2, f3 = _bytes((v >> 4) & 0x0F0F0F0F, 4, ASM)
                x0, x1 = _in(x, col + 4 * u + 32, ok), _in(x, col + 4 * u + 33, ok)
                x2, x3 = _in(x, col + 4 * u + 34, ok), _in(x, col + 4 * u + 35, ok)
                high += (f0 - MAGIC) * x0
                high += (f1 - MAGIC) * x1
                high += (f2 - MAGIC) * x2
                high += (f3 - MAGIC) * x3
                high_inputs += x0 + x1 + x2 + x3
            d = _fp16(head)
            dmin = _fp16(head >> 16)
            total += d * (s0 * low + s1 * high) - dmin * (m0 * low_inputs + m1 * high_inputs)
        else:  # Q6_K, 210-byte super-blocks: 128 bytes ql | 64 bytes qh | 16 int8 scales | d
            tl.static_assert(KIND == Q6_K)
            # Group = (super-block, half, t in {0, 16}): bytes t .. t + 15 of the half's ql (values
            # p = t + j, and from the high nibbles p + 64) and of ql + 32 (p + 32, p + 96), with their
            # top two bits in the half's qh bytes t + j (bits 0-1, 2-3, 4-5, 6-7 for p, p + 32,
            # p + 64, p + 96). Value p's sub-block is 8 half + p // 16: the four runs' scales are
            # bytes 8 half + t / 16 + 2k of the 16, k = 0..3.
            half = (gc % 4) // 2
            t = (gc % 2) * 16
            block = row + gc // 4 * 210
            ql = block + half * 64 + t
            qh = block + 128 + half * 32 + t
            col = gi // 4 * 256 + (gi % 4) // 2 * 128 + (gi % 2) * 16
            acc0 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            acc1 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            acc2 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            for u in tl.static_range(8):
                lo = _int16_units(ql + 2 * u)
                hi = _int16_units(ql + 32 + 2 * u)
                pairs = _int16_units(qh + 2 * u)
                c = col + 2 * u
                f0, f1, _, _ = _bytes((lo & 0x0F0F) | ((pairs & 0x0303) << 4), 2, ASM)
                acc0 += (f0 - (MAGIC + 32)) * _in(x, c, ok)
                acc0 += (f1 - (MAGIC + 32)) * _in(x, c + 1, ok)
                f0, f1, _, _ = _bytes((hi & 0x0F0F) | ((pairs & 0x0C0C) << 2), 2, ASM)
                acc1 += (f0 - (MAGIC + 32)) * _in(x, c + 32, ok)
                acc1 += (f1 - (MAGIC + 32)) * _in(x, c + 33, ok)
                f0, f1, _, _ = _bytes(((lo >> 4) & 0x0F0F) | (pairs & 0x3030), 2, ASM)
                acc2 += (f0 - (MAGIC + 32)) * _in(x, c + 64, ok)
                acc2 += (f1 - (MAGIC + 32)) * _in(x, c + 65, ok)
                f0, f1, _, _ = _bytes(((hi >> 4) & 0x0F0F) | ((pairs >> 2) & 0x3030), 2, ASM)
                acc3 += (f0 - (MAGIC + 32)) * _in(x, c + 96, ok)
                acc3 += (f1 - (MAGIC + 32)) * _in(x, c + 97, ok)
            scales = block + 192 + half * 8
            shift = (t // 16) * 8  # the byte of each int16 word that is this run's scale
            s0 = _int8(_int16_units(scales) >> shift)
            s1 = _int8(_int16_units(scales + 2) >> shift)
            s2 = _int8(_int16_units(scales + 4) >> shift)
            s3 = _int8(_int16_units(scales + 6) >> shift)
            d = _fp16(_int16_units(block + 208))
            total += d * (s0 * acc0 + s1 * acc1 + s2 * acc2 + s3 * acc3)
    ys = tl.sum(total, axis=0)
    if RESIDUAL:
        ys += tl.load(out + n, mask=n < rows, other=0.0).to(tl.float32)
    tl.store(out + n, cast(ys, out.dtype.element_ty), mask=n < rows)


@triton.jit
def input_kernel(
    x, norm, out, eps, COLS: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr
):
    """out = the GEMV's input row in x's dtype, as torch's normed or activated row would be:
    RMSNorm(x) · norm, or with SILU, SiLU(gate) · up from x = gate | up. One program: a row of a few
    KB, read once here instead of by every GEMV program."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    col = tl.arange(0, BLOCK)
    ok = col < COLS
    if SILU:
        g = tl.load(x + col, mask=ok, other=0.0).to(tl.float32)
        v = g * tl.sigmoid(g) * tl.load(x + COLS + col, mask=ok, other=0.0).to(tl.float32)
    else:
        v = tl.load(x + col, mask=ok, other=0.0).to(tl.float32)
        v = v * tl.rsqrt(tl.sum(v * v, axis=0) / COLS + eps)
        v = v * tl.load(norm + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + col, cast(v, out.dtype.element_ty), mask=ok)
