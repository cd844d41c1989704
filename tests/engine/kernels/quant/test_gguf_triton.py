"""quant/gguf_triton.py: the Triton kernels on GGUF-packed weights equal quant/gguf.py's reference.

- the dequantize kernel (prefill's scratch) gives gguf.dequantize's values bit for bit after the cast
  to float32, bfloat16 or float16, on random valid blocks of every exponent and on blocks gguf-py
  quantized;
- the GEMV (T = 1 and 5 rows), the prefill path (T = 64: scratch + mm) and the fused decode forms
  (residual add, SiLU(gate) · up input, RMSNorm input) equal a float32 matmul on the dequantized
  weight to accumulation-order error (float32 x), or to one output rounding (bfloat16 x), with rows
  that are no multiple of the rows a program takes and rows whose length is no multiple of its tile.

Without a GPU, Triton's interpreter runs the kernels (one subprocess per group of types), and Triton's
own compiler and ptxas build them for an H200 (sm_90) to show they compile there without spilling; on
an NVIDIA GPU the real kernels run, and the tests marked needs_nvidia_gpu add the benchmark model's
shapes and a CUDA graph replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from ds4desk.engine.formats import GGUF_TYPES, IQ4_NL_VALUES, ROW_LAYOUTS, GgufType
from ds4desk.engine.kernels.quant import gguf, gguf_launch, gguf_tiles, gguf_triton
from ds4desk.engine.kernels.quant.gguf_matmul import gguf_matmul
from tests.engine.kernels.quant.samples import needs_nvidia_gpu
from tests.engine.kernels.quant.test_gguf import random_blocks
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
    for at in kind.fp16_scales:
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
    """Without a GPU the Triton kernels stay off; gguf_matmul still gives the reference's values (by
    the CPU kernels where they were built, whose sums run in another order: accumulation error)."""
    assert gguf_triton.SWITCH.forced is None and not gguf_triton.enabled(torch.device("cpu"))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    weight = tame_blocks(BY_NAME["Q4_K"], 8, 256, seed=1)
    out = gguf_matmul(x, weight, BY_NAME["Q4_K"].type_id, 256)
    torch.testing.assert_close(out, gguf_triton.reference_matmul(x, weight, 12, 256), rtol=1e-4, atol=1e-4)


def test_covers_only_the_block_types_and_float_activations() -> None:
    with gguf_triton.SWITCH.force(True):
        for name in COVERED:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                assert gguf_triton.covers(BY_NAME[name].type_id, dtype) == (gguf_launch.kernels() is not None)
        assert not gguf_triton.covers(BY_NAME["F16"].type_id, torch.float32)
        assert not gguf_triton.covers(BY_NAME["Q8_0"].type_id, torch.float64)
        assert not gguf_triton.covers(9, torch.float32)  # Q8_1: refused by ds4desk
    with gguf_triton.SWITCH.force(False):
        assert not gguf_triton.covers(BY_NAME["Q8_0"].type_id, torch.bfloat16)


def test_every_block_type_of_the_table_is_covered() -> None:
    block_types = {t.name for t in GGUF_TYPES.values() if t.name not in ("F32", "F16", "BF16")}
    assert block_types == set(COVERED)


@pytest.mark.parametrize("values", [IQ4_NL_VALUES, gguf_tiles.MXFP4_DOUBLED])
def test_the_codebook_words_hold_the_table(values: tuple[int, ...]) -> None:
    words = gguf_tiles.codebook_words(values)
    assert all(-(1 << 31) <= w < 1 << 31 for w in words)
    unpacked = [((words[c // 4] >> (8 * (c % 4))) & 0xFF) for c in range(16)]
    assert [b - 256 if b >= 128 else b for b in unpacked] == [int(v) for v in values]


@pytest.mark.parametrize(
    ("rows", "cols"), [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (49152, 2048)]
)
def test_the_gemv_settings_give_every_sm_work(rows: int, cols: int) -> None:
    block_n, values, warps = gguf_tiles.gemv_config(rows, cols, sms=132)
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
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_launch
from ds4desk.engine.kernels.quant import gguf_tiles
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
        gguf_tiles.OVERRIDE = tiles
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
    gguf_tiles.OVERRIDE = None

    # Prefill: the weight dequantized to x's dtype (exact, tested above), then one mm.
    rows, cols = 40, 512
    raw = tame_blocks(kind, rows, cols, seed=7).to(device)
    w = gguf.dequantize(raw, kind.type_id, (rows, cols))
    for dtype in (torch.float32, torch.bfloat16):
        x32 = randn(64, cols)
        x = x32.to(dtype)
        out = gt.matmul(x, raw, kind.type_id, cols, torch.empty(64, rows, device=device, dtype=dtype))
        # cuBLAS may add bfloat16 products in reduced precision (torch's default): a bfloat16
        # rounding or two of a partial sum.
        slack = 0.0 if dtype == torch.float32 else 2.0**-7
        bound = accumulation_bound(x, raw, kind, cols)
        assert_matches(out, x.float() @ w.to(dtype).float().t(), bound, (name, "prefill"), slack)
        assert rel_error(out, x32 @ w.t()) < (1e-6 if dtype == torch.float32 else 1.2e-2), name

    # The decode step's fused forms (one row).
    if name in FULL:
        rows, cols = 50, 512
        gguf_tiles.OVERRIDE = (4, 256, 4)
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
            # On a GPU the kernel's sigmoid (its exp) is not torch's: an activation may round to the
            # neighbouring bfloat16 value, so a bfloat16 input is held to its rounding.
            slack = 0.0 if dtype == torch.float32 else 2.0**-8
            assert_matches(got, want, bound, (name, "silu add", dtype), slack)

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
        gguf_tiles.OVERRIDE = None
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


_ONE_ROW_CHECK = """
import torch
from ds4desk.engine.kernels.quant import gguf, gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_launch
from ds4desk.engine.kernels.quant import gguf_tiles
from tests.engine.kernels.quant.test_gguf_triton import (
    BY_NAME, accumulation_bound, assert_matches, quantized_blocks, tame_blocks,
)

