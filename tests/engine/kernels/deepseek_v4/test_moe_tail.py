"""V4's clamped SwiGLU and a few-row MoE's weighted sum of experts (kernels/deepseek_v4/moe_tail.py):
the torch forms, the layouts and shapes each op takes, and the Triton kernels (on CUDA, or Triton's
CPU interpreter) against the torch forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.deepseek_v4 import moe_tail
from tests.engine.triton_check import run_triton_check


def test_the_references_clamp_then_gate_and_sum_in_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up = 20 * torch.randn(4, 6, generator=gen), 20 * torch.randn(4, 6, generator=gen)
    want = F.silu(torch.minimum(gate, torch.tensor(7.0))) * up.clamp(-7.0, 7.0)
    assert torch.equal(moe_tail.reference_swiglu(gate, up, 7.0), want)
    mixing, ys = torch.rand(3, 5, generator=gen), torch.randn(5, 3, 8, generator=gen).to(torch.bfloat16)
    shared = torch.randn(3, 8, generator=gen).to(torch.bfloat16)
    routed = (mixing[:, :, None] * ys.float().transpose(0, 1)).sum(1).to(torch.bfloat16)
    torch.testing.assert_close(moe_tail.reference_combine(mixing, ys, shared), routed + shared)


def test_the_cpu_takes_the_torch_forms_by_default() -> None:
    gate_up = torch.randn(2, 3, 8)
    assert moe_tail.SWITCH.forced is None and not moe_tail.enabled(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(moe_tail.swiglu(gate, up, 1.5), moe_tail.reference_swiglu(gate, up, 1.5))


def test_combine_refuses_shapes_that_do_not_match() -> None:
    with pytest.raises(ValueError, match="mixing"):
        moe_tail.combine(torch.zeros(3, 4), torch.zeros(5, 3, 8), torch.zeros(3, 8))


_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import moe_tail

device = "cuda" if torch.cuda.is_available() else "cpu"
moe_tail.SWITCH.forced = True
gen = torch.Generator().manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    # float32: the kernel's exp is not torch's; bf16: a rounding step apart at most (Triton's
    # interpreter rounds its bf16 casts differently from the GPU).
    tol = 1e-6 if dtype == torch.float32 else 2.0**-6
    # The halves of [E, T, 2W] (one row stride), two contiguous tensors, W over a block (1500).
    gate_up = (8 * torch.randn(3, 5, 2 * 1500, generator=gen)).to(dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    ours = moe_tail.swiglu(gate, up, 7.0)
    assert ours.shape == (3, 5, 1500) and ours.dtype == dtype
    torch.testing.assert_close(ours, moe_tail.reference_swiglu(gate, up, 7.0), rtol=tol, atol=1e-6)
    gate, up = gate.contiguous()[0], up.contiguous()[0]
    torch.testing.assert_close(
        moe_tail.swiglu(gate, up, 7.0), moe_tail.reference_swiglu(gate, up, 7.0), rtol=tol, atol=1e-6
    )
    # Every expert's rows weighed (zeros among them), D over a block (1300).
    mixing = torch.rand(5, 8, generator=gen) * (torch.rand(5, 8, generator=gen) < 0.7)
    ys = torch.randn(8, 5, 1300, generator=gen).to(dtype).to(device)
    shared = torch.randn(5, 1300, generator=gen).to(dtype).to(device)
    mixing = mixing.to(device)
    ours, want = moe_tail.combine(mixing, ys, shared), moe_tail.reference_combine(mixing, ys, shared)
    assert ours.shape == (5, 1300) and ours.dtype == dtype
    # The sum cancels to near zero in places: bf16 is held to a rounding step of the largest value.
    atol = 1e-5 if dtype == torch.float32 else tol * float(want.abs().max())
    torch.testing.assert_close(ours, want, rtol=tol, atol=atol)
print("moe tail ok")
"""


def test_the_triton_kernels_equal_the_torch_forms() -> None:
    assert "moe tail ok" in run_triton_check(_CHECK)
