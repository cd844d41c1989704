"""DeepSeek-V4's hyper-connection weights (v4_hc_kernel): the eager form with its two-kernel Sinkhorn
steps, the custom op, and the Triton kernel (on CUDA, or Triton's CPU interpreter where Triton is
installed) all equal the spelled-out math of the paper's hyper-connection definition."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import hc_kernel as v4_hc_kernel
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check

M, ITERS, EPS = 4, 20, 1e-6


def spelled_out(
    z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, literally: pre = σ + eps, post = 2σ, C = softmax + eps, Sinkhorn columns first."""
    m = M
    z = torch.cat([z[:, :m] * scale[0], z[:, m : 2 * m] * scale[1], z[:, 2 * m :] * scale[2]], dim=1) + base
    pre = torch.sigmoid(z[:, :m]) + EPS
    post = 2 * torch.sigmoid(z[:, m : 2 * m])
    comb = torch.softmax(z[:, 2 * m :].view(-1, m, m), dim=-1) + EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    return torch.cat([pre, post], dim=1), comb


def inputs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(count, (2 + M) * M, generator=gen)
    return z, 0.5 + torch.rand(3, generator=gen), torch.randn((2 + M) * M, generator=gen)


@pytest.mark.parametrize("count", [1, 7, 40])
def test_the_eager_form_equals_the_spelled_out_math(count: int) -> None:
    z, scale, base = inputs(count, seed=count)
    gates, comb = v4_hc_kernel.reference(z, scale, base, M, ITERS, EPS)
    ref_gates, ref_comb = spelled_out(z, scale, base)
    assert gates.shape == (count, 2 * M) and comb.shape == (count, M, M)
    torch.testing.assert_close(gates, ref_gates, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
    # Doubly stochastic (to Sinkhorn's eps), and not the identity nor uniform: the inputs mattered.
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(count, M), rtol=1e-4, atol=1e-4)
    assert comb.std() > 0.01


def test_the_custom_op_is_one_op_with_the_same_result() -> None:
    z, scale, base = inputs(5, seed=1)
    expected = v4_hc_kernel.reference(z, scale, base, M, ITERS, EPS)
    seen = OpNames()
    with v4_hc_kernel.SWITCH.force(True), torch.inference_mode(), seen:
        gates, comb = v4_hc_kernel.hc_weights(z, scale, base, M, ITERS, EPS)
    assert seen.names == ["v4_hc_weights"]  # what a graph capture or an op counter sees
    torch.testing.assert_close(gates, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(comb, expected[1], rtol=0, atol=0)
    assert comb.is_contiguous()


def test_the_cpu_runs_the_eager_form_by_default() -> None:
    z, scale, base = inputs(3, seed=2)
    assert v4_hc_kernel.SWITCH.forced is None and not v4_hc_kernel.enabled(z, M)
    seen = OpNames()
    with torch.inference_mode(), seen:
        _, comb = v4_hc_kernel.hc_weights(z, scale, base, M, ITERS, EPS)
    assert "v4_hc_weights" not in seen.names and seen.names.count("div_") == 2 * ITERS - 1
    torch.testing.assert_close(comb, spelled_out(z, scale, base)[1], rtol=1e-5, atol=1e-6)


_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import hc_kernel as v4_hc_kernel
from tests.engine.kernels.deepseek_v4.test_hc_kernel import EPS, ITERS, M, inputs, spelled_out

kernel = v4_hc_kernel._triton_kernel()
assert kernel is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
for count in (1, 5, 37):  # 37: three blocks of 16, the last one partial
    z, scale, base = (t.to(device) for t in inputs(count, seed=count))
    gates, comb = kernel(z, scale, base, M, ITERS, EPS)
    ref_gates, ref_comb = spelled_out(z, scale, base)
    torch.testing.assert_close(gates, ref_gates, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
print("triton ok")
"""


def test_the_triton_kernel_equals_the_spelled_out_math() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter (the same kernel source, run by
    numpy). Skipped where Triton is not installed."""
    stdout = run_triton_check(_TRITON_CHECK)
    assert "triton ok" in stdout
