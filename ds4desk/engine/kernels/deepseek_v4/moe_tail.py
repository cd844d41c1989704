"""DeepSeek-V4's clamped SwiGLU and the routed experts' weighted sum as one kernel each: `swiglu`
and `combine`.

Eagerly the clamped SwiGLU is four elementwise kernels (two clamps over strided halves, SiLU, the
product), and a few-row MoE that runs every expert (models/deepseek_v4/piece.py) combines their
outputs with a float copy, a batched product, a cast and the add of the shared expert. Inside a
verify step's graph each of those costs its launch, 1.5-3.5 µs on an H200 at 5 rows, whatever it
does. On NVIDIA GPUs with Triton each op is one kernel that rounds where the torch ops round;
elsewhere the torch forms run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, nvidia, on_its_device

SWITCH = Switch(
    "deepseek_v4.moe_tail",
    "V4's clamped SwiGLU and a few-row MoE's weighted sum of experts as one kernel each",
    lambda where: nvidia(where) and _kernels() is not None,
)

_BLOCK = 1024


def reference_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, ±limit), in the inputs' dtype."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def reference_combine(mixing: torch.Tensor, ys: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Σ_e mixing[t, e] ys[e, t] in float32, cast to ys' dtype, plus the shared expert's [T, D]."""
    return torch.einsum("te,etd->td", mixing, ys.float()).to(ys.dtype) + shared


def enabled(where: Where) -> bool:
    """Whether the ops run their kernels for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """See reference_swiglu: gate and up of one shape [..., W], each rows of W with one row stride
    (contiguous tensors or the two halves of one); the torch form for any other layout."""
    kernels = _kernels() if enabled(gate) else None
    if kernels is None or gate.shape != up.shape:
        return reference_swiglu(gate, up, limit)
    width = gate.shape[-1]
    try:  # rows of a uniform stride: no copy (a view fails where there is none)
        gate_rows, up_rows = gate.view(-1, width), up.view(-1, width)
    except RuntimeError:
        return reference_swiglu(gate, up, limit)
    if gate_rows.stride(1) != 1 or up_rows.stride(1) != 1:
        return reference_swiglu(gate, up, limit)
    return kernels.swiglu(gate_rows, up_rows, float(limit)).view(gate.shape)


def combine(mixing: torch.Tensor, ys: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """See reference_combine: mixing float32 [T, E], ys [E, T, D], shared [T, D] in ys' dtype."""
    experts, count, dim = ys.shape
    if mixing.shape != (count, experts) or shared.shape != (count, dim):
        raise ValueError(
            f"combine takes mixing [T, E], ys [E, T, D] and shared [T, D]; got {tuple(mixing.shape)}, "
            f"{tuple(ys.shape)} and {tuple(shared.shape)}"
        )
    kernels = _kernels() if enabled(ys) else None
    if kernels is None:
        return reference_combine(mixing, ys, shared)
    return kernels.combine(mixing.float().contiguous(), ys.contiguous(), shared.contiguous())


@dataclass(frozen=True, slots=True)
class _Kernels:
    swiglu: Any
    combine: Any


@functools.cache
def _kernels() -> _Kernels | None:
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the torch forms run
        return None

    @triton.jit
    def swiglu_kernel(gate, up, out, W, gate_stride, up_stride, limit, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < W
        g = tl.load(gate + t * gate_stride + c, mask=live, other=0.0).to(tl.float32)
        u = tl.load(up + t * up_stride + c, mask=live, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        act = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)  # SiLU's rounding
        tl.store(out + t * W + c, (act * u).to(out.dtype.element_ty), mask=live)

    @triton.jit
    def combine_kernel(mixing, ys, shared, out, T, D, E: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = d < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for e in range(E):
            weight = tl.load(mixing + t * E + e)
            acc += weight * tl.load(ys + (e * T + t) * D + d, mask=live, other=0.0).to(tl.float32)
        routed = acc.to(out.dtype.element_ty).to(tl.float32)  # the einsum's cast, then the add's
        s = tl.load(shared + t * D + d, mask=live, other=0.0).to(tl.float32)
        tl.store(out + t * D + d, (routed + s).to(out.dtype.element_ty), mask=live)

    def launch_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        rows, width = gate.shape
        out = gate.new_empty((rows, width))
        if rows:
            grid = (rows, triton.cdiv(width, _BLOCK))
            swiglu_kernel[grid](gate, up, out, width, gate.stride(0), up.stride(0), limit, BLOCK=_BLOCK)
        return out

    def launch_combine(mixing: torch.Tensor, ys: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        experts, count, dim = ys.shape
        out = shared.new_empty((count, dim))
        if count:
            grid = (count, triton.cdiv(dim, _BLOCK))
            combine_kernel[grid](mixing, ys, shared, out, count, dim, E=experts, BLOCK=_BLOCK)
        return out

    return _Kernels(on_its_device(launch_swiglu), on_its_device(launch_combine))
