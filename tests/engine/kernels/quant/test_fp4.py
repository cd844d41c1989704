"""quant/fp4.py: products on packed FP4 experts equal the same products on the weights dequantized by
the loader's reference math (loading/quantized.py): the torch forms on the CPU, the Triton kernels
under Triton's interpreter (or on a GPU), and CUDA graph replays on a GPU."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.formats import E2M1_VALUES
from ds4desk.engine.kernels.quant import fp4
from ds4desk.engine.kernels.quant.fp4 import fp4_dequantize, fp4_experts_gemv, fp4_grouped_matmul
from tests.engine.kernels.quant.samples import (
    fp4_experts,
    grouped_reference,
    needs_nvidia_gpu,
    rel_error,
    swiglu,
)
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check

# --- the torch forms (CPU) -------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("shared", [True, False])
def test_fp4_experts_gemv_on_the_cpu_equals_the_reference(slots: int, shared: bool) -> None:
    packed, scale, reference = fp4_experts(5, 48, 128, seed=slots)
    experts = torch.tensor([3, 1, 3, 0, 4, 4][:slots])
    x = torch.randn(1 if shared else slots, 128, generator=torch.Generator().manual_seed(slots))
    out = fp4_experts_gemv(x, experts, packed, scale)
    want = torch.stack([x[0 if shared else s] @ reference[experts[s]].t() for s in range(slots)])
    assert out.shape == (slots, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    outb = fp4_experts_gemv(x.to(torch.bfloat16), experts, packed, scale)
    assert outb.dtype == torch.bfloat16
    assert rel_error(outb, want) < 1e-2


def test_fp4_experts_gemv_takes_the_swiglu_of_gate_up_rows_on_the_cpu() -> None:
    packed, scale, reference = fp4_experts(5, 48, 128, seed=9)
    experts = torch.tensor([3, 1, 4])
    gate_up = 3 * torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    out = fp4_experts_gemv(gate_up, experts, packed, scale, swiglu_limit=2.0)
    act = swiglu(gate_up, 2.0)
    want = torch.stack([act[s] @ reference[experts[s]].t() for s in range(3)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # The limit mattered: some gates and ups lie beyond it.
    assert (gate_up.abs() > 2.0).any()
    with pytest.raises(ValueError, match="x must be"):
        fp4_experts_gemv(gate_up[:, :128], experts, packed, scale, swiglu_limit=2.0)


def test_fp4_experts_gemv_rejects_mismatched_inputs() -> None:
    packed, scale, _ = fp4_experts(2, 16, 64, seed=0)
    with pytest.raises(ValueError, match="x must be"):
        fp4_experts_gemv(torch.randn(3, 64), torch.tensor([0, 1]), packed, scale)
    with pytest.raises(ValueError, match="scales"):
        fp4_experts_gemv(torch.randn(1, 64), torch.tensor([0]), packed, scale[:, :, :1])
    with pytest.raises(ValueError, match="int64"):
        fp4_experts_gemv(torch.randn(1, 64), torch.tensor([0.0]), packed, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_dequantize_on_the_cpu_is_exact(dtype: torch.dtype) -> None:
    packed, scale, reference = fp4_experts(2, 40, 96, seed=7)
    got = fp4_dequantize(packed[1], scale[1], dtype)
    assert got.dtype == dtype and got.shape == (40, 96)
    # e2m1 values times powers of two have at most 2 significant bits: exact in bfloat16 too.
    torch.testing.assert_close(got.float(), reference[1], rtol=0, atol=0)
    # Every nibble occurs, so every table entry and both nibble positions were checked.
    nibbles = torch.cat([packed & 0xF, packed >> 4]).unique()
    assert nibbles.numel() == 16 and len(E2M1_VALUES) == 8


@pytest.mark.parametrize("sizes", [[70, 0, 3, 65], [0, 0, 0, 5], [1, 1, 1, 1]])
def test_fp4_grouped_matmul_on_the_cpu_equals_the_reference(sizes: list[int]) -> None:
    packed, scale, reference = fp4_experts(4, 48, 128, seed=len(sizes))
    x = torch.randn(sum(sizes), 128, generator=torch.Generator().manual_seed(5))
    want = grouped_reference(x, sizes, reference)
    out = fp4_grouped_matmul(x, sizes, packed, scale)
    assert out.shape == (sum(sizes), 48)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert rel_error(fp4_grouped_matmul(x.to(torch.bfloat16), sizes, packed, scale), want) < 1e-2
    with pytest.raises(ValueError, match="group_sizes"):
        fp4_grouped_matmul(x, [*sizes[:-1], sizes[-1] + 1], packed, scale)
    with pytest.raises(ValueError, match="group_sizes"):
        fp4_grouped_matmul(x, sizes[:-1], packed, scale)


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 512, 4096), (1, 1024, 4096), (1, 4096, 4096), (1, 32768, 1024), (8, 4096, 2048)]
)
def test_the_gemv_launch_settings_fill_an_h200(m: int, n: int, k: int) -> None:
    block_n, block_k, _, _ = fp4.fp4_config(6, n, k, sms=132)
    assert 6 * (n // block_n) >= 132 and k % block_k == 0


def test_the_cpu_runs_the_torch_forms_by_default() -> None:
    assert fp4.SWITCH.forced is None and not fp4.enabled(torch.zeros(1))
    packed, pscale, _ = fp4_experts(2, 32, 64, seed=1)
    seen = OpNames()
    with torch.inference_mode(), seen:
        fp4_experts_gemv(torch.randn(1, 64), torch.tensor([1]), packed, pscale)
        fp4_dequantize(packed[0], pscale[0], torch.float32)
    assert not {"fp4_experts_gemv", "fp4_dequantize"} & set(seen.names)
    assert "bmm" in seen.names


# --- the Triton kernels: on a GPU, or under Triton's interpreter --------------------------------------

_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.quant import fp4
from tests.engine.kernels.quant.samples import fp4_experts, grouped_reference, rel_error, swiglu
from tests.engine.op_names import OpNames

fp4.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
packed, pscale, reference = (t.to(device) for t in fp4_experts(5, 96, 256, seed=1))
for shared, dtype in [(s, d) for s in (False, True) for d in (torch.float32, torch.bfloat16)]:
    experts = torch.tensor([3, 1, 3, 0, 4, 4], device=device)
    x = torch.randn(1 if shared else 6, 256, generator=gen).to(device, dtype)
    seen = OpNames()
    with seen:
        out = fp4.fp4_experts_gemv(x, experts, packed, pscale)
    assert "fp4_experts_gemv" in seen.names and "bmm" not in seen.names, seen.names
    want = torch.stack([x[0 if shared else s].float() @ reference[experts[s]].t() for s in range(6)])
    err = rel_error(out, want)
    assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 8e-3), (shared, dtype, err)
# The fused form of the batch-1 MoE's routed experts: the down projection reading each slot's
# SiLU(gate) · up.
packed, pscale, preference = (t.to(device) for t in fp4_experts(5, 96, 256, seed=4))
experts = torch.tensor([3, 1, 3, 0, 4, 4], device=device)
for dtype in (torch.float32, torch.bfloat16):
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    gate_ups = (3 * torch.randn(6, 512, generator=gen)).to(device, dtype)
    out = fp4.fp4_experts_gemv(gate_ups, experts, packed, pscale, swiglu_limit=2.0)
    act = swiglu(gate_ups, 2.0)
    want = torch.stack([act[s] @ preference[experts[s]].t() for s in range(6)])
    assert rel_error(out, want) < tol, (dtype, rel_error(out, want))

packed, pscale, reference = (t.to(device) for t in fp4_experts(2, 32, 64, seed=2))
one = torch.tensor([1], device=device)
out = fp4.fp4_experts_gemv(torch.ones(1, 64, device=device), one, packed, pscale)
assert rel_error(out, reference[1].sum(-1, keepdim=True).t()) < 1e-6  # BLOCK_K 64
for dtype in (torch.float32, torch.bfloat16):
    for n, k in ((96, 256), (40, 192)):
        packed, pscale, reference = (t.to(device) for t in fp4_experts(2, n, k, seed=k))
        seen = OpNames()
        with seen:
            got = fp4.fp4_dequantize(packed[1], pscale[1], dtype)
        assert "fp4_dequantize" in seen.names, seen.names
        assert got.dtype == dtype and torch.equal(got.float(), reference[1]), (n, k, dtype)

# Prefill through the experts: the grouped kernel (partial row tiles, an empty group).
packed, pscale, reference = (t.to(device) for t in fp4_experts(4, 128, 128, seed=3))
sizes = [70, 0, 3, 65]
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(sum(sizes), 128, generator=gen).to(device, dtype)
    out = fp4._grouped_triton(x, sizes, packed, pscale)
    err = rel_error(out, grouped_reference(x, sizes, reference))
    assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 8e-3), (dtype, err)
print("triton ok")
"""


