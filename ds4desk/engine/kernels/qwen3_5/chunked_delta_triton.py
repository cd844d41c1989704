"""Triton source of the chunked gated delta rule (chunked_delta.py holds the math and the op).

Three kernels, C tokens a chunk, everything float32; value head h reads the queries and keys of key
head (h // KEY_DIV) % KEY_HEADS:
- `prepare_kernel`, a program per (chunk, head), all in parallel: the running log-decay γ, the
  chunk's unit lower-triangular system I + A inverted in blocks of 16 (forward substitution inside
  the diagonal blocks, small matmuls below them), and the writes' two parts W = (I + A)⁻¹ (β e^γ K)
  and U = (I + A)⁻¹ (β V).
- `state_kernel`, a program per (value block, head), the one sequential part: it carries the state
  S from chunk to chunk in registers, stores the state each chunk starts from, and turns U into the
  chunk's real writes U - W S.
- `output_kernel`, a program per (chunk, head, value block), all in parallel again: each chunk's
  outputs from the state it started from and its own writes.

The token and chunk counts are not specialised (do_not_specialize): Triton would compile a variant
for each class of them (1, a multiple of 16, any other), so the first prompt of a new class (1,000
tokens: 16 chunks) compiled new variants (that request took 636 ms on an H100), which no warm-up of
fixed lengths covers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _token_rows(base, head, stride_h, stride_t, t, length, cols, D: tl.constexpr):
    """Rows t and columns cols of one head's [T, D] tensor: zero past the run's `length` tokens (which
    then change nothing) and past its D columns."""
    return tl.load(
        base + head * stride_h + t[:, None] * stride_t + cols[None, :],
        mask=(t[:, None] < length) & (cols[None, :] < D),
        other=0.0,
    )


@triton.jit(do_not_specialize=["length"])
def prepare_kernel(
    k,
    v,
    g,
    beta,
    gam,
    w,
    u,
    lower_buf,
    inverse_buf,
    length,
    stride_kh,
    stride_kt,
    stride_vh,
    stride_vt,
    stride_gh,
    stride_gt,
    stride_bh,
    stride_bt,
    padded,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    KEY_DIV: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    key_head = (head // KEY_DIV) % KEY_HEADS
    rows = tl.arange(0, C)
    t = chunk * C + rows
    real = t < length
    # Tokens past the end read as zero keys, zero strength and zero log-decay: they change nothing.
    gamma = tl.cumsum(tl.load(g + head * stride_gh + t * stride_gt, mask=real, other=0.0), 0)
    strength = tl.load(beta + head * stride_bh + t * stride_bt, mask=real, other=0.0)
    tl.store(gam + head * padded + t, gamma)

    # A[t, s] = β_t e^(γ_t - γ_s) (k_t · k_s) for s < t.
    dots = tl.zeros((C, C), dtype=tl.float32)
    for start in range(0, DK, BK):
        cols = start + tl.arange(0, BK)
        block = _token_rows(k, key_head, stride_kh, stride_kt, t, length, cols, DK)
        dots += tl.dot(block, tl.trans(block), input_precision=PRECISION)
    earlier = rows[None, :] < rows[:, None]
    decay = tl.exp(tl.where(earlier, gamma[:, None] - gamma[None, :], 0.0))
    lower = tl.where(earlier, dots * decay * strength[:, None], 0.0)

    # (I + A)⁻¹ in blocks of 16: the diagonal blocks by forward substitution, all at once, then the
    # blocks below them. A and the inverse pass through this chunk's scratch (a barrier between a
    # store and the loads of it), because a tile in registers cannot be indexed by row.
    at = (head * padded + chunk * C) * C
    tl.store(lower_buf + at + rows[:, None] * C + rows[None, :], lower)
    tl.debug_barrier()
    blocks = tl.arange(0, C // 16)
    r = tl.arange(0, 16)
    first = blocks[:, None] * 16  # [blocks, 1]: a diagonal block's first row (and column)
    # diagonal[b, i, j] = ((I + A_bb)⁻¹)[i, j]; row i is e_i - Σ_{j<i} A_bb[i, j] row_j, rows j < i
    # final by then.
    diagonal = tl.where((r[None, :, None] == r[None, None, :]) & (first[:, :, None] >= 0), 1.0, 0.0)
    for i in range(1, 16):
        a_row = tl.load(lower_buf + at + (first + i) * C + first + r[None, :])  # [blocks, 16]: A_bb[i, :]
        row = tl.where(r == i, 1.0, 0.0)[None, :] - tl.sum(a_row[:, :, None] * diagonal, 1)
        diagonal = tl.where((r == i)[None, :, None], row[:, None, :], diagonal)
    square = r[:, None] * C + r[None, :]  # a 16 x 16 block's offsets from its first element
    tl.store(inverse_buf + at + (first[:, :, None] * C + first[:, :, None]) + square[None, :, :], diagonal)
    tl.debug_barrier()
    # Below the diagonal, block row by block row: T_ij = -T_ii Σ_{j<=m<i} A_im T_mj (from (I + A) T = I).
    for i in tl.static_range(1, C // 16):
        t_ii = tl.load(inverse_buf + at + (i * 16) * C + i * 16 + square)
        for j in tl.static_range(0, i):
            total = tl.zeros((16, 16), dtype=tl.float32)
            for m in tl.static_range(j, i):
                a_im = tl.load(lower_buf + at + (i * 16) * C + m * 16 + square)
                t_mj = tl.load(inverse_buf + at + (m * 16) * C + j * 16 + square)
                total += tl.dot(a_im, t_mj, input_precision="ieee")
            t_ij = -tl.dot(t_ii, total, input_precision="ieee")
            tl.store(inverse_buf + at + (i * 16) * C + j * 16 + square, t_ij)
        tl.debug_barrier()
    inverse = tl.load(
        inverse_buf + at + rows[:, None] * C + rows[None, :],
        mask=rows[None, :] // 16 <= rows[:, None] // 16,
        other=0.0,
    )

    key_scale = strength * tl.exp(gamma)
    for start in range(0, DK, BK):
        cols = start + tl.arange(0, BK)
        block = _token_rows(k, key_head, stride_kh, stride_kt, t, length, cols, DK)
        part = tl.dot(inverse, block * key_scale[:, None], input_precision=PRECISION)
        tl.store(w + (head * padded + t[:, None]) * DK + cols[None, :], part, mask=cols[None, :] < DK)
    for start in range(0, DV, BV):
        cols = start + tl.arange(0, BV)
        block = _token_rows(v, head, stride_vh, stride_vt, t, length, cols, DV)
        part = tl.dot(inverse, block * strength[:, None], input_precision=PRECISION)
        tl.store(u + (head * padded + t[:, None]) * DV + cols[None, :], part, mask=cols[None, :] < DV)


@triton.jit(do_not_specialize=["length", "chunks"])
def state_kernel(
    k,
    gam,
    w,
    u,
    starts,
    state,
    length,
    chunks,
    stride_kh,
    stride_kt,
    padded,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    BKF: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    KEY_DIV: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    key_head = (head // KEY_DIV) % KEY_HEADS
    rows = tl.arange(0, C)
    keys = tl.arange(0, BKF)
    values = tl.program_id(0) * BV + tl.arange(0, BV)
    tile = (keys[:, None] < DK) & (values[None, :] < DV)
    at = keys[:, None] * DV + values[None, :]
    carried = tl.load(state + head * DK * DV + at, mask=tile, other=0.0)  # [BKF, BV]
    # A while loop: Triton's interpreter (the tests without a GPU) cannot take a for loop whose bound
    # is an argument under numpy 2.
    chunk = 0
    while chunk < chunks:
        tl.store(starts + (head * chunks + chunk) * DK * DV + at, carried, mask=tile)
        t = chunk * C + rows
        gamma = tl.load(gam + head * padded + t)
        last = tl.load(gam + head * padded + chunk * C + C - 1)
        w_part = tl.load(w + (head * padded + t[:, None]) * DK + keys[None, :], mask=keys[None, :] < DK)
        u_at = u + (head * padded + t[:, None]) * DV + values[None, :]
        writes = tl.load(u_at, mask=values[None, :] < DV) - tl.dot(w_part, carried, input_precision=PRECISION)
        tl.store(u_at, writes, mask=values[None, :] < DV)
        block = _token_rows(k, key_head, stride_kh, stride_kt, t, length, keys, DK)
        to_end = block * tl.exp(last - gamma)[:, None]
        carried = carried * tl.exp(last) + tl.dot(tl.trans(to_end), writes, input_precision=PRECISION)
        chunk += 1
    tl.store(state + head * DK * DV + at, carried, mask=tile)


@triton.jit(do_not_specialize=["length", "chunks"])
def output_kernel(
    q,
    k,
    gam,
    u,
    starts,
    out,
    length,
    chunks,
    stride_qh,
    stride_qt,
    stride_kh,
    stride_kt,
    stride_oh,
    stride_ot,
    padded,
    DK: tl.constexpr,
    DV: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    KEY_DIV: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    key_head = (head // KEY_DIV) % KEY_HEADS
    rows = tl.arange(0, C)
    t = chunk * C + rows
    real = t < length
    values = tl.program_id(2) * BV + tl.arange(0, BV)
    scores = tl.zeros((C, C), dtype=tl.float32)
    from_start = tl.zeros((C, BV), dtype=tl.float32)
    start_state = starts + (head * chunks + chunk) * DK * DV
    for start in range(0, DK, BK):
        cols = start + tl.arange(0, BK)
        q_part = _token_rows(q, key_head, stride_qh, stride_qt, t, length, cols, DK)
        k_part = _token_rows(k, key_head, stride_kh, stride_kt, t, length, cols, DK)
        scores += tl.dot(q_part, tl.trans(k_part), input_precision=PRECISION)
        s_part = tl.load(
            start_state + cols[:, None] * DV + values[None, :],
            mask=(cols[:, None] < DK) & (values[None, :] < DV),
            other=0.0,
        )
        from_start += tl.dot(q_part, s_part, input_precision=PRECISION)
    gamma = tl.load(gam + head * padded + t)
    causal = rows[None, :] <= rows[:, None]
    scores = tl.where(causal, scores * tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    writes = tl.load(
        u + (head * padded + t[:, None]) * DV + values[None, :], mask=values[None, :] < DV, other=0.0
    )
    result = from_start * tl.exp(gamma)[:, None] + tl.dot(scores, writes, input_precision=PRECISION)
    tl.store(
        out + head * stride_oh + t[:, None] * stride_ot + values[None, :],
        result,
        mask=real[:, None] & (values[None, :] < DV),
    )
