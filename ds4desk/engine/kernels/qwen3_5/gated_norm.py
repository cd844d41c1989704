"""Qwen3.5's gated RMSNorm (the linear-attention output norm) as one op: `gated_rms_norm`.

Per head the delta rule's output x is rounded to the model's dtype, RMS-normed (float32), rounded,
scaled by the (uncentred) weight, then multiplied by silu(z) in float32 and rounded once more.
Eagerly (models/qwen3_5/ops.gated_rms_norm) that is eight elementwise passes over [tokens, heads,
dv]: for a 4k-token prefill of Qwen3.5-9B's shapes, 16M values a pass, every linear layer. On NVIDIA
GPUs with Triton it is one kernel that reads x and z once and writes the result once (a program per
block of rows). The decode step has its own fused copy of this norm (linear_decode.py); this one
serves a prefill's many rows. Elsewhere `reference` runs, the eager math.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device

SWITCH = Switch(
    "qwen3_5.gated_norm",
    "Qwen3.5's gated RMSNorm of the linear-attention output (prefill rows) as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)


def enabled(where: Where) -> bool:
    """Whether the model should call `gated_rms_norm` for tensors on `where`."""
    return SWITCH.on(where)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] (any float dtype: float32 for the delta rule's output), gate [..., d] of the same
    shape in the model's dtype, weight [d]: RMSNorm(x rounded to gate's dtype) * weight * silu(gate),
    a new tensor in gate's dtype. Always the custom op (see `enabled`)."""
    if x.shape != gate.shape or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must match, weight [{x.shape[-1]}]"
        )
    return _fused_op(x, gate, weight, eps)


def reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models/qwen3_5/ops.gated_rms_norm of x rounded to gate's dtype, op for op."""
    dtype = gate.dtype
    normed = F.rms_norm(x.to(dtype).float(), (x.shape[-1],), None, eps).to(dtype) * weight
    return (normed.float() * F.silu(gate.float())).to(dtype)


@torch.library.custom_op("ds4desk::qwen35_gated_norm", mutates_args=())
def _fused_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(x) else None
    run = reference if kernel is None else kernel
    return run(x, gate, weight, eps)


@_fused_op.register_fake
def _(x, gate, weight, eps):
    return gate.new_empty(gate.shape)


def launch_constants(rows: int, width: int) -> dict[str, Any]:
    block_d = next_power_of_two(width)
    # About 4096 values a program: 32 rows of a 128-wide head.
    block_r = max(1, min(next_power_of_two(rows), 4096 // block_d))
    return {"D": width, "BLOCK_D": block_d, "BLOCK_R": block_r}


@functools.cache
def _jit_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit(do_not_specialize=["rows"])
    def kernel(
        x,  # [R, D]
        gate,  # [R, D]
        weight,  # [D]
        out,  # [R, D], gate's dtype
        rows,
        eps,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        inside = (r < rows)[:, None] & (d < D)[None, :]
        at = r[:, None] * D + d[None, :]
        dtype = out.dtype.element_ty
        v = tl.load(x + at, mask=inside, other=0.0).to(dtype).to(tl.float32)
        inv = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        w = tl.load(weight + d, mask=d < D, other=0.0).to(tl.float32)
        # Rounded where the eager form rounds; the arithmetic in float32 (Triton's interpreter has no
        # bf16 arithmetic).
        normed = ((v * inv[:, None]).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        g = tl.load(gate + at, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + at, (normed * (g / (1.0 + tl.exp(-g)))).to(dtype), mask=inside)

    return kernel


def norm_kernel() -> Callable[..., torch.Tensor]:
    """The launcher, for another launcher of this package (linear_decode.py) that knows Triton is there."""
    launch = _triton_kernel()
    assert launch is not None
    return launch


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    kernel = _jit_kernel()
    if kernel is None:
        return None

    def launch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        flat_x, flat_gate = x.reshape(-1, width).contiguous(), gate.reshape(-1, width).contiguous()
        rows = flat_x.shape[0]
        out = torch.empty_like(flat_gate)
        if rows:
            constants = launch_constants(rows, width)
            grid = (-(-rows // constants["BLOCK_R"]),)
            kernel[grid](flat_x, flat_gate, weight, out, rows, eps, **constants, num_warps=4)
        return out.view(gate.shape)

    return on_its_device(launch)
