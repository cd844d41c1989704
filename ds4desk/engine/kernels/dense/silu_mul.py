"""SiLU(gate) · up of a prefill chunk's fused gate|up rows as one kernel: `silu_mul`.

The dense MLP's GEMM writes gate and up side by side ([T, 2W]); eagerly SiLU and the product are two
passes over strided halves (the generic, unvectorised elementwise kernels: ~160 µs a layer at
T = 4096, W = 8192 on an H200). On NVIDIA GPUs with Triton one kernel reads each row once and writes
the [T, W] activation, rounding as the two torch ops do (SiLU to the dtype, then the product).
Elsewhere the torch form runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, nvidia, on_its_device

# Default: the kernel where it can run (NVIDIA CUDA tensors, Triton importable). Forced on, the kernel
# runs whatever the device (the tests, on Triton's interpreter); there is no custom op around it.
SWITCH = Switch(
    "dense.silu_mul",
    "the dense prefill's SiLU(gate) · up as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

_BLOCK = 1024


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch form: [T, 2W] -> SiLU(gate_up[:, :W]) * gate_up[:, W:], [T, W] in its dtype."""
    width = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :width]).mul_(gate_up[:, width:])


def enabled(where: Where) -> bool:
    """Whether silu_mul runs the kernel for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See `reference`; one kernel where it can be (see SWITCH)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2W], got {tuple(gate_up.shape)}")
    kernel = _triton_kernel() if enabled(gate_up) else None
    return reference(gate_up) if kernel is None else kernel(gate_up.contiguous())


@functools.cache
def _triton_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the torch form runs
        return None

    @triton.jit
    def kernel(gate_up, out, W, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # tokens on axis 0: a chunk may exceed axis 1's 65,535
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < W
        g = tl.load(gate_up + t * 2 * W + c, mask=live, other=0.0).to(tl.float32)
        u = tl.load(gate_up + t * 2 * W + W + c, mask=live, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)  # SiLU's rounding
        tl.store(out + t * W + c, (act * u).to(out.dtype.element_ty), mask=live)

    def launch(gate_up: torch.Tensor) -> torch.Tensor:
        count, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((count, width))
        if count:
            kernel[(count, triton.cdiv(width, _BLOCK))](gate_up, out, width, BLOCK=_BLOCK, num_warps=4)
        return out

    return on_its_device(launch)
