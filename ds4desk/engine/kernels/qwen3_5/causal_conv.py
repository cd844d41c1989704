"""The input stage of Qwen3.5's linear-attention layer over a prompt's rows as one op: `conv_heads`.

A linear-attention layer convolves its q/k/v channels with `kernel` taps each, continuing from the
window it kept (the last kernel - 1 inputs before this chunk), and takes silu; the delta rule then
reads per value head the query and key of its key head, each scaled to unit length (the query also
by dk^-1/2), and the value, in float32. Eagerly (models/qwen3_5/linear_attention.py: `_convolve`
and `_heads`) that is the inputs transposed behind the window ([C, kept + T], a copy), F.conv1d, silu,
a transposed copy, a float32 copy and norm of each of q and k, their repeat to the value heads and
a float32 copy of v: at Qwen3.5-9B's shapes on an H200 the convolution alone took 3.6 ms of a
4k-token prefill's 38.4 ms (bench/results/qwen35_prefill_profile_20261205T0538Z.txt), and the steps
after it most of the ~5 ms of elementwise kernels and copies there.

On NVIDIA GPUs with Triton it is one kernel (causal_conv_triton.py), a program per block of rows
and value head: it reads
the inputs [T, C] where they are (the window for the first kernel - 1 rows), sums the taps in
float32, rounds where the eager ops round (the convolution's output and silu's, in the model's
dtype), and writes the three float32 tensors once. The window's update (a [C, kernel - 1] copy)
stays with the caller, after the op: the op's programs read the old window. Elsewhere
`reference` runs, the eager math op for op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device
from ds4desk.engine.kernels.qwen3_5.linear_decode import NORM_EPS, unit_rows

SWITCH = Switch(
    "qwen3_5.causal_conv",
    "Qwen3.5's causal convolution, silu and per-head q/k/v of a prefill chunk as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

BLOCK_T = 16  # a program's rows


def enabled(where: Where) -> bool:
    """Whether the model should call `conv_heads` for tensors on `where`."""
    return SWITCH.on(where)


def conv_heads(
    inputs: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    key_heads: int,
    key_dim: int,
    value_heads: int,
    value_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs [T, C] after window [C, K - 1], weight [C, K] (tap K - 1 on the current row), C =
    2 key_heads key_dim + value_heads value_dim: (q, k [T, value_heads, key_dim], v [T, value_heads,
    value_dim]), float32. Value head h reads key head h // (value_heads / key_heads) where
    `interleaved` (Hugging Face's order), else h % key_heads (a GGUF's). The window is read, not
    updated. Always the custom op (see `enabled`)."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    if inputs.dim() != 2 or inputs.shape[1] != channels or weight.shape[0] != channels or weight.dim() != 2:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and weight {tuple(weight.shape)} must be [T, {channels}], "
            f"[{channels}, K]"
        )
    if window.shape != (channels, weight.shape[1] - 1):
        raise ValueError(
            f"window {tuple(window.shape)} must be [C, K - 1] = [{channels}, {weight.shape[1] - 1}]"
        )
    if not inputs.dtype == window.dtype == weight.dtype:
        raise ValueError(
            f"inputs, window and weight differ in dtype: {inputs.dtype}, {window.dtype}, {weight.dtype}"
        )
    if key_heads <= 0 or value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads are no multiple of {key_heads} key heads")
    return _fused_op(inputs, window, weight, key_heads, key_dim, value_heads, value_dim, interleaved)


def reference(
    inputs: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    key_heads: int,
    key_dim: int,
    value_heads: int,
    value_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_attention's `_convolve` (more than one row), then `heads`, op for op."""
    extended = torch.cat((window, inputs.t()), dim=1)  # [C, kept + T]
    out = F.conv1d(extended[None], weight[:, None, :], groups=extended.shape[0])[0]
    mixed = F.silu(out).t().contiguous()
    return heads(mixed, key_heads, key_dim, value_heads, value_dim, interleaved)


def heads(
    mixed: torch.Tensor, key_heads: int, key_dim: int, value_heads: int, value_dim: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved channels [T, C] as the delta rule reads them, float32: per value head the query
    and key of its key head, scaled to unit length (the query also by dk^-1/2), and its value. The
    model's eager path (any row count, padding too) calls this as well."""
    count = mixed.shape[0]
    key_width, repeat = key_heads * key_dim, value_heads // key_heads
    q, k, v = mixed.split([key_width, key_width, value_heads * value_dim], dim=1)
    q = unit_rows(q.view(count, key_heads, key_dim)) * key_dim**-0.5
    k = unit_rows(k.view(count, key_heads, key_dim))
    if repeat > 1 and not interleaved:
        # llama.cpp's order (a GGUF's): value head h reads key head h % key heads.
        q, k = q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)
    elif repeat > 1:
        # Hugging Face's, h // repeat: repeat_interleave as an expand, no sizes to learn on the
        # device (graph-safe).
        shape = (count, value_heads, key_dim)
        q = q[:, :, None].expand(count, key_heads, repeat, key_dim).reshape(shape)
        k = k[:, :, None].expand(count, key_heads, repeat, key_dim).reshape(shape)
    return q, k, v.reshape(count, value_heads, value_dim).float()


@torch.library.custom_op("ds4desk::qwen35_conv_heads", mutates_args=())
def _fused_op(
    inputs: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    key_heads: int,
    key_dim: int,
    value_heads: int,
    value_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(inputs) else None
    run = reference if kernel is None else kernel
    return run(inputs, window, weight, key_heads, key_dim, value_heads, value_dim, interleaved)


@_fused_op.register_fake
def _(inputs, window, weight, key_heads, key_dim, value_heads, value_dim, interleaved):
    count = inputs.shape[0]
    q = inputs.new_empty((count, value_heads, key_dim), dtype=torch.float32)
    return q, torch.empty_like(q), inputs.new_empty((count, value_heads, value_dim), dtype=torch.float32)


@functools.cache
def _triton_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """The launcher, or None where Triton is not importable."""
    try:
        from ds4desk.engine.kernels.qwen3_5.causal_conv_triton import conv_heads_kernel as kernel
    except Exception:
        return None

    def launch(
        inputs: torch.Tensor,
        window: torch.Tensor,
        weight: torch.Tensor,
        key_heads: int,
        key_dim: int,
        value_heads: int,
        value_dim: int,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, taps = inputs.shape[0], weight.shape[1]
        # Rows of contiguous channels (a row stride is fine); the window and weight are tiny.
        inputs = inputs if inputs.stride(1) == 1 else inputs.contiguous()
        window = window if taps == 1 or window.stride(1) == 1 else window.contiguous()
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        q = torch.empty((rows, value_heads, key_dim), dtype=torch.float32, device=inputs.device)
        k = torch.empty_like(q)
        v = torch.empty((rows, value_heads, value_dim), dtype=torch.float32, device=inputs.device)
        if rows:
            grid = (-(-rows // BLOCK_T), value_heads)
            kernel[grid](
                inputs, window, weight, q, k, v, rows,
                inputs.stride(0), window.stride(0), weight.stride(0), key_dim**-0.5, NORM_EPS,
                KEY_HEADS=key_heads, HEADS=value_heads, DK=key_dim, DV=value_dim,
                BLOCK_DK=next_power_of_two(key_dim), BLOCK_DV=next_power_of_two(value_dim),
                K=taps, INTERLEAVED=interleaved, BLOCK_T=BLOCK_T, num_warps=4,
            )  # fmt: skip
        return q, k, v

    return on_its_device(launch)
