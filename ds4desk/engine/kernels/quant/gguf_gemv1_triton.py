"""Triton source of the one-row GEMV for the GGUF types a decode step spends its time on (Q8_0, Q4_K,
Q6_K: Q8_0 files and the K-quant mixes), y = x @ dequantize(W)ᵀ for x [1, K], and of the kernel that
prepares its input row. gguf_launch.py launches them; the general kernel
(gguf_blocks_triton.gemv_kernel) takes the other types, more rows, and the small matrices.

At batch 1 the general kernel is bound by the instructions it issues per weight value, about 15,
not by the bytes. This one issues about 5:

- Tiles are [G groups, BLOCK_N rows] and a thread holds one group of every row of its program. A
  group is the run of values that share their scales: a Q8_0 block; a Q4_K pair of sub-blocks,
  whose codes are the low and high nibbles of the same 32 bytes; a Q6_K quarter of a super-block
  (16 bytes of low nibbles from each half of `ql` with their 16 bytes of high pairs in `qh`: 64
  values of four sub-blocks). A group's code units are walked in an unrolled loop, and each unit's
  inputs are read once for all the rows. Q4_K reads int32 units (its codes are 16-byte aligned, but
  16-byte loads in inline PTX leave the weight tile out of Triton's coalescing pass, which then
  spreads rows instead of groups over the threads: slower on long rows and the head, and a paired
  gate/up summing its rows in another order than the plain one); Q6_K, whose 210-byte blocks start
  at even addresses, reads aligned 4-byte words and funnel-shifts them into place (a warp's threads
  hold groups 16 and 210 bytes apart, so each 2-byte load touched every line the warp spans again);
  Q8_0's 34-byte blocks read int16.
- A code byte becomes a float by one PRMT (PTX) that moves it under 2^23's exponent, then one
  subtraction and one fma; the scales are factored out of the sums (a group's sums are multiplied
  by its scale once), and Q4_K's minimums multiply the group's sum of inputs.
- The input row is normed or activated once, by `input_kernel`, not by every GEMV program. For
  Q4_K and Q6_K it also writes the row in float32 in the order the GEMV's threads read it: for each
  step of the unrolled loop, the G values the G threads of a tile need lie side by side (one
  128-byte line a warp), where in the row's own order they lie 64 values apart and a warp's load
  touches 32 lines. (Profiled on an H200 with Nsight Compute, the Q4_K GEMV in row order was bound
  by L1 wavefronts, most of them the input's; Q8_0 measured slower in read order and keeps its row.)

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
def _window(lo, hi, shift, ASM: tl.constexpr):
    """The 4 bytes starting `shift` bits (0 or 16) into the aligned int32 pair lo | hi: a Q6_K run
    starts 2 bytes past a 4-byte boundary in every other 210-byte block, so its bytes are read as
    aligned words and shifted into place (one SHF a window) instead of as 2-byte units."""
    if ASM:
        return tl.inline_asm_elementwise(
            "shf.r.clamp.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [lo, hi, shift],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        both = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        return (both >> shift.to(tl.int64)).to(tl.int32)


@triton.jit
def _aligned_words(ptr):
    """(int32 pointers, shift in bits): the aligned words that hold the bytes at the 2-aligned byte
    pointers ptr, for _window(w[u], w[u + 1], shift) = bytes 4u .. 4u + 3 of ptr."""
    offset = ptr.to(tl.int64) % 4
    return (ptr - offset).to(tl.pointer_type(tl.int32)), (offset * 8).to(tl.int32)


@triton.jit
def _q6k_window(
    low_words,
    high_words,
    pair_words,
    shift,
    xs,
    u: tl.constexpr,
    G: tl.constexpr,
    ASM: tl.constexpr,
    acc0,
    acc1,
    acc2,
    acc3,
):
    """Q6_K: the sums of window u (positions 4u .. 4u + 3 of the group's four runs: low nibbles of
    ql (lo) and ql + 32 (hi), high nibbles of both, with their top bits from qh (pairs)) added to the
    runs' running sums. The words are those of _aligned_words (word u + 1 is loaded again by the next
    window; the compiler keeps the first load)."""
    lo = _window(tl.load(low_words + u), tl.load(low_words + u + 1), shift, ASM)
    hi = _window(tl.load(high_words + u), tl.load(high_words + u + 1), shift, ASM)
    pairs = _window(tl.load(pair_words + u), tl.load(pair_words + u + 1), shift, ASM)
    f0, f1, f2, f3 = _bytes((lo & 0x0F0F0F0F) | ((pairs & 0x03030303) << 4), 4, ASM)
    acc0 += (f0 - (MAGIC + 32)) * _in(xs, 16 * u, G)
    acc0 += (f1 - (MAGIC + 32)) * _in(xs, 16 * u + 1, G)
    acc0 += (f2 - (MAGIC + 32)) * _in(xs, 16 * u + 2, G)
    acc0 += (f3 - (MAGIC + 32)) * _in(xs, 16 * u + 3, G)
    f0, f1, f2, f3 = _bytes((hi & 0x0F0F0F0F) | ((pairs & 0x0C0C0C0C) << 2), 4, ASM)
    acc1 += (f0 - (MAGIC + 32)) * _in(xs, 16 * u + 4, G)
    acc1 += (f1 - (MAGIC + 32)) * _in(xs, 16 * u + 5, G)
    acc1 += (f2 - (MAGIC + 32)) * _in(xs, 16 * u + 6, G)
    acc1 += (f3 - (MAGIC + 32)) * _in(xs, 16 * u + 7, G)
    f0, f1, f2, f3 = _bytes(((lo >> 4) & 0x0F0F0F0F) | (pairs & 0x30303030), 4, ASM)
    acc2 += (f0 - (MAGIC + 32)) * _in(xs, 16 * u + 8, G)
    acc2 += (f1 - (MAGIC + 32)) * _in(xs, 16 * u + 9, G)
    acc2 += (f2 - (MAGIC + 32)) * _in(xs, 16 * u + 10, G)
    acc2 += (f3 - (MAGIC + 32)) * _in(xs, 16 * u + 11, G)
    f0, f1, f2, f3 = _bytes(((hi >> 4) & 0x0F0F0F0F) | ((pairs >> 2) & 0x30303030), 4, ASM)
    acc3 += (f0 - (MAGIC + 32)) * _in(xs, 16 * u + 12, G)
    acc3 += (f1 - (MAGIC + 32)) * _in(xs, 16 * u + 13, G)
    acc3 += (f2 - (MAGIC + 32)) * _in(xs, 16 * u + 14, G)
    acc3 += (f3 - (MAGIC + 32)) * _in(xs, 16 * u + 15, G)
    return acc0, acc1, acc2, acc3


@triton.jit
def _int8(v):
    """The low byte of an int32 read as int8, as float32."""
    return _exact_float((v & 255) ^ 128, 128)


@triton.jit
def _in(xs, slot, G: tl.constexpr):
    """float32 [G, 1] input values of read slot `slot` (xs: the tile's base pointers, see slot_col)."""
    return tl.load(xs + slot * G)


@triton.jit
def _in_row(x, col, ok):
    """float32 [G, 1] input values at columns `col` of a row in its own order, 0 where not ok."""
    return tl.load(x + col, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def slot_col(d, KIND: tl.constexpr, G: tl.constexpr, V: tl.constexpr):
    """(column of the row, group) whose value the GEMV reads at index d of the input in read order.
    The order is [tile][slot][thread]: a tile of G groups of V values takes G · V entries, and slot s
    of thread i holds the value group (tile · G + i) reads at its step s, numbered as gemv1_kernel
    reads them: Q4_K (V = 64) value 32h + 4u + k of the sub-block pair (h: high nibbles) at
    s = 8u + 4h + k; Q6_K (V = 64) value 32q + 4u + k of the group's four runs at s = 16u + 4q + k."""
    tile = d // (G * V)
    s = (d // G) % V
    group = tile * G + d % G
    if KIND == Q4_K:
        col = group * 64 + ((s // 4) % 2) * 32 + (s // 8) * 4 + s % 4
    else:
        tl.static_assert(KIND == Q6_K)
        base = group // 4 * 256 + (group % 4) // 2 * 128 + (group % 2) * 16
        col = base + ((s // 4) % 4) * 32 + (s // 16) * 4 + s % 4
    return col, group


@triton.jit
def read_slot(col, KIND: tl.constexpr, G: tl.constexpr):
    """The index in read order (slot_col's d) of column `col` of a row read by a KIND GEMV with
    tiles of G groups: slot_col's inverse, for a kernel that writes the next GEMV's input itself."""
    if KIND == Q4_K:  # col = 64 group + 32 h + 4 u + k, read at s = 8u + 4h + k
        group = col // 64
        r = col % 64
        s = (r % 32) // 4 * 8 + (r // 32) * 4 + r % 4
    else:  # Q6_K: col = 256 block + 128 half + 32 q + 16 t + 4 u + k, group 4 block + 2 half + t
        tl.static_assert(KIND == Q6_K)
        group = col // 128 * 2 + (col % 32) // 16
        r = col % 128
        s = (r % 16) // 4 * 16 + (r // 32) * 4 + r % 4
    return group // G * (G * 64) + s * G + group % G


# input_kernel's MODE
COPY: tl.constexpr = tl.constexpr(0)
NORM: tl.constexpr = tl.constexpr(1)
SILU: tl.constexpr = tl.constexpr(2)

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
    act=None,
    half_rows=0,
    PAIRED: tl.constexpr = False,
    ACT_KIND: tl.constexpr = 0,
    ACT_G: tl.constexpr = 1,
):
    """out[0, n] (+)= Σ_k x_k · W[n, k] for the BLOCK_N rows n of this program. Tiles are
    [G, BLOCK_N]: a thread holds one group of every row of the program (neither axis of a tile is
    contiguous in memory, so Triton spreads the first across the threads), walks the group's code
    units one at a time (an unrolled loop), reads each unit's inputs once for all its rows and keeps
    one running sum a row and sub-block; the rows are reduced across threads once, at the end. x is
    Q4_K's and Q6_K's float32 input in read order (slot_col, 0 past the row's end), Q8_0's row as it
    is. Rows past the end read the last row again (the stores are masked), groups past the row's
    end the last group (their inputs are 0), so the weight loads need no mask.

    PAIRED (W is gate | up, half_rows rows each): a program takes BLOCK_N / 2 gate rows and the up
    rows of the same units, and also writes SiLU(gate) · up, rounded as input_kernel's SILU rounds
    it, into `act`: the input of the down projection that follows, in the read order of an ACT_KIND
    (Q4_K, Q6_K) GEMV with tiles of ACT_G groups (read_slot). The down projection's own input
    kernel is then not launched."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.arange(0, BLOCK_N)
    if PAIRED:
        unit = tl.program_id(0) * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        live = unit < half_rows
        n = unit + tl.where(j < BLOCK_N // 2, 0, half_rows)
        first = tl.minimum(unit, half_rows - 1) + tl.where(j < BLOCK_N // 2, 0, half_rows)
    else:
        n = tl.program_id(0) * BLOCK_N + j
        live = n < rows
        first = tl.minimum(n, rows - 1)
    if RESIDUAL:  # read now: loaded after the sums, its latency was the program's last step
        prior = tl.load(out + n, mask=live, other=0.0).to(tl.float32)
    row = w + first.to(tl.int64)[None, :] * row_bytes  # [1, BLOCK_N]
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
                acc += (f0 - (MAGIC + 128)) * _in_row(x, gi * 32 + 2 * u, ok)
                acc += (f1 - (MAGIC + 128)) * _in_row(x, gi * 32 + 2 * u + 1, ok)
            total += _fp16(_int16_units(block)) * acc
        elif KIND == Q4_K:  # 144-byte super-blocks: d | dmin | 12 scale bytes | 128 code bytes
            # Group = a pair of sub-blocks: 32 code bytes whose low nibbles are sub-block 2 pair's
            # values and whose high nibbles are sub-block 2 pair + 1's.
            pair = gc % 4
            words = (row + gc // 4 * 144).to(tl.pointer_type(tl.int32))
            head = tl.load(words)
            s0, s1, m0, m1 = _k_scales(tl.load(words + 1), tl.load(words + 2), tl.load(words + 3), pair)
            xs = x + g0 * 64 + tl.arange(0, G)[:, None]
            low = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            high = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            low_inputs = tl.zeros((G, 1), dtype=tl.float32)  # for the minimums
            high_inputs = tl.zeros((G, 1), dtype=tl.float32)
            for u in tl.static_range(8):
                v = tl.load(words + 4 + pair * 8 + u)
                f0, f1, f2, f3 = _bytes(v & 0x0F0F0F0F, 4, ASM)
                x0, x1 = _in(xs, 8 * u, G), _in(xs, 8 * u + 1, G)
                x2, x3 = _in(xs, 8 * u + 2, G), _in(xs, 8 * u + 3, G)
                low += (f0 - MAGIC) * x0
                low += (f1 - MAGIC) * x1
                low += (f2 - MAGIC) * x2
                low += (f3 - MAGIC) * x3
                low_inputs += x0 + x1 + x2 + x3
                f0, f1, f2, f3 = _bytes((v >> 4) & 0x0F0F0F0F, 4, ASM)
                x0, x1 = _in(xs, 8 * u + 4, G), _in(xs, 8 * u + 5, G)
                x2, x3 = _in(xs, 8 * u + 6, G), _in(xs, 8 * u + 7, G)
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
            xs = x + g0 * 64 + tl.arange(0, G)[:, None]
            acc0 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            acc1 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            acc2 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
            low_words, offset = _aligned_words(ql)  # ql + 32 and qh lie at the same offset
            pair_words, _ = _aligned_words(qh)
            high_words = low_words + 8
            for u in tl.static_range(4):
                acc0, acc1, acc2, acc3 = _q6k_window(
                    low_words, high_words, pair_words, offset, xs, u, G, ASM, acc0, acc1, acc2, acc3
                )
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
        ys += prior
    stored = cast(ys, out.dtype.element_ty)
    tl.store(out + n, stored, mask=live)
    if PAIRED:
        halves = tl.reshape(stored.to(tl.float32), (2, BLOCK_N // 2))  # gate values, then up
        is_gate = (tl.arange(0, 2) == 0)[:, None]
        g = tl.sum(tl.where(is_gate, halves, 0.0), axis=0)
        u = tl.sum(tl.where(is_gate, 0.0, halves), axis=0)
        h = cast(g * tl.sigmoid(g) * u, out.dtype.element_ty)
        col = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(act + read_slot(col, ACT_KIND, ACT_G), h.to(tl.float32), mask=col < half_rows)


@triton.jit
def input_kernel(
    x,
    norm,
    out,
    eps,
    COLS: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    PDL: tl.constexpr,
    KIND: tl.constexpr = 0,
    G: tl.constexpr = 1,
    V: tl.constexpr = 1,
    N_GROUPS: tl.constexpr = 0,
    OUT_BLOCK: tl.constexpr = 0,
    row_out=None,
):
    """The GEMV's input row, as torch's would be, rounded to x's dtype: MODE NORM RMSNorm(x) · norm,
    SILU SiLU(gate) · up from x = gate | up, COPY x itself. With OUT_BLOCK 0 it is written in row
    order in x's dtype (normed_row); otherwise in float32 in the read order of gemv1_kernel (KIND, G
    tiles of V-value groups, slot_col), OUT_BLOCK entries, 0 past the row's groups, and, given
    row_out, in row order there too (a q/k/v group whose parts differ in type: q's GEMV reads the
    first, k's and v's the second). One program: a row of a few KB, read once here instead of by
    every GEMV program."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    scale = 1.0
    if MODE == NORM:
        col = tl.arange(0, BLOCK)
        v = tl.load(x + col, mask=col < COLS, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(v * v, axis=0) / COLS + eps)
    if OUT_BLOCK == 0:
        col = tl.arange(0, BLOCK)
        ok = col < COLS
        dest = col
    else:
        dest = tl.arange(0, OUT_BLOCK)
        col, group = slot_col(dest, KIND, G, V)
        ok = group < N_GROUPS
        col = tl.where(ok, col, 0)
    if MODE == SILU:
        g = tl.load(x + col, mask=ok, other=0.0).to(tl.float32)
        v = g * tl.sigmoid(g) * tl.load(x + COLS + col, mask=ok, other=0.0).to(tl.float32)
    else:
        v = tl.load(x + col, mask=ok, other=0.0).to(tl.float32)
        if MODE == NORM:
            v = v * scale
            v = v * tl.load(norm + col, mask=ok, other=0.0).to(tl.float32)
    v = cast(v, x.dtype.element_ty)
    if OUT_BLOCK == 0:
        tl.store(out + dest, v, mask=ok)
    else:
        tl.store(out + dest, tl.where(ok, v.to(tl.float32), 0.0))
        if row_out is not None:
            tl.store(row_out + col, v, mask=ok)
