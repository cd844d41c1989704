"""quant_kernels: products on FP8 block-128 weights and packed FP4 experts equal the same products on
the weights dequantized by the loader's reference math (loading/quantized.py): the torch forms on the
CPU, the Triton kernels under Triton's interpreter (or on a GPU), and on an H200 the _scaled_mm
prefill path (to activation-quantization tolerance) and CUDA graph replays."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.quant import fp8_fp4 as quant_kernels
from ds4desk.engine.kernels.quant.fp8_fp4 import (
    fp4_dequantize,
    fp4_experts_gemv,
    fp4_grouped_matmul,
    fp8_dequantize,
    fp8_linear,
    quantize_activation,
)
from ds4desk.engine.loading.quantized import (
    E2M1_VALUES,
    dequantize_fp4_block32,
    dequantize_fp8_block128,
    e8m0_to_float,
    quantize_fp4_block32,
    quantize_fp8_block128,
)
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [n, k], float32 block scales, the reference dequantized float32 [n, k]); blocks of very
    different magnitudes, so a scale applied to the wrong block shows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w *= (
        torch.exp2(torch.randint(-6, 6, ((n + 127) // 128, (k + 127) // 128), generator=gen).float())
        .repeat_interleave(128, 0)[:n]
        .repeat_interleave(128, 1)[:, :k]
    )
    q, exponent = quantize_fp8_block128(w)
    return q, e8m0_to_float(exponent, "test"), dequantize_fp8_block128(q, exponent)


def fp4_experts(e: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [e, n, k/2], scale uint8 [e, n, k/32], the reference float32 [e, n, k])."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) * torch.exp2(
        torch.randint(-8, 4, (e, n, k // 32), generator=gen).float()
    ).repeat_interleave(32, -1)
    parts = [quantize_fp4_block32(w[i]) for i in range(e)]
    packed = torch.stack([p.view(torch.uint8) for p, _ in parts])
    scale = torch.stack([s.view(torch.uint8) for _, s in parts])
    reference = torch.stack([dequantize_fp4_block32(p, s) for p, s in parts])
    return packed, scale, reference


def swiglu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """The clamped SwiGLU of gate | up rows in float32, rounded once to x's dtype (as the kernels)."""
    gate, up = x.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return act.to(x.dtype).float()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


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


