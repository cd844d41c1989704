"""RMSNorm of a prefill chunk's rows with a float32 scale, as one kernel: `scaled_rms_norm`.

Qwen3.5 stores its norm weights centred on 0 and normalises in float32: the rows cast to float32,
F.rms_norm, times 1 + w, cast back. Eagerly that is four passes over the chunk (two of them
over a float32 copy): at Qwen3.5-9B's width and a 4k prompt, the bulk of a prefill's elementwise
time after its convolution (bench/results/qwen35_prefill_profile_*). On NVIDIA GPUs with Triton one
kernel reads each row once and writes it normed in its dtype, with the same float32 math and one
rounding at the end. Rows may lie apart by any stride (a head's query inside a query-and-gate row).
Elsewhere the torch form runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device

# Default: the kernel where it can run (NVIDIA CUDA tensors, Triton importable). Forced on, the kernel
# runs whatever the device (the tests, on Triton's interpreter); there is no custom op around it.
SWITCH = Switch(
    "dense.norm_rows",
    "a prefill chunk's RMSNorm with a float32 scale as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

_MAX_WIDTH = 16384  # a row is one tile: wider rows take the torch form


def reference(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch form: (F.rms_norm(x in float32) * scale).to(x.dtype), x [..., D], scale float32 [D]."""
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * scale).to(x.dtype)


def enabled(where: Where) -> bool:
    """Whether scaled_rms_norm runs the kernel for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def scaled_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """See `reference`; one kernel where it can be (see SWITCH) for rows [N, D] whose last dimension
    is contiguous. Returns a fresh contiguous [N, D] tensor in x's dtype."""
    if x.dim() != 2 or scale.shape != (x.shape[1],):
        raise ValueError(f"x must be [N, D] and scale [D], got {tuple(x.shape)} and {tuple(scale.shape)}")
    kernel = _triton_kernel() if enabled(x) and x.shape[1] <= _MAX_WIDTH else None
    if kernel is None:
        return reference(x, scale, eps)
    return kernel(x if x.stride(1) == 1 else x.contiguous(), scale.float().contiguous(), eps)


@functools.cache
def jit_kernel() -> Any:
    """The Triton kernel itself (the sm_90 compile test builds it ahead of time), None without Triton."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the torch form runs
        return None

    @triton.jit(do_not_specialize=["rows"])
    def kernel(x, scale, out, rows, in_stride, eps, D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """ROWS rows a program, each one tile of BLOCK >= D columns."""
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK)
        keep = (r < rows)[:, None] & (c < D)[None, :]
        v = tl.load(x + r[:, None] * in_stride + c[None, :], mask=keep, other=0.0).to(tl.float32)
        inverse = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        w = tl.load(scale + c, mask=c < D, other=0.0)
        tl.store(
            out + r[:, None] * D + c[None, :],
            (v * inverse[:, None] * w[None, :]).to(out.dtype.element_ty),
            mask=keep,
        )

    return kernel


def launch_constants(width: int) -> dict[str, int]:
    """A program's rows and warps for rows of `width`: about 4,096 values a program, a wide row alone,
    narrow ones (a head's 128-256) in groups."""
    block = next_power_of_two(width)
    per_program = max(1, min(64, 4096 // block))
    return {
        "D": width,
        "BLOCK": block,
        "ROWS": per_program,
        "num_warps": 8 if block * per_program >= 4096 else 4,
    }


@functools.cache
def _triton_kernel() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    kernel = jit_kernel()
    if kernel is None:
        return None

    def launch(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        rows, width = x.shape
        out = torch.empty((rows, width), device=x.device, dtype=x.dtype)
        if rows:
            constants = launch_constants(width)
            grid = (-(-rows // constants["ROWS"]),)
            kernel[grid](x, scale, out, rows, x.stride(0), eps, **constants)
        return out

    return on_its_device(launch)
