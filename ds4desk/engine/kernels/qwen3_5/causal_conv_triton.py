"""Triton source of Qwen3.5's linear-attention input stage (causal_conv.py holds the math and the op)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_silu(inputs, window, weight, t, row_in, c, channel_in, in_stride, window_stride,
              weight_stride, K: tl.constexpr, dtype: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_C: tl.constexpr):  # fmt: skip
    """silu(conv) of rows t and channels c, rounded to `dtype` where the eager ops round, as float32."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        # Tap j reads position t - (K - 1) + j: a row of the inputs, or before the chunk the window's
        # column K - 1 + that (negative) position. Offsets are clamped into range so that no
        # masked-off lane points outside its tensor.
        p = t - (K - 1) + j
        from_inputs = (p >= 0) & row_in
        from_window = (p < 0) & row_in
        x = tl.load(
            inputs + tl.maximum(p, 0)[:, None] * in_stride + c[None, :],
            mask=from_inputs[:, None] & channel_in[None, :],
            other=0.0,
        ).to(tl.float32)
        column = tl.minimum(tl.maximum(p + (K - 1), 0), K - 2)
        x += tl.load(
            window + c[None, :] * window_stride + column[:, None],
            mask=from_window[:, None] & channel_in[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(weight + c * weight_stride + j, mask=channel_in, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    conv = acc.to(dtype).to(tl.float32)  # conv1d's output, in the model's dtype
    return (conv / (1.0 + tl.exp(-conv))).to(dtype).to(tl.float32)  # and silu's


@triton.jit(do_not_specialize=["rows"])
def conv_heads_kernel(
    inputs,  # [T, C], rows apart by in_stride
    window,  # [C, K - 1], rows apart by window_stride
    weight,  # [C, K], rows apart by weight_stride
    q_out,  # [T, KEY_HEADS, DK] float32
    k_out,  # [T, KEY_HEADS, DK] float32
    v_out,  # [T, HEADS, DV] float32
    rows,
    in_stride,
    window_stride,
    weight_stride,
    q_scale,
    eps,
    KEY_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """A program per block of BLOCK_T rows and key head j: j's query and key scaled to unit length (the
    query also by q_scale), and the values of value heads j R .. j R + R - 1 (R = HEADS / KEY_HEADS;
    which value head reads which key head is the delta rule's business, not this kernel's)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    key_head = tl.program_id(1)
    row_in = t < rows
    dtype = inputs.dtype.element_ty
    d = tl.arange(0, BLOCK_DK)
    d_in = d < DK
    at = t[:, None] * (KEY_HEADS * DK) + key_head * DK + d[None, :]
    keep = row_in[:, None] & d_in[None, :]
    q = conv_silu(inputs, window, weight, t, row_in, key_head * DK + d, d_in, in_stride, window_stride,
                  weight_stride, K, dtype, BLOCK_T, BLOCK_DK)  # fmt: skip
    tl.store(q_out + at, q * tl.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None] * q_scale, mask=keep)
    k = conv_silu(inputs, window, weight, t, row_in, (KEY_HEADS + key_head) * DK + d, d_in, in_stride,
                  window_stride, weight_stride, K, dtype, BLOCK_T, BLOCK_DK)  # fmt: skip
    tl.store(k_out + at, k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None], mask=keep)
    e = tl.arange(0, BLOCK_DV)
    e_in = e < DV
    for r in tl.static_range(HEADS // KEY_HEADS):
        h = key_head * (HEADS // KEY_HEADS) + r
        v = conv_silu(inputs, window, weight, t, row_in, 2 * KEY_HEADS * DK + h * DV + e, e_in, in_stride,
                      window_stride, weight_stride, K, dtype, BLOCK_T, BLOCK_DV)  # fmt: skip
        tl.store(v_out + t[:, None] * (HEADS * DV) + h * DV + e[None, :], v,
                 mask=row_in[:, None] & e_in[None, :])  # fmt: skip