def test_fp8_linear_rejects_shapes_that_do_not_fit() -> None:
    q, scale, _ = fp8_weight(200, 300, seed=0)
    with pytest.raises(ValueError, match="columns"):
        fp8_linear(torch.randn(1, 299), q, scale)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_linear(torch.randn(1, 300), q, scale[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(torch.randn(1, 300), q.float(), scale)


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


def grouped_reference(x: torch.Tensor, sizes: list[int], reference: torch.Tensor) -> torch.Tensor:
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    return torch.cat(
        [x[s : s + n].float() @ reference[e].t() for e, (s, n) in enumerate(zip(starts, sizes, strict=True))]
    )


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
    block_n, split, _, _ = quant_kernels.fp8_config(m, n, k, sms=132)
    assert block_n in (16, 32) and n % block_n == 0
    assert (n // block_n) * split >= 132 and (k // 128) % split == 0
    block_n, block_k, _, _ = quant_kernels.fp4_config(6, n, k, sms=132)
    assert 6 * (n // block_n) >= 132 and k % block_k == 0
    block_n, block_k, _ = quant_kernels.fp8_row_config(n, k)
    assert 128 % block_n == 0 and k % block_k == 0 and block_k % 128 == 0
    assert n // block_n >= 128  # a program or more per SM, with no split of K


def test_the_cpu_runs_the_torch_forms_by_default() -> None:
    assert quant_kernels.TRITON is None and quant_kernels.SCALED_MM is None
    q, scale, _ = fp8_weight(96, 256, seed=1)
    packed, pscale, _ = fp4_experts(2, 32, 64, seed=1)
    seen = OpNames()
    with torch.inference_mode(), seen:
        fp8_linear(torch.randn(1, 256), q, scale)
        fp4_experts_gemv(torch.randn(1, 64), torch.tensor([1]), packed, pscale)
        fp4_dequantize(packed[0], pscale[0], torch.float32)
    assert not {"fp8_gemv", "fp4_experts_gemv", "fp4_dequantize"} & set(seen.names)
    assert {"mm", "matmul"} & set(seen.names) and "bmm" in seen.names


# --- the Triton kernels: on a GPU, or under Triton's interpreter --------------------------------------

_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.quant import fp8_fp4 as quant_kernels
from tests.engine.kernels.quant.test_fp8_fp4 import OpNames, fp4_experts, fp8_weight, rel_error, swiglu

quant_kernels.TRITON = True
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
                out = quant_kernels.fp8_linear(x, q, scale)
            assert "fp8_gemv" in seen.names and "mm" not in seen.names, seen.names
            want = x.float() @ reference.t()
            assert out.dtype == dtype and out.shape == (m, n)
            err = rel_error(out, want)
            assert err < (1e-6 if dtype == torch.float32 else 8e-3), (n, k, m, dtype, err)

packed, pscale, reference = (t.to(device) for t in fp4_experts(5, 96, 256, seed=1))
for shared, dtype in [(s, d) for s in (False, True) for d in (torch.float32, torch.bfloat16)]:
    experts = torch.tensor([3, 1, 3, 0, 4, 4], device=device)
    x = torch.randn(1 if shared else 6, 256, generator=gen).to(device, dtype)
    seen = OpNames()
    with seen:
        out = quant_kernels.fp4_experts_gemv(x, experts, packed, pscale)
    assert "fp4_experts_gemv" in seen.names and "bmm" not in seen.names, seen.names
    want = torch.stack([x[0 if shared else s].float() @ reference[experts[s]].t() for s in range(6)])
    err = rel_error(out, want)
    assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 8e-3), (shared, dtype, err)
# The fused forms of the batch-1 MoE: the shared expert's down projection reading SiLU(gate) · up
# and adding into the routed sum (one-row FP8), the routed experts' down projection reading each
# slot's SiLU(gate) · up (FP4).
q, scale, reference = (t.to(device) for t in fp8_weight(256, 384, seed=7))
packed, pscale, preference = (t.to(device) for t in fp4_experts(5, 96, 256, seed=4))
experts = torch.tensor([3, 1, 3, 0, 4, 4], device=device)
for dtype in (torch.float32, torch.bfloat16):
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    gate_up = (3 * torch.randn(1, 768, generator=gen)).to(device, dtype)
    residual = torch.randn(1, 256, generator=gen).to(device, dtype)
    assert quant_kernels.fp8_row_fits(gate_up, q, scale)
    want = residual.float() + swiglu(gate_up, 2.0) @ reference.t()
    got = quant_kernels.fp8_row_(gate_up, q, scale, residual, swiglu_limit=2.0, residual=True)
    assert got is residual and rel_error(got, want) < tol, (dtype, rel_error(got, want))
    gate_ups = (3 * torch.randn(6, 512, generator=gen)).to(device, dtype)
    out = quant_kernels.fp4_experts_gemv(gate_ups, experts, packed, pscale, swiglu_limit=2.0)
    act = swiglu(gate_ups, 2.0)
    want = torch.stack([act[s] @ preference[experts[s]].t() for s in range(6)])
    assert rel_error(out, want) < tol, (dtype, rel_error(out, want))

packed, pscale, reference = (t.to(device) for t in fp4_experts(2, 32, 64, seed=2))
one = torch.tensor([1], device=device)
out = quant_kernels.fp4_experts_gemv(torch.ones(1, 64, device=device), one, packed, pscale)
assert rel_error(out, reference[1].sum(-1, keepdim=True).t()) < 1e-6  # BLOCK_K 64
for dtype in (torch.float32, torch.bfloat16):
    for n, k in ((96, 256), (40, 192)):
        packed, pscale, reference = (t.to(device) for t in fp4_experts(2, n, k, seed=k))
        seen = OpNames()
        with seen:
            got = quant_kernels.fp4_dequantize(packed[1], pscale[1], dtype)
        assert "fp4_dequantize" in seen.names, seen.names
        assert got.dtype == dtype and torch.equal(got.float(), reference[1]), (n, k, dtype)

# Prefill through the experts: the grouped kernel (partial row tiles, an empty group).
from tests.engine.kernels.quant.test_fp8_fp4 import grouped_reference
packed, pscale, reference = (t.to(device) for t in fp4_experts(4, 128, 128, seed=3))
sizes = [70, 0, 3, 65]
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(sum(sizes), 128, generator=gen).to(device, dtype)
    out = quant_kernels._grouped_triton(x, sizes, packed, pscale)
    err = rel_error(out, grouped_reference(x, sizes, reference))
    assert out.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 8e-3), (dtype, err)

# Activation quantization for _scaled_mm: 7 rows padded to 8, edge cases of the exponent from bits.
rows = torch.randn(7, 384, generator=gen) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(128)
rows[2, 128:256] = 0.0  # all zero: scale 1
rows[3, :128] = 0.0
rows[3, 5] = 448 * 2**-3  # amax / 448 exactly a power of two
rows[4, :128] = 0.0
rows[4, 7] = -1.75 * 2**5  # mantissa exactly 1.75
rows[5, :128] = 0.0
rows[5, 7] = 1.7500001 * 2**5  # just above
kernels = quant_kernels._kernels()
for dtype in (torch.float32, torch.bfloat16):
    r = rows.to(device, dtype)
    # The interpreter rounds some floats to the wrong e4m3 neighbour: there the kernel's values are
    # checked before the conversion (rounded by torch), on a GPU after it.
    out_dtype = torch.float8_e4m3fn if device == "cuda" else torch.float32
    values, scales = kernels.act_quant(r, 8, out_dtype)
    want_values, want_scales = quant_kernels.quantize_activation(torch.cat([r, r.new_zeros(1, 384)]))
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

cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU"
)


@cuda
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


@cuda
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


@cuda
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


@cuda
def test_the_gpu_grouped_matmul_equals_the_reference() -> None:
    packed, pscale, reference = (t.cuda() for t in fp4_experts(8, 512, 1024, seed=5))
    sizes = [100, 0, 1, 64, 65, 30, 0, 40]
    x = torch.randn(sum(sizes), 1024, device="cuda", dtype=torch.bfloat16)
    out = fp4_grouped_matmul(x, sizes, packed, pscale)
    assert rel_error(out, grouped_reference(x, sizes, reference)) < 8e-3


@cuda
def test_cuda_graph_replays_equal_eager_runs() -> None:
    q, scale, _ = (t.cuda() for t in fp8_weight(1024, 4096, seed=4))
    packed, pscale, _ = (t.cuda() for t in fp4_experts(8, 512, 1024, seed=4))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    experts = torch.tensor([1, 6, 1, 3, 0, 7], device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_linear(x, q, scale), fp4_experts_gemv(h, experts, packed, pscale)

    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.normal_()
    h.normal_()
    experts.copy_(torch.tensor([7, 7, 2, 5, 4, 0], device="cuda"))  # read inside the kernel at replay
    graph.replay()
    eager = step()
    torch.testing.assert_close(captured[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(captured[1], eager[1], rtol=0, atol=0)
