"""quant/gguf_triton.py: the Triton kernels on GGUF-packed weights equal quant/gguf.py's reference.

- the dequantize kernel (prefill's scratch) gives gguf.dequantize's values bit for bit after the cast
  to float32, bfloat16 or float16, on random valid blocks of every exponent and on blocks gguf-py
  quantized;
- the GEMV (T = 1 and 5 rows), the prefill path (T = 64: scratch + mm) and the fused decode forms
  (residual add, SiLU(gate) · up input, RMSNorm input) equal a float32 matmul on the dequantized
  weight to accumulation-order error (float32 x), or to one output rounding (bfloat16 x), with rows
  that are no multiple of the rows a program takes and rows whose length is no multiple of its tile.

Without a GPU, Triton's interpreter runs the kernels (one subprocess per group of types); on an NVIDIA
GPU the real kernels run, and the tests marked needs_nvidia_gpu add the benchmark model's shapes and a
CUDA graph replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from ds4desk.engine.formats import GGUF_TYPES, IQ4_NL_VALUES, GgufType
from ds4desk.engine.kernels.quant import gguf, gguf_triton
from ds4desk.engine.kernels.quant.gguf_matmul import gguf_matmul
from tests.engine.kernels.quant.samples import needs_nvidia_gpu
from tests.engine.kernels.quant.test_gguf import FP16_FIELDS, random_blocks
from tests.engine.triton_check import run_triton_check

BY_NAME = {t.name: t for t in GGUF_TYPES.values()}
COVERED = ("Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS", "MXFP4")
COVERED += ("Q2_K", "Q3_K")
# Types gguf-py can quantize: their test weights are real quantized data too.
GGUF_PY_QUANTIZES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")


# --- test data (also imported by the interpreter scripts below) -------------------------------------


def tame_blocks(kind: GgufType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random valid blocks whose values stay in a float16 / bfloat16 friendly range: random codes and
    sub-block scales, fp16 scales of magnitude 0.002-0.05 with random signs (MXFP4: exponents
    2^-10 .. 2^0)."""
    blocks = random_blocks(kind, (rows, cols), seed).reshape(-1, kind.block_bytes).copy()
    rng = np.random.default_rng(seed + 1)
    for at in FP16_FIELDS[kind.name]:
        scale = rng.uniform(0.002, 0.05, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind.name == "MXFP4":
        blocks[:, 0] = rng.integers(117, 128, len(blocks))
    return torch.from_numpy(blocks.reshape(rows, -1))


def quantized_blocks(kind: GgufType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Blocks gguf-py quantized from random normal weights (types in GGUF_PY_QUANTIZES)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType(kind.type_id))))


def wild_blocks(kind: GgufType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """test_gguf's random valid blocks: fp16 scales of every finite exponent, subnormals included."""
    return torch.from_numpy(random_blocks(kind, (rows, cols), seed).copy())


def accumulation_bound(x: torch.Tensor, weight: torch.Tensor, kind: GgufType, cols: int) -> torch.Tensor:
    """|x| @ |W|ᵀ: what float32 accumulation errors are proportional to."""
    w = gguf.dequantize(weight, kind.type_id, (weight.shape[0], cols))
    return x.float().abs() @ w.abs().t()


def assert_matches(
    got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: object, input_rounding: float = 0.0
) -> None:
    """got (in its dtype) equals the float32 `want` to accumulation-order error (relative to `bound`,
    the sum of the magnitudes), plus one rounding to got's dtype (2^-8 relative covers a bfloat16
    rounding that the accumulation error tips over); input_rounding: relative error each input value
    may have (an input the kernel computes and rounds itself)."""
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}[got.dtype]
    err = (got.float() - want).abs()
    allowed = (2e-5 + input_rounding) * bound + rounding * want.abs() + 1e-30
    assert bool((err <= allowed).all()), (what, float((err / allowed).max()))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# --- without Triton's kernels ----------------------------------------------------------------------


