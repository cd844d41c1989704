"""quant/fp8.py: products on FP8 block-128 weights equal the same products on the weights dequantized
by the loader's reference math (loading/quantized.py): the torch form on the CPU, the Triton kernels
under Triton's interpreter (or on a GPU), and on an H200 the _scaled_mm prefill path (to
activation-quantization tolerance) and CUDA graph replays."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.quant import fp8
from ds4desk.engine.kernels.quant.fp8 import fp8_dequantize, fp8_linear, quantize_activation
from tests.engine.kernels.quant.samples import fp8_weight, needs_nvidia_gpu, rel_error
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check

# --- the torch forms (CPU) -------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(200, 300), (256, 384), (96, 256)])
def test_fp8_linear_on_the_cpu_equals_the_reference(n: int, k: int) -> None:
    q, scale, reference = fp8_weight(n, k, seed=n + k)
    torch.testing.assert_close(fp8_dequantize(q, scale, torch.float32), reference, rtol=0, atol=0)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(1))
    out = fp8_linear(x, q, scale)
    assert out.shape == (2, 3, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ reference.t(), rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    # bfloat16 in, bfloat16 out: the weights are exact in bfloat16 (3 mantissa bits times a power of 2).
    xb = x.to(torch.bfloat16)
    outb = fp8_linear(xb, q, scale)
    assert outb.dtype == torch.bfloat16
    assert rel_error(outb, xb.float() @ reference.t()) < 1e-2


def test_whole_blocks_dequantize_to_the_bits_of_the_general_form() -> None:
    """fp8_dequantize's whole-block form (widen, then one float32 multiply rounded in place) gives
    the general form's bits, also for scales that are not powers of two (rounding after the product)."""
    q, _, _ = fp8_weight(256, 384, seed=3)
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(2)) * 3 + 0.01
    factor = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = fp8_dequantize(q, scale, dtype)
        assert got.dtype == dtype and torch.equal(got, (q.float() * factor).to(dtype)), dtype


