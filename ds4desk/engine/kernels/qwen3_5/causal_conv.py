"""Qwen3.5's causal depthwise convolution + silu over a prompt's rows as one op: `causal_conv_silu`.

A linear-attention layer convolves its q/k/v channels with `kernel` taps each, continuing from the
window it kept (the last kernel - 1 inputs before this chunk), then takes silu. Eagerly
(models/qwen3_5/linear_attention._convolve) that is the inputs transposed and put behind the window
([C, kept + T], a copy), F.conv1d, silu and a transposed view: at Qwen3.5-9B's shapes on an H200,
3.6 ms of a 4k-token prefill's 38.4 ms (bench/results/qwen35_prefill_profile_20261205T0538Z.txt),
for what reads and writes about 64 MB a layer. On NVIDIA GPUs with Triton it is one kernel that
reads the inputs [T, C] where they are (and the window for the first kernel - 1 rows), sums the taps
in float32 and writes silu of the rounded sum as [T, C] once. The window's update (a [C, kernel - 1]
copy) stays with the caller, after the op: the op's programs read the old window. Elsewhere
`reference` runs, the eager math op for op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, nvidia, on_its_device

SWITCH = Switch(
    "qwen3_5.causal_conv",
    "Qwen3.5's causal depthwise convolution + silu over a prefill chunk's rows as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

BLOCK_T, BLOCK_C = 32, 128  # a program's rows and channels: 4096 outputs


def enabled(where: Where) -> bool:
    """Whether the model should call `causal_conv_silu` for tensors on `where`."""
    return SWITCH.on(where)


def causal_conv_silu(inputs: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(conv) of inputs [T, C] after window [C, K - 1] with weight [C, K] (tap K - 1 on the
    current row): a new [T, C] in inputs' dtype. The window is read, not updated. Always the custom
    op (see `enabled`)."""
    if inputs.dim() != 2 or weight.dim() != 2 or weight.shape[0] != inputs.shape[1]:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and weight {tuple(weight.shape)} must be [T, C], [C, K]"
        )
    if window.shape != (inputs.shape[1], weight.shape[1] - 1):
        raise ValueError(
            f"window {tuple(window.shape)} must be [C, K - 1] = [{inputs.shape[1]}, {weight.shape[1] - 1}]"
        )
    if not inputs.dtype == window.dtype == weight.dtype:
        raise ValueError(
            f"inputs, window and weight differ in dtype: {inputs.dtype}, {window.dtype}, {weight.dtype}"
        )
    return _fused_op(inputs, window, weight)


def reference(inputs: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear_attention._convolve's math for a chunk of more than one row, op for op."""
    extended = torch.cat((window, inputs.t()), dim=1)  # [C, kept + T]
    out = F.conv1d(extended[None], weight[:, None, :], groups=extended.shape[0])[0]
    return F.silu(out).t().contiguous()


@torch.library.custom_op("ds4desk::qwen35_causal_conv", mutates_args=())
def _fused_op(inputs: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(inputs) else None
    run = reference if kernel is None else kernel
    return run(inputs, window, weight)


@_fused_op.register_fake
def _(inputs, window, weight):
    return inputs.new_empty(inputs.shape)


@functools.cache
def _jit_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def kernel(
        inputs,  # [T, C], rows apart by in_stride
        window,  # [C, K - 1], rows apart by window_stride
        weight,  # [C, K], rows apart by weight_stride
        out,  # [T, C] contiguous
        rows,
        channels,
        in_stride,
        window_stride,
        weight_stride,
        K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_in, channel_in = t < rows, c < channels
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            # Tap j reads position t - (K - 1) + j: a row of the inputs, or before the chunk the
            # window's column K - 1 + that (negative) position. Offsets are clamped into range so
            # that no masked-off lane points outside its tensor.
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
        dtype = out.dtype.element_ty
        conv = acc.to(dtype).to(tl.float32)  # rounded where conv1d's output is
        tl.store(
            out + t[:, None] * channels + c[None, :],
            (conv / (1.0 + tl.exp(-conv))).to(dtype),
            mask=row_in[:, None] & channel_in[None, :],
        )

    return kernel


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    kernel = _jit_kernel()
    if kernel is None:
        return None

    def launch(inputs: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, channels = inputs.shape
        taps = weight.shape[1]
        # Rows of contiguous channels (a row stride is fine); the window and weight are tiny.
        if inputs.stride(1) != 1:
            inputs = inputs.contiguous()
        window = window if taps == 1 or window.stride(1) == 1 else window.contiguous()
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        out = torch.empty((rows, channels), dtype=inputs.dtype, device=inputs.device)
        if rows and channels:
            grid = (-(-rows // BLOCK_T), -(-channels // BLOCK_C))
            kernel[grid](
                inputs, window, weight, out, rows, channels,
                inputs.stride(0), window.stride(0), weight.stride(0),
                K=taps, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4,
            )  # fmt: skip
        return out

    return on_its_device(launch)