def test_the_cpu_keeps_the_reference_path() -> None:
    assert gguf_triton.SWITCH.forced is None and not gguf_triton.enabled(torch.device("cpu"))
    x = torch.randn(2, 256)
    weight = tame_blocks(BY_NAME["Q4_K"], 8, 256, seed=1)
    out = gguf_matmul(x, weight, BY_NAME["Q4_K"].type_id, 256)
    torch.testing.assert_close(out, gguf_triton.reference_matmul(x, weight, 12, 256), rtol=1e-5, atol=1e-5)


def test_covers_only_the_block_types_and_float_activations() -> None:
    with gguf_triton.SWITCH.force(True):
        for name in COVERED:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                assert gguf_triton.covers(BY_NAME[name].type_id, dtype) == (
                    gguf_triton._kernels() is not None
                )
        assert not gguf_triton.covers(BY_NAME["F16"].type_id, torch.float32)
        assert not gguf_triton.covers(BY_NAME["Q8_0"].type_id, torch.float64)
        assert not gguf_triton.covers(9, torch.float32)  # Q8_1: refused by ds4desk
    with gguf_triton.SWITCH.force(False):
        assert not gguf_triton.covers(BY_NAME["Q8_0"].type_id, torch.bfloat16)


def test_every_block_type_of_the_table_is_covered() -> None:
    block_types = {t.name for t in GGUF_TYPES.values() if t.name not in ("F32", "F16", "BF16")}
    assert block_types == set(COVERED)


