"""The dense prefill's fused SiLU · up (silu_mul): the torch form, a clear error for a bad shape, the
Triton kernel (on CUDA, or Triton's CPU interpreter) against it, and a prefill through the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.dense import silu_mul
from tests.engine.triton_check import run_triton_check


def test_the_reference_is_silu_of_the_gate_times_up() -> None:
    gate_up = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = (F.silu(gate_up[:, :6].float()).to(torch.bfloat16).float() * gate_up[:, 6:].float()).to(
        torch.bfloat16
    )
    assert torch.equal(silu_mul.reference(gate_up), want)


def test_the_cpu_takes_the_torch_form_by_default() -> None:
    gate_up = torch.randn(3, 8)
    assert silu_mul.SWITCH.forced is None and not silu_mul.enabled(gate_up)
    assert torch.equal(silu_mul.silu_mul(gate_up), silu_mul.reference(gate_up))


@pytest.mark.parametrize("shape", [(4, 7), (8,), (2, 3, 4)])
def test_a_bad_shape_gets_a_clear_error(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul.silu_mul(torch.zeros(shape))


_CHECK = """
import torch
from ds4desk.engine.kernels.dense import silu_mul

device = "cuda" if torch.cuda.is_available() else "cpu"
silu_mul.SWITCH.forced = True
gen = torch.Generator().manual_seed(1)
# 2 x 1500: a partial block (W = 1500 over blocks of 1024); 70 x 64; a strided row view.
for dtype in (torch.float32, torch.bfloat16):
    for rows, width in ((2, 1500), (70, 64)):
        gate_up = (4 * torch.randn(rows, 2 * width, generator=gen)).to(dtype).to(device)
        ours, want = silu_mul.silu_mul(gate_up), silu_mul.reference(gate_up)
        assert ours.dtype == dtype and ours.shape == (rows, width)
        # float32: the kernel's exp is not torch's. bf16: two rounding steps apart at most (on the
        # GPU both round to nearest; Triton's interpreter rounds its bf16 casts differently).
        tol = 1e-6 if dtype == torch.float32 else 2.0**-6
        torch.testing.assert_close(ours, want, rtol=tol, atol=1e-6)
    wide = torch.randn(6, 40, generator=gen).to(dtype).to(device)
    half = wide[:, :20]
    torch.testing.assert_close(silu_mul.silu_mul(half), silu_mul.reference(half), rtol=tol, atol=1e-6)
print("silu ok")
"""


def test_the_triton_kernel_equals_the_torch_form() -> None:
    assert "silu ok" in run_triton_check(_CHECK)


def test_a_dense_prefill_through_the_kernel_equals_the_torch_form(tmp_path) -> None:
    script = f"""
import pathlib, torch
from ds4desk.engine.kernels.dense import silu_mul
from ds4desk.engine.loader import load_model
from tests.engine.tiny_dense import save_tiny, source_from_folder

folder = pathlib.Path({str(tmp_path)!r})
save_tiny("llama", folder, seed=2)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
outs = []
for fused in (False, True):
    with silu_mul.SWITCH.force(fused):
        model = load_model(source_from_folder(folder), device, torch.float32).model
        model.allocate_cache(64)
        with torch.inference_mode():
            outs.append(model.forward(torch.arange(3, 40, device=device), 0, "all"))
torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
print("prefill ok")
"""
    assert "prefill ok" in run_triton_check(script)