def test_fp8_linear_rejects_shapes_that_do_not_fit() -> None:
    q, scale, _ = fp8_weight(200, 300, seed=0)
    with pytest.raises(ValueError, match="columns"):
        fp8_linear(torch.randn(1, 299), q, scale)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_linear(torch.randn(1, 300), q, scale[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(torch.randn(1, 300), q.float(), scale)


def test_activation_quantization_uses_the_smallest_power_of_two_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(5, 384, generator=gen) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(128)
    rows[2, 128:256] = 0.0
    values, scales = quantize_activation(rows)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 3)
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())  # powers of two
    assert float(scales[2, 1]) == 1.0  # an all-zero block
    amax = rows.view(5, 3, 128).abs().amax(-1)
    live = amax > 0
    assert bool((amax[live] / scales[live] <= 448).all()) and bool((amax[live] / scales[live] > 224).all())
    back = values.float().view(5, 3, 128) * scales.unsqueeze(-1)
    assert rel_error(back.view(5, 384), rows) < 2**-4
    # At the edges: amax / 448 exactly a power of two keeps it, one ulp above takes the next.
    edges = torch.zeros(3, 128)
    edges[0, 3] = 448 * 2**-3
    edges[1, 3] = -448 * 2**-3
    edges[2, 3] = torch.nextafter(torch.tensor(448 * 2**-3), torch.tensor(1e9))
    assert quantize_activation(edges)[1].view(-1).tolist() == [2**-3, 2**-3, 2**-2]


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 512, 4096), (1, 1024, 4096), (1, 4096, 4096), (1, 32768, 1024), (8, 4096, 2048)]
)
def test_the_gemv_launch_settings_fill_an_h200(m: int, n: int, k: int) -> None:
    block_n, split, _, _ = fp8.fp8_config(m, n, k, sms=132)
    assert block_n in (16, 32) and n % block_n == 0
    assert (n // block_n) * split >= 132 and (k // 128) % split == 0
    block_n, block_k, _ = fp8.fp8_row_config(n, k)
    assert 128 % block_n == 0 and k % block_k == 0 and block_k % 128 == 0
    assert n // block_n >= 128  # a program or more per SM, with no split of K


def test_the_cpu_runs_the_torch_form_by_default() -> None:
    assert fp8.SWITCH.forced is None and fp8.SCALED_MM.forced is None
    assert not fp8.enabled(torch.zeros(1))
    q, scale, _ = fp8_weight(96, 256, seed=1)
    seen = OpNames()
    with torch.inference_mode(), seen:
        fp8_linear(torch.randn(1, 256), q, scale)
        fp8_linear(torch.randn(20, 256), q, scale)  # prefill rows: no _scaled_mm on the CPU either
    assert "fp8_gemv" not in seen.names and "_scaled_mm" not in seen.names
    assert {"mm", "matmul"} & set(seen.names)


def test_scaled_mm_needs_cuda_tensors_and_whole_blocks_even_forced_on() -> None:
    rows = torch.zeros(32, 256)
    with fp8.SCALED_MM.force(True):
        assert not fp8._use_scaled_mm(rows, 256, 256)  # a CPU tensor
    with fp8.SCALED_MM.force(None):
        assert not fp8._use_scaled_mm(rows, 256, 256)


# --- the Triton kernels: on a GPU, or under Triton's interpreter --------------------------------------

_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.quant import fp8
from tests.engine.kernels.quant.samples import fp8_weight, rel_error, swiglu
from tests.engine.op_names import OpNames

fp8.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
# 96 x 256: two 128-column blocks; 32 x 1024: split along K, then the reduction kernel; one row of
# whole 128-row blocks: the one-row kernel (256 x 2048: two tiles of 1024 columns and two rows of
# scales; 128 x 384: three tiles of 128).
SHAPES = ((96, 256, (1, 3, 16)), (32, 1024, (1, 5)), (64, 384, (2,)), (256, 2048, (1,)), (128, 384, (1,)))
for n, k, rows in SHAPES:
    q, scale, reference = (t.to(device) for t in fp8_weight(n, k, seed=n))
    for m in rows:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            seen = OpNames()
            with seen:
                out = fp8.fp8_linear(x, q, scale)
            assert "fp8_gemv" in seen.names and "mm" not in seen.names, seen.names
            want = x.float() @ reference.t()
            assert out.dtype == dtype and out.shape == (m, n)
            err = rel_error(out, want)
            assert err < (1e-6 if dtype == torch.float32 else 8e-3), (n, k, m, dtype, err)

# The fused form of the batch-1 MoE's shared expert: its down projection reading SiLU(gate) · up and
# adding into the routed sum (one-row FP8).
q, scale, reference = (t.to(device) for t in fp8_weight(256, 384, seed=7))
for dtype in (torch.float32, torch.bfloat16):
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    gate_up = (3 * torch.randn(1, 768, generator=gen)).to(device, dtype)
    residual = torch.randn(1, 256, generator=gen).to(device, dtype)
    assert fp8.fp8_row_fits(gate_up, q, scale)
    want = residual.float() + swiglu(gate_up, 2.0) @ reference.t()
    got = fp8.fp8_row_(gate_up, q, scale, residual, swiglu_limit=2.0, residual=True)
    assert got is residual and rel_error(got, want) < tol, (dtype, rel_error(got, want))

# Activation quantization for _scaled_mm: 7 rows padded to 8, edge cases of the exponent from bits.
rows = torch.randn(7, 384, generator=gen) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(128)
rows[2, 128:256] = 0.0  # all zero: scale 1
rows[3, :128] = 0.0
rows[3, 5] = 448 * 2**-3  # amax / 448 exactly a power of two
rows[4, :128] = 0.0
rows[4, 7] = -1.75 * 2**5  # mantissa exactly 1.75
rows[5, :128] = 0.0
rows[5, 7] = 1.7500001 * 2**5  # just above
kernels = fp8._kernels()
for dtype in (torch.float32, torch.bfloat16):
    r = rows.to(device, dtype)
    # The interpreter rounds some floats to the wrong e4m3 neighbour: there the kernel's values are
    # checked before the conversion (rounded by torch), on a GPU after it.
    out_dtype = torch.float8_e4m3fn if device == "cuda" else torch.float32
    values, scales = kernels.act_quant(r, 8, out_dtype)
    want_values, want_scales = fp8.quantize_activation(torch.cat([r, r.new_zeros(1, 384)]))
    assert scales.shape == (8, 3) and scales.stride() == (1, 8)  # column-major
    assert torch.equal(scales, want_scales), (scales, want_scales)
    assert torch.equal(values.to(torch.float8_e4m3fn).float(), want_values.float())
print("triton ok")
"""


def test_the_triton_kernels_equal_the_reference() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter (the same kernel source, run by
    numpy). Skipped where Triton is not installed."""
    stdout = run_triton_check(_TRITON_CHECK)
    assert "triton ok" in stdout


# --- on an NVIDIA GPU (the lead runs these on the H200) ---------------------------------------------


@needs_nvidia_gpu
@pytest.mark.parametrize(("n", "k"), [(1024, 4096), (512, 4096), (4096, 2048)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_gpu_gemv_equals_the_reference(n: int, k: int, m: int) -> None:
    q, scale, reference = (t.cuda() for t in fp8_weight(n, k, seed=m))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    seen = OpNames()
    with seen:
        out = fp8_linear(x, q, scale)
    assert "fp8_gemv" in seen.names  # the default on NVIDIA GPUs
    assert rel_error(out, x.float() @ reference.t()) < 8e-3


@needs_nvidia_gpu
@pytest.mark.parametrize("m", [37, 512])
def test_the_scaled_mm_path_equals_the_reference_to_activation_rounding(m: int) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the _scaled_mm layouts are verified on compute capability 9.0")
    q, scale, reference = (t.cuda() for t in fp8_weight(1024, 2048, seed=m))
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    seen = OpNames()
    with seen:
        out = fp8_linear(x, q, scale)
    assert "_scaled_mm" in seen.names
    assert out.shape == (m, 1024) and out.dtype == torch.bfloat16
    assert rel_error(out, x.float() @ reference.t()) < 3e-2  # e4m3 activations: about 2.7e-2 here
    # Against the same quantized activations in float32, only the bf16 output rounding is left: a
    # scale applied to the wrong block or row would show here.
    values, scales = quantize_activation(x)
    emulated = (values.float() * scales.repeat_interleave(128, 1)) @ reference.t()
    assert rel_error(out, emulated) < 5e-3


@needs_nvidia_gpu
def test_cuda_graph_replays_equal_eager_runs() -> None:
    q, scale, _ = (t.cuda() for t in fp8_weight(1024, 4096, seed=4))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, q, scale)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_linear(x, q, scale)
    x.normal_()
    graph.replay()
    torch.testing.assert_close(captured, fp8_linear(x, q, scale), rtol=0, atol=0)