@pytest.mark.parametrize("values", [IQ4_NL_VALUES, gguf_triton._MXFP4_DOUBLED])
def test_the_codebook_words_hold_the_table(values: tuple[int, ...]) -> None:
    words = gguf_triton._codebook_words(values)
    assert all(-(1 << 31) <= w < 1 << 31 for w in words)
    unpacked = [((words[c // 4] >> (8 * (c % 4))) & 0xFF) for c in range(16)]
    assert [b - 256 if b >= 128 else b for b in unpacked] == [int(v) for v in values]


@pytest.mark.parametrize(
    ("rows", "cols"), [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (49152, 2048)]
)
def test_the_gemv_settings_give_every_sm_work(rows: int, cols: int) -> None:
    block_n, values, warps = gguf_triton.gemv_config(rows, cols, sms=132)
    assert -(-rows // block_n) >= 132 and values <= cols and values & (values - 1) == 0
    assert warps in (4, 8)


def test_malformed_operands_are_refused() -> None:
    weight = tame_blocks(BY_NAME["Q8_0"], 4, 64, seed=0)
    out = torch.empty(1, 4)
    with pytest.raises(ValueError, match="uint8"):
        gguf_triton.gemv(torch.randn(1, 64), weight[:, :-2], BY_NAME["Q8_0"].type_id, 64, out)
    with pytest.raises(ValueError, match="x must be"):
        gguf_triton.gemv(torch.randn(1, 32), weight, BY_NAME["Q8_0"].type_id, 64, out)
    with pytest.raises(ValueError, match="do not take"):
        gguf_triton.gemv(torch.randn(1, 64), weight, BY_NAME["F16"].type_id, 64, out)


# --- the Triton kernels: on a GPU, or under Triton's interpreter --------------------------------------

_CHECK = """
import torch
from ds4desk.engine.kernels.quant import gguf, gguf_triton as gt
from tests.engine.kernels.quant.test_gguf_triton import (
    BY_NAME, GGUF_PY_QUANTIZES, accumulation_bound, assert_matches, quantized_blocks, rel_error,
    tame_blocks, wild_blocks,
)

gt.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
TYPES = {types}
FULL = {full}  # the priority types: more shapes, and the fused forms
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

def randn(*shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device)

for name in TYPES:
    kind = BY_NAME[name]
    # The dequantize kernel: bit for bit, on blocks of every exponent (subnormal scales, values
    # past float16's range: inf in both) and on quantized data.
    samples = [wild_blocks(kind, 10, 768, seed=5)]
    if name in GGUF_PY_QUANTIZES:
        samples.append(quantized_blocks(kind, 6, 512, seed=6))
    for raw in samples:
        raw = raw.to(device)
        rows, cols = raw.shape[0], 768 if raw.shape[0] == 10 else 512
        want = gguf.dequantize(raw, kind.type_id, (rows, cols))
        for dtype in DTYPES:
            out = torch.full((rows, cols), float("nan"), device=device, dtype=dtype)
            gt.dequantize_into(raw, kind.type_id, cols, out)
            expected = want.to(dtype)
            same = (out == expected) | (out.isnan() & expected.isnan())
            assert bool(same.all()), (name, dtype, int((~same).sum()))

    # The GEMV: (rows, cols, tile settings: None = the default), rows that no tile divides.
    shapes = [(50, 256, (4, 256, 4)), (22, 768, (2, 1024, 8)), (9, 512, None)]
    if name in FULL:
        shapes += [(12, 2048, (4, 512, 4)), (33, 256, (1, 256, 4))]
    for rows, cols, tiles in shapes:
        gt.OVERRIDE = tiles
        raw = tame_blocks(kind, rows, cols, seed=rows).to(device)
        if name in GGUF_PY_QUANTIZES and tiles is None:
            raw = quantized_blocks(kind, rows, cols, seed=rows).to(device)
        w = gguf.dequantize(raw, kind.type_id, (rows, cols))
        for t in (1, 5):
            for dtype in (torch.float32, torch.bfloat16):
                x32 = randn(t, cols)
                x = x32.to(dtype)
                out = torch.empty(t, rows, device=device, dtype=dtype)
                got = gt.matmul(x, raw, kind.type_id, cols, out)
                assert got is out and out.dtype == dtype
                what = (name, rows, cols, tiles, t, dtype)
                assert_matches(out, x.float() @ w.t(), accumulation_bound(x, raw, kind, cols), what)
                assert rel_error(out, x32 @ w.t()) < (1e-6 if dtype == torch.float32 else 8e-3), what
        if name in FULL:  # float16 activations, and x with a row stride (a slice of a wider tensor)
            x = randn(3, 2 * cols).to(torch.float16)[:, :cols]
            out = gt.matmul(x, raw, kind.type_id, cols, torch.empty(3, rows, device=device, dtype=x.dtype))
            assert_matches(out, x.float() @ w.t(), accumulation_bound(x, raw, kind, cols), (name, "fp16"))
    gt.OVERRIDE = None

    # Prefill: the weight dequantized to x's dtype (exact, tested above), then one mm.
    rows, cols = 40, 512
    raw = tame_blocks(kind, rows, cols, seed=7).to(device)
    w = gguf.dequantize(raw, kind.type_id, (rows, cols))
    for dtype in (torch.float32, torch.bfloat16):
        x32 = randn(64, cols)
        x = x32.to(dtype)
        out = gt.matmul(x, raw, kind.type_id, cols, torch.empty(64, rows, device=device, dtype=dtype))
        assert_matches(out, x.float() @ w.to(dtype).float().t(), accumulation_bound(x, raw, kind, cols), name)
        assert rel_error(out, x32 @ w.t()) < (1e-6 if dtype == torch.float32 else 1.2e-2), name

    # The decode step's fused forms (one row).
    if name in FULL:
        rows, cols = 50, 512
        gt.OVERRIDE = (4, 256, 4)
        raw = tame_blocks(kind, rows, cols, seed=8).to(device)
        w = gguf.dequantize(raw, kind.type_id, (rows, cols))
        for dtype in (torch.float32, torch.bfloat16):
            gate_up = randn(1, 2 * cols, scale=2.0).to(dtype)
            residual = randn(1, rows).to(dtype)
            gate, up = gate_up.float().chunk(2, dim=-1)
            act = (torch.nn.functional.silu(gate) * up).to(dtype)
            want = residual.float() + act.float() @ w.t()
            bound = accumulation_bound(act, raw, kind, cols) + residual.float().abs()
            got = gt.gemv_add_(residual, gate_up, raw, kind.type_id, cols, silu=True)
            assert got is residual
            assert_matches(got, want, bound, (name, "silu add", dtype))

            x, residual = randn(1, cols).to(dtype), randn(1, rows).to(dtype)
            want = residual.float() + x.float() @ w.t()
            bound = accumulation_bound(x, raw, kind, cols) + residual.float().abs()
            gt.gemv_add_(residual, x, raw, kind.type_id, cols)
            assert_matches(residual, want, bound, (name, "add", dtype))

            x, norm = randn(1, cols).to(dtype), (1 + 0.1 * randn(cols)).to(dtype)
            normed = torch.nn.functional.rms_norm(x.float(), (cols,), norm.float(), 1e-5).to(dtype)
            out = torch.empty(1, rows, device=device, dtype=dtype)
            gt.norm_gemv(x, norm, raw, kind.type_id, cols, 1e-5, out)
            # The norm is summed in another order than torch's: the normed row may round to the
            # neighbouring bfloat16 value, so a bfloat16 input is held to its rounding too.
            slack = 0.0 if dtype == torch.float32 else 2.0**-8
            bound = accumulation_bound(normed, raw, kind, cols)
            assert_matches(out, normed.float() @ w.t(), bound, (name, "norm", dtype), slack)
        gt.OVERRIDE = None
    print("checked", name)
print("triton ok")
"""


@pytest.mark.parametrize(
    "types",
    [
        ("Q8_0", "Q4_K", "Q6_K"),
        ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"),
        ("Q5_K", "IQ4_XS", "Q2_K", "Q3_K"),
    ],
    ids=["priority", "32-value-blocks", "more-super-blocks"],
)
def test_the_triton_kernels_equal_the_reference(types: tuple[str, ...]) -> None:
    full = tuple(t for t in types if t in ("Q8_0", "Q4_K", "Q6_K"))
    stdout = run_triton_check(_CHECK.format(types=types, full=full))
    assert "triton ok" in stdout and all(f"checked {t}" in stdout for t in types)


# --- on an NVIDIA GPU (the lead runs these on the H200) ---------------------------------------------

# The 1.07B benchmark model's linears (bench/gpu_speed.py): q/o, k/v, gate/up, down, the tied head.
MODEL_SHAPES = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (49152, 2048)]


@needs_nvidia_gpu
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS"])
@pytest.mark.parametrize(("rows", "cols"), MODEL_SHAPES)
def test_the_gpu_kernels_on_the_model_shapes(name: str, rows: int, cols: int) -> None:
    kind = BY_NAME[name]
    raw = tame_blocks(kind, rows, cols, seed=rows).cuda()
    w = gguf.dequantize(raw, kind.type_id, (rows, cols))
    assert gguf_triton.covers(kind.type_id, torch.bfloat16)
    for t in (1, 4, 300):
        x = torch.randn(t, cols, device="cuda", dtype=torch.bfloat16)
        out = gguf_matmul(x, raw, kind.type_id, cols)
        # Prefill (more than GEMV_MAX_ROWS rows) multiplies the weight rounded to bfloat16.
        want = x.float() @ (w if t <= gguf_triton.GEMV_MAX_ROWS else w.bfloat16().float()).t()
        assert_matches(out, want, accumulation_bound(x, raw, kind, cols), (name, t, rows, cols))
    scratch = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gguf_triton.dequantize_into(raw, kind.type_id, cols, scratch), w.bfloat16())


@needs_nvidia_gpu
def test_cuda_graph_replays_equal_eager_runs() -> None:
    kind = BY_NAME["Q4_K"]
    raw = tame_blocks(kind, 2048, 8192, seed=3).cuda()
    gate_up = torch.randn(1, 2 * 8192, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    start = residual.clone()
    gguf_triton.gemv_add_(residual, gate_up, raw, kind.type_id, 8192, silu=True)  # compiles outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gguf_triton.gemv_add_(residual, gate_up, raw, kind.type_id, 8192, silu=True)
    gate_up.normal_()
    residual.copy_(start)
    graph.replay()
    eager = start.clone()
    gguf_triton.gemv_add_(eager, gate_up, raw, kind.type_id, 8192, silu=True)
    torch.testing.assert_close(residual, eager, rtol=0, atol=0)