def test_the_triton_kernels_equal_the_reference() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter (the same kernel source, run by
    numpy). Skipped where Triton is not installed."""
    stdout = run_triton_check(_TRITON_CHECK)
    assert "triton ok" in stdout


# --- on an NVIDIA GPU (the lead runs these on the H200) ---------------------------------------------


@needs_nvidia_gpu
def test_the_gpu_experts_gemv_and_dequantize_equal_the_reference() -> None:
    packed, pscale, reference = (t.cuda() for t in fp4_experts(8, 1024, 2048, seed=3))
    experts = torch.tensor([5, 2, 5, 7, 0, 1], device="cuda")
    for shared in (True, False):
        x = torch.randn(1 if shared else 6, 2048, device="cuda", dtype=torch.bfloat16)
        out = fp4_experts_gemv(x, experts, packed, pscale)
        want = torch.stack([x[0 if shared else s].float() @ reference[experts[s]].t() for s in range(6)])
        assert rel_error(out, want) < 8e-3
    got = fp4_dequantize(packed[5], pscale[5], torch.bfloat16)
    assert torch.equal(got.float(), reference[5])


@needs_nvidia_gpu
def test_the_gpu_grouped_matmul_equals_the_reference() -> None:
    packed, pscale, reference = (t.cuda() for t in fp4_experts(8, 512, 1024, seed=5))
    sizes = [100, 0, 1, 64, 65, 30, 0, 40]
    x = torch.randn(sum(sizes), 1024, device="cuda", dtype=torch.bfloat16)
    out = fp4_grouped_matmul(x, sizes, packed, pscale)
    assert rel_error(out, grouped_reference(x, sizes, reference)) < 8e-3


@needs_nvidia_gpu
def test_cuda_graph_replays_equal_eager_runs() -> None:
    packed, pscale, _ = (t.cuda() for t in fp4_experts(8, 512, 1024, seed=4))
    h = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    experts = torch.tensor([1, 6, 1, 3, 0, 7], device="cuda")
    fp4_experts_gemv(h, experts, packed, pscale)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp4_experts_gemv(h, experts, packed, pscale)
    h.normal_()
    experts.copy_(torch.tensor([7, 7, 2, 5, 4, 0], device="cuda"))  # read inside the kernel at replay
    graph.replay()
    torch.testing.assert_close(captured, fp4_experts_gemv(h, experts, packed, pscale), rtol=0, atol=0)
