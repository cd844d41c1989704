"""The input stage of Qwen3.5's linear-attention layer over a prompt's rows as one op: `conv_heads`.

A linear-attention layer convolves its q/k/v channels with `kernel` taps each, continuing from the
window it kept (the last kernel - 1 inputs before this chunk), and takes silu; the delta rule then
reads per key head the query and key, each scaled to unit length (the query also by dk^-1/2), and
per value head the value, in float32. Eagerly (models/qwen3_5/linear_attention.py: `_convolve`
and `_heads`) that is the inputs transposed behind the window ([C, kept + T], a copy), F.conv1d, silu,
a transposed copy, a float32 copy and norm of each of q and k and a float32 copy of v: at
Qwen3.5-9B's shapes on an H200 the convolution alone took 3.6 ms of a 4k-token prefill's 38.4 ms
(bench/results/qwen35_prefill_profile_20261205T0538Z.txt), and the steps after it most of the ~5 ms
of elementwise kernels and copies there.

On NVIDIA GPUs with Triton it is one kernel (causal_conv_triton.py), a program per block of rows
and key head: it reads the inputs [T, C] where they are (the window for the first kernel - 1 rows),
sums the taps in float32, rounds where the eager ops round (the convolution's output and silu's, in
the model's dtype), and writes the three float32 tensors once. q and k stay per key head (the delta
rule's kernels index a value head's key head; repeating them to the value heads would write and
read twice the bytes where there are twice as many value heads). The window's update (a [C,
kernel - 1] copy) stays with the caller, after the op: the op's programs read the old window.
Elsewhere `reference` runs, the eager math op for op.
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

# A program's rows: 8 at 4 warps ran Qwen3.5-9B's 4,096 rows in 172 µs on an H100, against 214 µs
# at 16 and 193-828 µs at the other sizes and warps swept (16 or 32 rows at 2 or 8 warps, 64 at any).
BLOCK_T = 8


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs [T, C] after window [C, K - 1], weight [C, K] (tap K - 1 on the current row), C =
    2 key_heads key_dim + value_heads value_dim: (q, k [T, key_heads, key_dim], v [T, value_heads,
    value_dim]), float32. The window is read, not updated. Always the custom op (see `enabled`)."""
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
    return _fused_op(inputs, window, weight, key_heads, key_dim, value_heads, value_dim)


def reference(
    inputs: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    key_heads: int,
    key_dim: int,
    value_heads: int,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_attention's `_convolve` (more than one row), then `per_key_head`, op for op."""
    extended = torch.cat((window, inputs.t()), dim=1)  # [C, kept + T]
    out = F.conv1d(extended[None], weight[:, None, :], groups=extended.shape[0])[0]
    mixed = F.silu(out).t().contiguous()
    return per_key_head(mixed, key_heads, key_dim, value_heads, value_dim)


def per_key_head(
    mixed: torch.Tensor, key_heads: int, key_dim: int, value_heads: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved channels [T, C] as the delta rule reads them, float32: per key head the query and
    key, scaled to unit length (the query also by dk^-1/2), and per value head the value."""
    count = mixed.shape[0]
    key_width = key_heads * key_dim
    q, k, v = mixed.split([key_width, key_width, value_heads * value_dim], dim=1)
    q = unit_rows(q.view(count, key_heads, key_dim)) * key_dim**-0.5
    k = unit_rows(k.view(count, key_heads, key_dim))
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(inputs) else None
    run = reference if kernel is None else kernel
    return run(inputs, window, weight, key_heads, key_dim, value_heads, value_dim)


@_fused_op.register_fake
def _(inputs, window, weight, key_heads, key_dim, value_heads, value_dim):
    count = inputs.shape[0]
    q = inputs.new_empty((count, key_heads, key_dim), dtype=torch.float32)
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, taps = inputs.shape[0], weight.shape[1]
        # Rows of contiguous channels (a row stride is fine); the window and weight are tiny.
        inputs = inputs if inputs.stride(1) == 1 else inputs.contiguous()
        window = window if taps == 1 or window.stride(1) == 1 else window.contiguous()
        weight = weight if weight.stride(1) == 1 else weight.contiguous()
        q = torch.empty((rows, key_heads, key_dim), dtype=torch.float32, device=inputs.device)
        k = torch.empty_like(q)
        v = torch.empty((rows, value_heads, value_dim), dtype=torch.float32, device=inputs.device)
        if rows:
            grid = (-(-rows // BLOCK_T), key_heads)
            kernel[grid](
                inputs, window, weight, q, k, v, rows,
                inputs.stride(0), window.stride(0), weight.stride(0), key_dim**-0.5, NORM_EPS,
                KEY_HEADS=key_heads, HEADS=value_heads, DK=key_dim, DV=value_dim,
                BLOCK_DK=next_power_of_two(key_dim), BLOCK_DV=next_power_of_two(value_dim),
                K=taps, BLOCK_T=BLOCK_T, num_warps=4,
            )  # fmt: skip
        return q, k, v

    return on_its_device(launch)
