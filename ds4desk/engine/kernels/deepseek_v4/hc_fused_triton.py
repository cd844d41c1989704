"""The Triton kernels of v4_hc_fused (imported only where Triton is: v4_hc_fused._kernels).

They live at module level because a kernel finds the @triton.jit helpers it calls among its module's
globals.

The prefill kernels take a chunk's token count and split count unspecialised (do_not_specialize):
Triton compiles, or reads from its disk cache, one variant per specialisation of an integer argument
(equal to 1, divisible by 16, neither), and a prompt whose length the load's warm-up did not meet
paid milliseconds of that on its first request."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix_kernel(
    x,
    y,
    post,
    comb,
    fn,
    out,
    part,
    D,
    post_stride,
    EXPAND: tl.constexpr,
    M: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (block b, token t): the new streams' [M, BD] slice (when EXPAND) and part[t, b] =
    [its dot products with fn's R rows | its sum of squares at R | 0 ...] ([RP] float32)."""
    blk = tl.program_id(0)
    t = tl.program_id(1)
    blocks = tl.num_programs(0)
    c = tl.arange(0, M * BD)  # the slice flattened: stream k = c // BD, dim d
    k = c // BD
    d = blk * BD + c % BD
    live = d < D
    col = k * D + d  # the column of fn (and the offset in the token's flat streams)
    row = t * M * D
    r = tl.arange(0, RP)
    # No earlier kernel writes fn: its tile streams in while the kernel before this one ends.
    w = tl.load(fn + r[:, None] * (M * D) + col[None, :], mask=(r[:, None] < R) & live[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if EXPAND:
        # As _expand: the coefficients are rounded to the streams' dtype, the sum is float32, in
        # bmm's order (the streams j, then y), and the result is rounded once.
        acc = tl.zeros([M * BD], dtype=tl.float32)
        for j in tl.static_range(M):
            xj = tl.load(x + row + j * D + d, mask=live, other=0.0).to(tl.float32)
            cjk = tl.load(comb + t * M * M + j * M + k).to(out.dtype.element_ty).to(tl.float32)
            acc += cjk * xj
        pk = tl.load(post + t * post_stride + k).to(out.dtype.element_ty).to(tl.float32)
        yd = tl.load(y + t * D + d, mask=live, other=0.0).to(tl.float32)
        acc += pk * yd
        rounded = acc.to(out.dtype.element_ty)
        tl.store(out + row + col, rounded, mask=live)
        xk = rounded.to(tl.float32)
    else:
        xk = tl.load(x + row + col, mask=live, other=0.0).to(tl.float32)
    dots = tl.sum(w * xk[None, :], axis=1)
    dots = tl.where(r == R, tl.sum(xk * xk, axis=0), dots)
    tl.store(part + (t * blocks + blk) * RP + r, dots)


@triton.jit
def expand_kernel(x, y, post, comb, out, D, post_stride, M: tl.constexpr, BD: tl.constexpr):
    """Program (block b, token t): the new streams' [M, BD] slice X'_k = post_k y + Σ_j C[j, k] X_j,
    as mix_kernel's EXPAND (coefficients rounded to the streams' dtype, bmm's order), with each
    X_j read once for all k: prefill's expand before tiled_mix_kernel."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    d = b * BD + tl.arange(0, BD)
    live = d < D
    k = tl.arange(0, M)
    acc = tl.zeros([M, BD], dtype=tl.float32)
    for j in tl.static_range(M):
        xj = tl.load(x + t * (M * D) + j * D + d, mask=live, other=0.0).to(tl.float32)
        cj = tl.load(comb + t * (M * M) + j * M + k).to(out.dtype.element_ty).to(tl.float32)
        acc += cj[:, None] * xj[None, :]
    pk = tl.load(post + t * post_stride + k).to(out.dtype.element_ty).to(tl.float32)
    yd = tl.load(y + t * D + d, mask=live, other=0.0).to(tl.float32)
    acc += pk[:, None] * yd[None, :]
    tl.store(
        out + t * (M * D) + k[:, None] * D + d[None, :], acc.to(out.dtype.element_ty), mask=live[None, :]
    )


@triton.jit(do_not_specialize=["T"])
def tiled_mix_kernel(
    x,
    fn,
    part,
    T,
    D,
    M: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    STEPS: tl.constexpr,
    SPLIT_DOT: tl.constexpr,
):
    """mix_kernel's partials for many tokens (prefill, the streams already expanded): program
    (token block b, split s) covers BT tokens and STEPS blocks of BD dims of every stream, and the
    dot products with fn's rows run on the tensor cores: part[t, s] = [dots | sum of squares at R |
    0 ...]. With SPLIT_DOT (bfloat16 streams) fn's float32 tile goes in as two bfloat16 terms, hi +
    lo (16 of float32's 24 mantissa bits, an error far below the bf16 streams' own); otherwise the
    dot is float32 throughout."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    t = b * BT + tl.arange(0, BT)
    live_t = t < T
    dd = tl.arange(0, BD)
    r = tl.arange(0, RP)
    # int32 offset tiles made once; each load adds a scalar (a pointer tile per load spills).
    x_tile = t[:, None] * (M * D) + dd[None, :]
    w_tile = r[None, :] * (M * D) + dd[:, None]  # fn's rows as columns: [BD, RP]
    acc = tl.zeros([BT, RP], dtype=tl.float32)
    squares = tl.zeros([BT], dtype=tl.float32)
    # One runtime loop over (dim block, stream): unrolled streams would keep M tiles live at once.
    for i in range(STEPS * M):
        k = i % M
        d0 = (s * STEPS + i // M) * BD
        live_d = d0 + dd < D
        xk = tl.load(x + x_tile + (k * D + d0), mask=live_t[:, None] & live_d[None, :], other=0.0)
        xf = xk.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
        w = tl.load(fn + w_tile + (k * D + d0), mask=(r[None, :] < R) & live_d[:, None], other=0.0)
        if SPLIT_DOT:
            hi = w.to(tl.bfloat16)
            acc = tl.dot(xk, hi, acc)
            acc = tl.dot(xk, (w - hi.to(tl.float32)).to(tl.bfloat16), acc)
        else:
            acc = tl.dot(xf, w, acc, input_precision="ieee")
    acc = tl.where(r[None, :] == R, squares[:, None], acc)
    splits = tl.num_programs(1)
    tl.store(part + (t[:, None] * splits + s) * RP + r[None, :], acc, mask=live_t[:, None])


@triton.jit
def _partial_sum(part, t, blocks, offsets, RP: tl.constexpr, NB: tl.constexpr):
    """Σ over the blocks of part[t, b, offsets] for a 1-D `offsets`."""
    b = tl.arange(0, NB)
    values = tl.load(
        part + (t * blocks + b[:, None]) * RP + offsets[None, :], mask=b[:, None] < blocks, other=0.0
    )
    return tl.sum(values, axis=0)


@triton.jit
def _inverse_rms(part, t, blocks, count, eps, R: tl.constexpr, RP: tl.constexpr, NB: tl.constexpr):
    r = tl.arange(0, RP)
    total = _partial_sum(part, t, blocks, r, RP, NB)
    squares = tl.sum(tl.where(r == R, total, 0.0), axis=0)
    return 1.0 / tl.sqrt(squares / count + eps)


@triton.jit(do_not_specialize=["blocks"])
def finish_kernel(
    part, z, blocks, count, eps, R: tl.constexpr, RP: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr
):
    """Program t: z[t] = (Σ_b dots) · rsqrt(Σ_b squares / count + eps)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    inv = _inverse_rms(part, t, blocks, count, eps, R, RP, NB)
    r = tl.arange(0, RP)
    total = _partial_sum(part, t, blocks, r, RP, NB)
    tl.store(z + t * R + r, total * inv, mask=r < R)


@triton.jit
def _collapse_norm_slice(
    x, pre, weight, h, s, D: tl.constexpr, eps, M: tl.constexpr, BD: tl.constexpr, SLICE: tl.constexpr
):
    """h[slice s] = rms_norm(Σ_j pre_j x[j, :D]) · weight over columns s · SLICE .. (s + 1) · SLICE - 1,
    cast to h's dtype. The norm's sum of squares covers the whole row: every program recomputes it (the row is
    m · D values in L2, which is cheaper at batch 1 than a second kernel). The loop over D is
    unrolled so that its loads are in flight together."""
    i = tl.arange(0, M)
    squares = tl.zeros([BD], dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        xs = tl.load(x + i[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0).to(tl.float32)
        acc = tl.sum(pre[:, None] * xs, axis=0)
        squares += acc * acc
    inv = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / D + eps)
    CB: tl.constexpr = BD if BD < SLICE else SLICE
    for c0 in tl.static_range(0, SLICE, CB):
        d = s * SLICE + c0 + tl.arange(0, CB)
        live = d < D
        xs = tl.load(x + i[:, None] * D + d[None, :], mask=live[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(pre[:, None] * xs, axis=0)
        wd = tl.load(weight + d, mask=live, other=0.0).to(tl.float32)
        tl.store(h + d, (acc * inv * wd).to(h.dtype.element_ty), mask=live)


@triton.jit
def collapse_kernel(
    x,
    pre,
    pre_stride,
    weight,
    h,
    D: tl.constexpr,
    eps,
    M: tl.constexpr,
    BD: tl.constexpr,
    SLICE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (s, t): slice s of token t's normed collapse."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    t = tl.program_id(1)
    p = tl.load(pre + t * pre_stride + tl.arange(0, M)).to(tl.float32)
    _collapse_norm_slice(x + t * M * D, p, weight, h + t * D, s, D, eps, M, BD, SLICE)


@triton.jit(do_not_specialize=["blocks"])
def site_kernel(
    part,
    x,
    scale,
    base,
    weight,
    gates_out,
    comb_out,
    h,
    blocks,
    D: tl.constexpr,  # constexpr: the collapse loop over D is unrolled (one compile per model width)
    eps,
    hc_eps,
    ITERS: tl.constexpr,
    M: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    NB: tl.constexpr,
    BD: tl.constexpr,
    SLICE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (s, t) with s < cdiv(D, SLICE): pre from the mix partials, then slice s of
    h = rms_norm(Σ_j pre_j X_j) · weight. The last program of a token makes [pre | post] and the
    Sinkhorn matrix as v4_hc_kernel does: a serial chain of tiny reductions, so it runs beside
    the collapse rather than before it."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    t = tl.program_id(1)
    inv = _inverse_rms(part, t, blocks, M * D, eps, R, RP, NB)
    if s == tl.num_programs(0) - 1:
        g = tl.arange(0, 2 * M)
        zg = _partial_sum(part, t, blocks, g, RP, NB) * inv
        gate = tl.sigmoid(zg * tl.load(scale + g // M) + tl.load(base + g))
        tl.store(gates_out + t * (2 * M) + g, tl.where(g < M, gate + hc_eps, 2.0 * gate))

        i = tl.arange(0, M)
        cell = i[:, None] * M + i[None, :]  # [M, M], row-major
        zc = tl.reshape(_partial_sum(part, t, blocks, 2 * M + tl.arange(0, M * M), RP, NB), (M, M)) * inv
        logits = zc * tl.load(scale + 2) + tl.load(base + 2 * M + cell)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        cm = e / tl.sum(e, axis=1)[:, None] + hc_eps
        cm = cm / (tl.sum(cm, axis=0)[None, :] + hc_eps)  # columns first
        for _ in range(ITERS - 1):
            cm = cm / (tl.sum(cm, axis=1)[:, None] + hc_eps)
            cm = cm / (tl.sum(cm, axis=0)[None, :] + hc_eps)
        tl.store(comb_out + t * (M * M) + cell, cm)
    else:
        # pre as the gates' first M (the same ops: the same values).
        i = tl.arange(0, M)
        zp = _partial_sum(part, t, blocks, i, RP, NB) * inv
        pre = tl.sigmoid(zp * tl.load(scale) + tl.load(base + i)) + hc_eps
        _collapse_norm_slice(x + t * M * D, pre, weight, h + t * D, s, D, eps, M, BD, SLICE)