gt.SWITCH.forced = True
# every height takes the one-row kernel
gguf_tiles.ONE_ROW_MIN_ROWS = dict.fromkeys(gguf_tiles.ONE_ROW_GROUPS, 0)
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(1)

def randn(*shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device)

for name in ("Q8_0", "Q4_K", "Q6_K"):
    kind = BY_NAME[name]
    group = gguf_tiles.ONE_ROW_GROUPS[name]
    # (rows, cols, settings): rows no program height divides, a row of groups that the tile does
    # not divide (masked groups), several tiles along a row, and the default settings.
    for rows, cols, config in [(9, 768, (4, 8, 1)), (20, 1024, (8, 4096 // group // 2, 1)), (6, 512, None)]:
        gguf_tiles.ONE_ROW_OVERRIDE = config
        blocks = quantized_blocks if name == "Q8_0" else tame_blocks
        raw = blocks(kind, rows, cols, seed=rows).to(device)
        w = gguf.dequantize(raw, kind.type_id, (rows, cols))
        for dtype in (torch.float32, torch.bfloat16):
            what = (name, rows, cols, config, dtype)
            x = randn(1, cols).to(dtype)
            out = gt.matmul(x, raw, kind.type_id, cols, torch.empty(1, rows, device=device, dtype=dtype))
            assert_matches(out, x.float() @ w.t(), accumulation_bound(x, raw, kind, cols), what)

            residual = randn(1, rows).to(dtype)
            want = residual.float() + x.float() @ w.t()
            bound = accumulation_bound(x, raw, kind, cols) + residual.float().abs()
            gt.gemv_add_(residual, x, raw, kind.type_id, cols)
            assert_matches(residual, want, bound, (what, "add"))

            gate_up = randn(1, 2 * cols, scale=2.0).to(dtype)
            residual = randn(1, rows).to(dtype)
            gate, up = gate_up.float().chunk(2, dim=-1)
            act = (torch.nn.functional.silu(gate) * up).to(dtype)
            want = residual.float() + act.float() @ w.t()
            bound = accumulation_bound(act, raw, kind, cols) + residual.float().abs()
            gt.gemv_add_(residual, gate_up, raw, kind.type_id, cols, silu=True)
            slack = 0.0 if dtype == torch.float32 else 2.0**-8  # a GPU's sigmoid is not torch's
            assert_matches(residual, want, bound, (what, "silu add"), slack)

            norm = (1 + 0.1 * randn(cols)).to(dtype)
            normed = torch.nn.functional.rms_norm(x.float(), (cols,), norm.float(), 1e-5).to(dtype)
            out = torch.empty(1, rows, device=device, dtype=dtype)
            gt.norm_gemv(x, norm, raw, kind.type_id, cols, 1e-5, out)
            bound = accumulation_bound(normed, raw, kind, cols)
            assert_matches(out, normed.float() @ w.t(), bound, (what, "norm"), slack)
    gguf_tiles.ONE_ROW_OVERRIDE = None
    print("checked", name)
print("one row ok")
"""


def test_the_one_row_kernel_equals_the_reference() -> None:
    """gguf_gemv1_triton (Q8_0, Q4_K, Q6_K at one input row) against dequantize + float32 matmul:
    plain, with the residual, and behind the norm and SiLU input kernel; on Triton's interpreter
    (its pure-Triton byte conversion) or a GPU (its PTX one)."""
    stdout = run_triton_check(_ONE_ROW_CHECK)
    assert "one row ok" in stdout and all(f"checked {t}" in stdout for t in ("Q8_0", "Q4_K", "Q6_K"))


_ROWS_CHECK = """
import torch
from ds4desk.engine.formats import GGUF_TYPES, ROW_LAYOUTS
from ds4desk.engine.kernels.quant import gguf, gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_tiles
from tests.engine.kernels.quant.test_gguf_triton import assert_matches, quantized_blocks, wild_blocks

gt.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(2)

def randn(*shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device)

for file_id in ROW_LAYOUTS:  # the types with a row layout: Q8_0
    kind = GGUF_TYPES[file_id]
    name = kind.name
    layout = ROW_LAYOUTS[kind.type_id][0].type_id

    def rows_of(blocks, cols):
        return gguf.device_rows(blocks, kind.type_id, cols).to(device)

    # The dequantize kernel (prefill's scratch): bit for bit, scales of every exponent included.
    raw = rows_of(wild_blocks(kind, 10, 768, seed=5), 768)
    want = gguf.dequantize(raw, layout, (10, 768))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = gt.dequantize_into(raw, layout, 768, torch.empty(10, 768, device=device, dtype=dtype))
        same = (out == want.to(dtype)) | (out.isnan() & want.isnan())
        assert bool(same.all()), (name, dtype)

    # The GEMVs: one row (gguf_rows_triton: plain, residual, SiLU and norm inputs computed by its
    # programs or by an input kernel before it), 3 rows (the general kernel), 40 (scratch + mm); rows
    # no program height divides, several tiles along a row, and the default settings.
    CASES = [(9, 512, (4, 256, 2), 8192), (6, 256, None, 8192), (10, 1024, (8, 512, 4), 0)]
    for rows, cols, config, own in CASES:
        gguf_tiles.ROWS_OVERRIDE, gguf_tiles.ROWS_OWN_INPUT_MAX_ROWS = config, own
        raw = rows_of(quantized_blocks(kind, rows, cols, seed=rows), cols)
        w = gguf.dequantize(raw, layout, (rows, cols))
        for dtype in (torch.float32, torch.bfloat16):
            what = (name, rows, cols, config, own, dtype)
            for t in (1, 3, 40):
                x = randn(t, cols).to(dtype)
                out = gt.matmul(x, raw, layout, cols, torch.empty(t, rows, device=device, dtype=dtype))
                slack = 2.0**-7 if t > 8 and dtype == torch.bfloat16 else 0.0  # cuBLAS's bfloat16 sums
                want = x.float() @ (w.to(dtype).float() if t > 8 else w).t()
                assert_matches(out, want, x.float().abs() @ w.abs().t(), (what, t), slack)
            residual = randn(1, rows).to(dtype)
            want = residual.float() + x[:1].float() @ w.t()
            bound = x[:1].float().abs() @ w.abs().t() + residual.float().abs()
            gt.gemv_add_(residual, x[:1].contiguous(), raw, layout, cols)
            assert_matches(residual, want, bound, (what, "add"))
            slack = 0.0 if dtype == torch.float32 else 2.0**-8  # a GPU's sigmoid and norm: a rounding
            gate_up = randn(1, 2 * cols, scale=2.0).to(dtype)
            residual = randn(1, rows).to(dtype)
            gate, up = gate_up.float().chunk(2, dim=-1)
            act = (torch.nn.functional.silu(gate) * up).to(dtype)
            want = residual.float() + act.float() @ w.t()
            bound = act.float().abs() @ w.abs().t() + residual.float().abs()
            gt.gemv_add_(residual, gate_up, raw, layout, cols, silu=True)
            assert_matches(residual, want, bound, (what, "silu add"), slack)
            x, norm = randn(1, cols).to(dtype), (1 + 0.1 * randn(cols)).to(dtype)
            normed = torch.nn.functional.rms_norm(x.float(), (cols,), norm.float(), 1e-5).to(dtype)
            out = torch.empty(1, rows, device=device, dtype=dtype)
            gt.norm_gemv(x, norm, raw, layout, cols, 1e-5, out)
            bound = normed.float().abs() @ w.abs().t()
            assert_matches(out, normed.float() @ w.t(), bound, (what, "norm"), slack)
        print("checked", name, rows, cols)
    gguf_tiles.ROWS_OVERRIDE, gguf_tiles.ROWS_OWN_INPUT_MAX_ROWS = None, 8192
    # Stacked matrices, each times its own input row (V4's grouped output projection at one token):
    # 3 matrices of 9 rows, on a settings' tile that leaves the last program rows past the end.
    gguf_tiles.ROWS_OVERRIDE = (4, 256, 2)
    raw = rows_of(quantized_blocks(kind, 27, 512, seed=11), 512)
    w = gguf.dequantize(raw, layout, (27, 512)).view(3, 9, 512)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(3, 512).to(dtype)
        out = gt.stacked_rows_gemv(x, raw, 512, torch.full((3, 9), float("nan"), device=device, dtype=dtype))
        want = torch.einsum("gk,grk->gr", x.float(), w)
        bound = torch.einsum("gk,grk->gr", x.float().abs(), w.abs())
        assert_matches(out, want, bound, (name, "stacked", dtype))
    gguf_tiles.ROWS_OVERRIDE = None
    print("checked", name, "stacked")
print("rows ok")
"""


def test_the_row_layout_kernels_equal_the_reference() -> None:
    """Q8_0_ROWS (a GPU's Q8_0): its one-row GEMV in every form and on stacked matrices, the general
    GEMV and the dequantize kernel against gguf.dequantize of the same rows + a float32 matmul (the
    dequantize bit for bit)."""
    stdout = run_triton_check(_ROWS_CHECK)
    assert "rows ok" in stdout and stdout.count("checked") == 4


@pytest.mark.parametrize(
    ("rows", "cols"), [(3072, 2048), (16384, 2048), (2048, 8192), (512, 2048), (129280, 4096), (4096, 4096)]
)
@pytest.mark.parametrize("form", ["plain", "norm", "silu_add"])
def test_the_q8_0_rows_kernel_compiles_for_an_h200(rows: int, cols: int, form: str, tmp_path: object) -> None:
    """The one-row GEMV of Q8_0_ROWS in its settings for the benchmark model's shapes and DeepSeek-V4's
    rows of 4096 values (its head), built for sm_90 by Triton and ptxas: no spills."""
    from ds4desk.engine.kernels.quant import gguf_rows_triton as source

    block_n, block_k, warps = gguf_tiles.rows_config(rows, cols)
    args = {"x": "*bf16", "w": "*u8", "out": "*bf16", "norm": "*bf16", "eps": "fp32"}
    args |= {"rows": "i32", "row_bytes": "i32", "x_step": "i32", "w_step": "i32", "out_step": "i32"}
    constants = {"K": cols, "BLOCK_N": block_n, "BLOCK_K": block_k, "PDL": True}
    constants |= {"NORM": form == "norm", "SILU": form == "silu_add", "RESIDUAL": form == "silu_add"}
    aligned = {"x", "w", "out", "norm", "row_bytes"}
    cubin = _compile_for_hopper(source.rows_gemv_kernel, args, constants, aligned, {"num_warps": warps})
    assert _stack_bytes(cubin, tmp_path) in (None, 0), (rows, cols, form)


_EXPERTS_CHECK = """
import itertools
import torch
from ds4desk.engine.kernels.quant import gguf, gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_launch
from ds4desk.engine.kernels.quant import gguf_tiles
from tests.engine.kernels.quant.test_gguf_triton import (
    BY_NAME, accumulation_bound, assert_matches, tame_blocks,
)

gt.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(3)
experts, rows, cols = 5, 40, 512  # 40 rows: no tile of rows divides them
ids = torch.tensor([3, 0, 3, 4], device=device)  # an expert twice; expert 1 and 2 never read
for name in {types}:
    kind = BY_NAME[name]
    stacked = torch.stack([tame_blocks(kind, rows, cols, seed=10 + e) for e in range(experts)]).to(device)
    mats = [gguf.dequantize(stacked[e], kind.type_id, (rows, cols)) for e in range(experts)]
    # Q2_K and Q3_K run on gguf_experts_triton's kernel on a GPU (or forced): its default tiles, and
    # two tiles a row of 16 rows a program (40 rows: the last program's rows past the end).
    one_row = gguf_tiles.EXPERTS_ONE_ROW
    settings = [None, one_row[name], (16, 4, 1)] if name in one_row else [None]
    for setting, dtype in itertools.product(settings, (torch.float32, torch.bfloat16)):
        gguf_tiles.EXPERTS_OVERRIDE = setting
        for inputs in (1, len(ids)):  # one row for every slot (gate, up), a row a slot (down)
            x = torch.randn(inputs, cols, generator=gen).to(device, dtype)
            out = torch.full((len(ids), rows), float("nan"), device=device, dtype=dtype)
            got = gguf_experts.experts_gemv(x, ids, stacked, kind.type_id, cols, out)
            assert got is out
            for slot, expert in enumerate(ids.tolist()):
                row = x[min(slot, inputs - 1)][None]
                want = row.float() @ mats[expert].t()
                bound = accumulation_bound(row, stacked[expert], kind, cols)
                assert_matches(out[slot][None], want, bound, (name, setting, dtype, inputs, slot))
    print("checked", name)
"""


def test_the_experts_gemv_reads_each_slots_expert() -> None:
    """experts_gemv (the decode step's routed experts, read by id in place) against dequantize +
    float32 matmul of each slot's expert, with one input row for all slots and a row a slot."""
    types = ("Q2_K", "Q3_K", "Q4_K", "Q8_0", "MXFP4")
    stdout = run_triton_check(_EXPERTS_CHECK.format(types=types))
    assert all(f"checked {t}" in stdout for t in types)


_EXPERTS_SWIGLU_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4.moe_tail import reference_swiglu
from ds4desk.engine.kernels.quant import gguf, gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_tiles
from tests.engine.kernels.quant.test_gguf_triton import BY_NAME, tame_blocks

gt.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(4)
experts, hidden = 5, 256
ids = torch.tensor([3, 0, 3], device=device)  # an expert twice; experts 1, 2 and 4 never read
# (gate/up type, down type, width, setting): each low-bit type with the other as down (the result in
# down's read order), and a Q8_0 down (in order) whose 96 rows end inside a program of 64. Few
# programs of many rows: Triton's interpreter runs a program's tile at once, a program at a time.
CASES = [
    ("Q2_K", "Q3_K", 256, (64, 4, 1)),
    ("Q3_K", "Q2_K", 256, (128, 2, 1)),
    ("Q2_K", "Q8_0", 96, (64, 2, 1)),
]


def stacked(kind, rows, cols, seed):
    return torch.stack([tame_blocks(kind, rows, cols, seed=seed + e) for e in range(experts)]).to(device)


for name, down_name, width, setting in CASES:
    kind, down_kind = BY_NAME[name], BY_NAME[down_name]
    gguf_tiles.EXPERTS_OVERRIDE = setting
    assert gguf_experts.swiglu_fits(kind.type_id, kind.type_id, hidden, torch.empty(0, device=device))
    assert not gguf_experts.swiglu_fits(kind.type_id, BY_NAME["Q4_K"].type_id, hidden, torch.empty(0))
    gate, up = stacked(kind, width, hidden, 20), stacked(kind, width, hidden, 40)
    down = stacked(down_kind, hidden, width, 60)
    mats = {
        which: [gguf.dequantize(blocks[e].cpu(), kind.type_id, (width, hidden)) for e in range(experts)]
        for which, blocks in (("gate", gate), ("up", up))
    }
    for dtype in (torch.float32, torch.bfloat16):
        for inputs in (1, len(ids)):
            x = torch.randn(inputs, hidden, generator=gen).to(device, dtype)
            rows = [x[min(slot, inputs - 1)].float().cpu() for slot in range(len(ids))]
            g = torch.stack([rows[j] @ mats["gate"][e].t() for j, e in enumerate(ids.tolist())])
            u = torch.stack([rows[j] @ mats["up"][e].t() for j, e in enumerate(ids.tolist())])
            limit = float(g.abs().median())  # about half of the gates and a few ups clamped
            want = reference_swiglu(g.to(dtype), u.to(dtype), limit).float()
            x_read = gguf_experts.experts_input(x, kind.type_id, hidden)
            act = torch.full((len(ids), width), float("nan"), device=device, dtype=dtype)
            positions = gguf_experts.write_order(width, down_kind.type_id, torch.device(device))
            pair = (gate, up, kind.type_id, hidden, limit)
            got = gguf_experts.experts_swiglu(x_read, ids, *pair, act, positions)
            assert got is act and not act.isnan().any()
            in_order = act[:, positions.long()]
            # float32: accumulation order; bfloat16: gate or up a rounding apart, SiLU's and the product's
            tolerance = 1e-4 if dtype == torch.float32 else 2.0**-6
            err = (in_order.float().cpu() - want).abs()
            assert bool((err <= tolerance * (want.abs() + 1e-2 * want.abs().max())).all()), (name, dtype)
            # down reads the result where it was written: as from the in-order rows, bit for bit
            out = torch.empty(len(ids), hidden, device=device, dtype=dtype)
            placed = gguf_experts.experts_gemv(act, ids, down, down_kind.type_id, width, out, ordered=True)
            rows_in_order = in_order.contiguous()
            again = gguf_experts.experts_gemv(rows_in_order, ids, down, down_kind.type_id, width, out.clone())
            assert torch.equal(placed, again), (name, down_name, dtype)
    print("checked", name, down_name)
"""


def test_the_experts_gate_and_up_with_their_swiglu_in_one_kernel() -> None:
    """experts_swiglu (a Q2_K / Q3_K gate and up pair on one tile, the clamped SwiGLU folded in)
    against dequantize + float32 matmuls and the torch SwiGLU on the rounded projections, its result
    where the down projection's kernel reads it; the limit clamps about half of the gates."""
    stdout = run_triton_check(_EXPERTS_SWIGLU_CHECK)
    assert stdout.count("checked") == 3


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "MXFP4"])
def test_the_experts_gemv_compiles_for_an_h200(name: str, tmp_path: object) -> None:
    """The experts form of the GEMV with Flash's expert shapes and its settings for them
    (experts_config) passes Triton's compiler and ptxas for sm_90 and spills nothing."""
    pytest.importorskip("triton")
    from ds4desk.engine.kernels.quant import gguf_blocks_triton as source

    kind = BY_NAME[name]
    sub, unit = gguf_tiles.TILES[name]
    for rows, cols in ((2048, 4096), (4096, 2048)):  # gate / up, down
        block_n, values, warps = gguf_tiles.experts_config(name, rows, cols, sms=132)
        args = {"x": "*bf16", "w": "*u8", "out": "*bf16", "norm": "*bf16", "rows": "i32", "row_bytes": "i32"}
        args |= {"stride_x": "i32", "stride_out": "i32", "eps": "fp32", "c0": "i32", "c1": "i32"}
        args |= {"c2": "i32", "c3": "i32", "ids": "*i64", "expert_bytes": "i32", "x_step": "i32"}
        args |= {"out_step": "i32"}
        constants = {"KIND": kind.type_id, "L": sub, "V": unit, "S": max(values, sub) // sub}
        constants |= {"N_SUB": cols // sub, "COLS": cols, "T": 1, "T_PAD": 1, "BLOCK_N": block_n}
        constants |= {"SILU": False, "NORM": False, "RESIDUAL": False, "PDL": False, "EXPERTS": True}
        cubin = _compile_for_hopper(
            source.gemv_kernel, args, constants, {"x", "w", "out", "ids"}, {"num_warps": warps}
        )
        assert _stack_bytes(cubin, tmp_path) in (None, 0), (name, rows, cols)


@pytest.mark.parametrize("name", list(gguf_tiles.EXPERTS_ONE_ROW))
def test_the_low_bit_experts_kernel_compiles_for_an_h200(name: str, tmp_path: object) -> None:
    """gguf_experts_triton's kernels (one projection; gate and up with their SwiGLU) with Flash's
    expert shapes and their settings (experts_one_row_config), PTX byte conversion included, pass
    Triton's compiler and ptxas for sm_90 and spill nothing."""
    pytest.importorskip("triton")
    from ds4desk.engine.kernels.quant import gguf_experts_triton as source

    for cols in (4096, 2048):  # gate / up, down
        block_n, groups, warps = gguf_tiles.experts_one_row_config(name, cols)
        args = {"x": "*bf16", "ids": "*i64", "w": "*u8", "out": "*bf16", "rows": "i32", "row_bytes": "i32"}
        args |= {"expert_bytes": "i32", "x_step": "i32", "out_step": "i32"}
        constants = {"KIND": BY_NAME[name].type_id, "G": groups, "N_GROUPS": cols // 64}
        constants |= {"BLOCK_N": block_n, "ASM": True}
        cubin = _compile_for_hopper(
            source.experts_kernel, args, constants, {"x", "w", "out", "ids"}, {"num_warps": warps}
        )
        assert _stack_bytes(cubin, tmp_path) in (None, 0), (name, cols)
        if cols == 4096:  # gate and up with their SwiGLU
            pair = {"x": "*bf16", "ids": "*i64", "gate_w": "*u8", "up_w": "*u8", "out": "*bf16"}
            pair |= {"positions": "*i32", "rows": "i32", "row_bytes": "i32", "expert_bytes": "i32"}
            pair |= {"x_step": "i32", "out_step": "i32", "limit": "fp32"}
            aligned = {"x", "gate_w", "up_w", "out", "ids"}
            kernel = source.experts_swiglu_kernel
            cubin = _compile_for_hopper(kernel, pair, constants, aligned, {"num_warps": warps})
            assert _stack_bytes(cubin, tmp_path) in (None, 0), (name, "swiglu")


_SILU_PAIR_CHECK = """
import torch
from ds4desk.engine.kernels.quant import gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_launch
from ds4desk.engine.kernels.quant import gguf_tiles
from tests.engine.kernels.quant.test_gguf_triton import BY_NAME, tame_blocks

gt.SWITCH.forced = True
# every height takes the one-row kernel
gguf_tiles.ONE_ROW_MIN_ROWS = dict.fromkeys(gguf_tiles.ONE_ROW_GROUPS, 0)
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(2)
hidden, ffn = 256, 768  # 12 groups of 64 a down row: tiles of 16 (or 8) groups leave 4 unwritten
# (gate/up type, down type, settings forced on both, dtypes, steps on one buffer): each down type,
# each order of the pair. 16 rows a program: Triton's interpreter runs a program's tile at once,
# and a program at a time.
CASES = [
    ("Q4_K", "Q6_K", (16, 16, 1), (torch.bfloat16, torch.float32), 2),
    ("Q6_K", "Q4_K", (16, 16, 1), (torch.bfloat16,), 1),
    ("Q4_K", "Q4_K", (16, 8, 1), (torch.bfloat16,), 2),
]
q8 = tame_blocks(BY_NAME["Q8_0"], 2 * ffn, hidden, seed=3).to(device)
assert not gt.silu_pair_fits(q8, BY_NAME["Q8_0"].type_id, q8[:hidden], BY_NAME["Q8_0"].type_id)
for gate_up_name, down_name, config, dtypes, steps in CASES:
    gguf_tiles.ONE_ROW_OVERRIDE = config
    gk, dk = BY_NAME[gate_up_name], BY_NAME[down_name]
    gate_up = tame_blocks(gk, 2 * ffn, hidden, seed=3).to(device)
    down = tame_blocks(dk, hidden, ffn, seed=4).to(device)
    assert gt.silu_pair_fits(gate_up, gk.type_id, down, dk.type_id)
    for dtype in dtypes:
        act = gt.prepared_input(down, dk.type_id, ffn)
        for step in range(steps):  # act is reused: what one step leaves must not leak into the next
            x = (torch.randn(1, hidden, generator=gen) * 4).to(device, dtype)
            norm = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
            residual = torch.randn(1, hidden, generator=gen).to(device, dtype)
            out = torch.empty(1, 2 * ffn, device=device, dtype=dtype)
            gt.norm_gemv(x, norm, gate_up, gk.type_id, hidden, 1e-5, out)
            want = gt.gemv_add_(residual.clone(), out, down, dk.type_id, ffn, silu=True)
            fused = torch.empty_like(out)
            gt.norm_gemv_silu(x, norm, gate_up, gk.type_id, hidden, 1e-5, fused, act, down, dk.type_id)
            got = gt.gemv_prepared(act, down, dk.type_id, ffn, residual.clone(), residual=True)
            what = (gate_up_name, down_name, config, dtype, step)
            assert torch.equal(fused, out), what
            assert torch.equal(got, want), (what, float((got.float() - want.float()).abs().max()))
    print("checked", gate_up_name, "->", down_name, flush=True)
# A q/k/v group whose parts differ in type: the normed row, and q's input in read order, at once.
for name in ("Q4_K", "Q6_K"):
    kind = BY_NAME[name]
    q = tame_blocks(kind, 64, hidden, seed=6).to(device)
    x = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, torch.bfloat16)
    row, prepared = gt.normed_row_and_input(x, norm, 1e-5, q, kind.type_id, hidden)
    assert torch.equal(row, gt.normed_row(x, norm, 1e-5))
    want = gt.gemv(row, q, kind.type_id, hidden, torch.empty(1, 64, device=device, dtype=torch.bfloat16))
    got = gt.gemv_prepared(prepared, q, kind.type_id, hidden, torch.empty_like(want))
    assert torch.equal(got, want), name
    print("checked", name, "q/k/v input", flush=True)
print("silu pair ok")
"""


def test_the_gate_up_gemv_writes_the_down_input_bit_for_bit() -> None:
    """norm_gemv_silu (a program takes gate rows and the up rows of the same units and writes
    SiLU(gate) · up in the down projection's read order) then gemv_prepared give exactly what
    norm_gemv then gemv_add_(silu=True) give, with a down row whose groups the tile does not divide
    (entries never written) and a buffer used twice; and normed_row_and_input gives normed_row's
    row plus the input gemv_prepared needs for the same result as gemv on that row."""
    stdout = run_triton_check(_SILU_PAIR_CHECK)
    assert "silu pair ok" in stdout and stdout.count("checked") == 5


# --- compiled for an H200 without one: Triton's own compiler and ptxas, no GPU needed ---------------


def _compile_for_hopper(
    kernel: object,
    args: dict[str, str],
    constants: dict[str, object],
    aligned: set[str],
    options: dict,
    stage: str = "cubin",
) -> bytes | str:
    """The cubin (or another stage: "ttgir") of a Triton kernel compiled for sm_90 ahead of time (no
    GPU needed). `aligned`: the arguments a launch would mark divisible by 16, as Triton does for
    16-byte aligned tensors and integers that are multiples of 16."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**args, **dict.fromkeys(constants, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(args) if arg in aligned}
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm[stage]


def _stack_bytes(cubin: bytes, tmp_path: object) -> int | None:
    """The local memory (spills) a compiled kernel uses, from cuobjdump (None where it is missing)."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists() and shutil.which("cuobjdump") is None:
        return None
    path = Path(str(tmp_path)) / "kernel.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run(
        [str(tool if tool.exists() else "cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True
    )
    found = re.findall(r"STACK:(\d+)", usage.stdout)
    return max(int(v) for v in found) if found else None


HOPPER_CASES = [(name, "bf16", 1, "plain") for name in COVERED] + [
    (name, dtype, t, form)
    for name in ("Q8_0", "Q4_K", "Q6_K")
    for dtype, t, form in (
        ("fp32", 1, "plain"),
        ("fp16", 1, "plain"),
        ("bf16", 4, "plain"),
        ("bf16", 1, "silu_add"),
        ("bf16", 1, "norm"),
    )
]


@pytest.mark.parametrize(("name", "dtype", "t", "form"), HOPPER_CASES)
def test_the_kernels_compile_for_an_h200(name: str, dtype: str, t: int, form: str, tmp_path: object) -> None:
    """What the interpreter cannot show: the kernels pass Triton's GPU compiler and ptxas for sm_90
    (the H200) with the launch settings of the benchmark model's shapes, and spill nothing."""
    pytest.importorskip("triton")
    from ds4desk.engine.kernels.quant import gguf_blocks_triton as source

    kind = BY_NAME[name]
    sub, unit = gguf_tiles.TILES[name]
    rows, cols = (512, 2048) if t > 1 else (2048, 8192 if form == "silu_add" else 2048)
    block_n, values, warps = gguf_tiles.gemv_config(rows, cols, sms=132)
    row_bytes = gguf_triton.gguf_packed_bytes(kind.type_id, (cols,))
    pointer = f"*{dtype}"
    args = {"x": pointer, "w": "*u8", "out": pointer, "norm": pointer, "rows": "i32", "row_bytes": "i32"}
    args |= {"stride_x": "i32", "stride_out": "i32", "eps": "fp32", "c0": "i32", "c1": "i32", "c2": "i32"}
    args |= {"c3": "i32"}
    constants = {
        "KIND": kind.type_id,
        "L": sub,
        "V": unit,
        "S": values // sub,
        "N_SUB": cols // sub,
        "COLS": cols,
        "T": t,
        "T_PAD": t,
        "BLOCK_N": block_n,
        "SILU": form == "silu_add",
        "NORM": form == "norm",
        "RESIDUAL": form == "silu_add",
        "PDL": form != "plain",  # as launched on Hopper (launch.PDL)
    }
    aligned = {"x", "w", "out", "norm"} | ({"row_bytes"} if row_bytes % 16 == 0 else set())
    gemv = _compile_for_hopper(source.gemv_kernel, args, constants, aligned, {"num_warps": warps})
    stack = _stack_bytes(gemv, tmp_path)
    assert stack in (None, 0), (name, "gemv spills", stack)
    if t == 1 and form == "plain":
        args = {"w": "*u8", "out": pointer, "rows": "i32", "row_bytes": "i32", "stride_out": "i32"}
        args |= {"c0": "i32", "c1": "i32", "c2": "i32", "c3": "i32"}
        constants = {"KIND": kind.type_id, "L": sub, "V": unit, "S": 256 // sub, "N_SUB": cols // sub}
        constants["BLOCK_N"] = gguf_tiles.DEQUANT_BLOCK_N
        options = {"num_warps": 4, "enable_fp_fusion": False}
        aligned = {"w", "out", "stride_out"} | ({"row_bytes"} if row_bytes % 16 == 0 else set())
        dequantize = _compile_for_hopper(source.dequantize_kernel, args, constants, aligned, options)
        assert _stack_bytes(dequantize, tmp_path) in (None, 0), (name, "dequantize spills")


def _group_axis_layouts(ttgir: str, groups: int, rows: int) -> set[tuple[str, str, str]]:
    """How each float [groups, rows] tile of compiled TTGIR is spread over the group axis (axis 0 of
    sizePerThread, threadsPerWarp, warpsPerCTA): that fixes the order in which a row is summed."""
    import re

    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*)>$", ttgir, re.M))
    used = set(re.findall(rf"tensor<{groups}x{rows}xf32, (#\w+)>", ttgir))
    assert used, "no float tile of that shape"
    spread = set()
    for name in used:
        fields = dict(re.findall(r"(\w+) = \[(\d+), \d+\]", layouts[name]))
        spread.add((fields["sizePerThread"], fields["threadsPerWarp"], fields["warpsPerCTA"]))
    return spread


@pytest.mark.parametrize(("name", "down"), [("Q4_K", "Q6_K"), ("Q6_K", "Q4_K")])
@pytest.mark.parametrize("setting", ["pair check", "model"])
def test_the_paired_gate_up_gemv_sums_its_rows_as_the_plain_one(name: str, down: str, setting: str) -> None:
    """On a GPU the paired gate | up GEMV (norm_gemv_silu) equals the plain one bit for bit only if
    both forms sum a row in the same order, i.e. spread their [groups, rows] tiles alike over the
    group axis. test_the_gate_up_gemv_writes_the_down_input_bit_for_bit checks the values, but
    without a GPU it runs in Triton's interpreter, where every layout sums alike; this reads the
    layouts Triton picks for sm_90. (16-byte weight loads in inline PTX once took the weight tile's
    loads out of Triton's coalescing pass, spread the rows instead of the groups over the threads,
    differently in each form, and broke the equality on an H100.)"""
    pytest.importorskip("triton")
    from ds4desk.engine.kernels.quant import gguf_gemv1_triton as source

    kind, down_kind = BY_NAME[name], BY_NAME[down]
    hidden = 256 if setting == "pair check" else 2048  # _SILU_PAIR_CHECK's, the benchmark model's
    block_n, groups, warps = (
        (16, 16, 1) if setting == "pair check" else gguf_tiles.one_row_config(name, 16384, 2048)
    )
    args = {"x": "*fp32", "w": "*u8", "out": "*fp32", "rows": "i32", "row_bytes": "i32"}
    constants = {"KIND": kind.type_id, "G": groups, "N_GROUPS": hidden // 64, "BLOCK_N": block_n}
    constants |= {"RESIDUAL": False, "PDL": True, "ASM": True}
    aligned = {"x", "w", "out"}
    options = {"num_warps": warps}
    plain = _compile_for_hopper(source.gemv1_kernel, args, constants, aligned, options, "ttgir")
    paired_args = args | {"act": "*fp32", "half_rows": "i32"}
    paired_constants = constants | {"BLOCK_N": 2 * block_n, "PAIRED": True}
    paired_constants |= {"ACT_KIND": down_kind.type_id, "ACT_G": groups}
    paired = _compile_for_hopper(
        source.gemv1_kernel, paired_args, paired_constants, aligned | {"act"}, options, "ttgir"
    )
    assert _group_axis_layouts(plain, groups, block_n) == _group_axis_layouts(paired, groups, 2 * block_n)


@pytest.mark.parametrize(
    ("name", "rows", "cols"),
    [(n, r, c) for n in ("Q8_0", "Q4_K", "Q6_K") for r, c in ((8192, 2048), (2048, 8192), (49152, 2048))],
)
def test_the_one_row_kernel_compiles_for_an_h200(name: str, rows: int, cols: int, tmp_path: object) -> None:
    """The one-row GEMV (with its PTX byte conversion) and its input kernel pass Triton's compiler
    and ptxas for sm_90 with the settings of the benchmark model's shapes, and spill nothing."""
    pytest.importorskip("triton")
    from ds4desk.engine.kernels.quant import gguf_gemv1_triton as source

    kind = BY_NAME[name]
    block_n, groups, warps = gguf_tiles.one_row_config(name, rows, cols)
    read_order = name in gguf_tiles.READ_ORDER_TYPES
    x_type = "*fp32" if read_order else "*bf16"
    args = {"x": x_type, "w": "*u8", "out": "*bf16", "rows": "i32", "row_bytes": "i32"}
    n_groups = cols // gguf_tiles.ONE_ROW_GROUPS[name]
    constants = {
        "KIND": kind.type_id,
        "G": groups,
        "N_GROUPS": n_groups,
        "BLOCK_N": block_n,
        "RESIDUAL": True,
        "PDL": True,
        "ASM": True,
    }
    row_bytes = gguf_triton.gguf_packed_bytes(kind.type_id, (cols,))
    aligned = {"x", "w", "out"} | ({"row_bytes"} if row_bytes % 16 == 0 else set())
    gemv = _compile_for_hopper(source.gemv1_kernel, args, constants, aligned, {"num_warps": warps})
    assert _stack_bytes(gemv, tmp_path) in (None, 0), (name, "one-row gemv spills")
    if read_order and cols == 2048 and rows < 32768:  # a gate | up: its paired form (norm_gemv_silu)
        paired_args = args | {"act": "*fp32", "half_rows": "i32"}
        paired = constants | {"BLOCK_N": 2 * block_n, "PAIRED": True}
        paired |= {"ACT_KIND": kind.type_id, "ACT_G": groups}
        options = {"num_warps": warps}
        gemv = _compile_for_hopper(source.gemv1_kernel, paired_args, paired, aligned | {"act"}, options)
        assert _stack_bytes(gemv, tmp_path) in (None, 0), (name, "paired gate/up gemv spills")
    order = {"KIND": kind.type_id, "G": groups, "V": gguf_tiles.ONE_ROW_GROUPS[name], "N_GROUPS": n_groups}
    for mode in (gguf_tiles.INPUT_COPY, gguf_tiles.INPUT_NORM, gguf_tiles.INPUT_SILU):
        for ordered in (False, True) if read_order else (False,):
            out = "*fp32" if ordered else "*bf16"
            args = {"x": "*bf16", "norm": "*bf16", "out": out, "eps": "fp32"}
            constants = {"COLS": cols, "BLOCK": cols, "MODE": mode, "PDL": True}
            constants |= order | {"OUT_BLOCK": cols if ordered else 0}
            kernel = _compile_for_hopper(
                source.input_kernel, args, constants, {"x", "norm", "out"}, {"num_warps": 16}
            )
            assert _stack_bytes(kernel, tmp_path) in (None, 0), (name, "input kernel spills", mode, ordered)


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
        # Prefill (more than GEMV_MAX_ROWS rows) multiplies the weight rounded to bfloat16, in cuBLAS,
        # which may add bfloat16 products in reduced precision.
        prefill = t > gguf_tiles.GEMV_MAX_ROWS
        want = x.float() @ (w.bfloat16().float() if prefill else w).t()
        bound = accumulation_bound(x, raw, kind, cols)
        assert_matches(out, want, bound, (name, t, rows, cols), 2.0**-7 if prefill else 0.0)
    scratch = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gguf_triton.dequantize_into(raw, kind.type_id, cols, scratch), w.bfloat16())


@needs_nvidia_gpu
@pytest.mark.parametrize("name", ["Q8_0"])
@pytest.mark.parametrize(("rows", "cols"), MODEL_SHAPES)
def test_the_row_layouts_on_the_model_shapes(name: str, rows: int, cols: int) -> None:
    kind = BY_NAME[name]
    layout = ROW_LAYOUTS[kind.type_id][0].type_id
    blocks = tame_blocks(kind, rows, cols, seed=rows).cuda()
    raw = gguf.device_rows(blocks, kind.type_id, cols)
    w = gguf.dequantize(blocks, kind.type_id, (rows, cols))
    assert torch.equal(gguf.dequantize(raw, layout, (rows, cols)), w)
    for t in (1, 4, 300):
        x = torch.randn(t, cols, device="cuda", dtype=torch.bfloat16)
        out = gguf_matmul(x, raw, layout, cols)
        prefill = t > gguf_tiles.GEMV_MAX_ROWS
        want = x.float() @ (w.bfloat16().float() if prefill else w).t()
        bound = accumulation_bound(x, blocks, kind, cols)
        assert_matches(out, want, bound, (name, t, rows, cols), 2.0**-7 if prefill else 0.0)
    x, norm = torch.randn(1, cols, device="cuda"), torch.rand(cols, device="cuda") + 0.5
    normed = torch.nn.functional.rms_norm(x, (cols,), norm, 1e-5)
    out = torch.empty(1, rows, device="cuda")
    gguf_triton.norm_gemv(x, norm, raw, layout, cols, 1e-5, out)
    assert_matches(out, normed @ w.t(), accumulation_bound(normed, blocks, kind, cols), (name, rows, "norm"))


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
