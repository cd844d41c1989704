"""DeepSeek-V4's linears on a GGUF's blocks (modules.linear_weight -> PackedLinear): ops.linear, the
grouped low-rank output projection (ops.grouped_low_rank) and the compressor's projections equal the
same math on the dequantized weight, on the CPU (gguf_matmul) and on the GGUF kernels (Triton's
interpreter without a GPU), where one row of the grouped projection goes through the experts GEMV
with the groups as its slots."""

from __future__ import annotations

import torch

from ds4desk.engine.formats import GGUF_TYPES
from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.modules import Compressor, Weight, linear_weight
from ds4desk.engine.models.packed import PackedLinear
from tests.engine.kernels.quant.test_gguf_triton import tame_blocks
from tests.engine.triton_check import run_triton_check

BY_NAME = {t.name: t for t in GGUF_TYPES.values()}


def _pair(name: str, rows: int, cols: int) -> tuple[PackedLinear, Weight]:
    """A packed weight of type `name` and its float32 dequantized twin."""
    kind = BY_NAME[name]
    blocks = tame_blocks(kind, rows, cols, seed=rows + cols)
    packed = linear_weight((rows, cols), torch.float32, False, {"w.weight": kind.type_id}, "w")
    assert isinstance(packed, PackedLinear)
    packed.weight.data = blocks
    twin = Weight((rows, cols), torch.float32)
    twin.weight.data = gguf.dequantize(blocks, kind.type_id, (rows, cols))
    return packed, twin


def test_linear_weight_is_packed_only_where_the_file_stores_blocks() -> None:
    packed = linear_weight((64, 256), torch.bfloat16, True, {"a.weight": BY_NAME["Q8_0"].type_id}, "a")
    assert isinstance(packed, PackedLinear) and packed.weight.dtype == torch.uint8
    assert packed.weight.shape == (64, 256 // 32 * 34)
    fp8 = linear_weight((64, 256), torch.bfloat16, True, {"a.weight": 8}, "b")
    assert fp8.weight.dtype == torch.float8_e4m3fn
    assert linear_weight((64, 256), torch.bfloat16, False, None, "a").weight.dtype == torch.bfloat16


def test_packed_linears_equal_their_dequantized_twins_on_the_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    for name in ("Q8_0", "Q4_K", "Q2_K"):
        packed, twin = _pair(name, 48, 256)
        x = torch.randn(3, 5, 256, generator=gen)  # any leading shape
        got, want = ops.linear(x, packed), ops.linear(x, twin)
        assert got.shape == (3, 5, 48)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        grouped_packed, grouped_twin = _pair(name, 4 * 16, 256)  # 4 groups of rank 16, 256 columns each
        out = torch.randn(6, 8, 128, generator=gen)  # [T, H, d]: 8 heads, 2 a group
        got = ops.grouped_low_rank(out, grouped_packed, 4)
        torch.testing.assert_close(got, ops.grouped_low_rank(out, grouped_twin, 4), rtol=1e-4, atol=1e-4)
        assert got.shape == (6, 64)


_ONE_ROW_CHECK = """
import torch
from ds4desk.engine.kernels.quant import gguf_triton
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.models.deepseek_v4 import ops
from tests.engine.models.deepseek_v4.test_packed_linears import _pair

gguf_triton.SWITCH.forced = True
calls = []
real = gguf_experts.experts_gemv
gguf_experts.experts_gemv = lambda *args: calls.append(1) or real(*args)
device = "cuda" if torch.cuda.is_available() else "cpu"
for name in ("Q8_0", "Q2_K"):
    packed, twin = _pair(name, 4 * 16, 256)
    packed.to(device), twin.to(device)
    out = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(1)).to(device)
    got = ops.grouped_low_rank(out, packed, 4)
    torch.testing.assert_close(got, ops.grouped_low_rank(out, twin, 4), rtol=1e-4, atol=1e-4)
    print("checked", name, len(calls))
"""


def test_one_row_of_the_grouped_projection_reads_the_groups_as_expert_slots() -> None:
    stdout = run_triton_check(_ONE_ROW_CHECK)
    assert "checked Q8_0 1" in stdout and "checked Q2_K 2" in stdout


def test_a_compressors_packed_projections_fuse_and_equal_their_twins() -> None:
    """The decode step's compressor projections (compress_step.projections) on a GGUF's blocks: kv
    and gate of one type fuse into one packed matmul, of two types stay two; both equal the float
    twin's."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 256, generator=gen)
    for kv_type, gate_type in (("Q8_0", "Q8_0"), ("Q8_0", "Q4_K")):
        types = {"c.kv_proj.weight": BY_NAME[kv_type].type_id}
        types["c.gate_proj.weight"] = BY_NAME[gate_type].type_id
        with torch.device("meta"):
            packed = Compressor(256, 32, 4, True, torch.float32, types, "c")
            twin = Compressor(256, 32, 4, True, torch.float32)
        packed, twin = packed.to_empty(device="cpu"), twin.to_empty(device="cpu")
        v4_compress_step.fuse_projections(packed)
        assert hasattr(packed, "fused_proj") == (kv_type == gate_type)
        for name, kind in (("kv_proj", kv_type), ("gate_proj", gate_type)):
            blocks = tame_blocks(BY_NAME[kind], 64, 256, seed=len(name))
            getattr(packed, name).weight.data.copy_(blocks)  # in place: the fused tensor's halves
            getattr(twin, name).weight.data = gguf.dequantize(blocks, BY_NAME[kind].type_id, (64, 256))
        want = (x @ twin.kv_proj.weight.t(), x @ twin.gate_proj.weight.t())
        for got, wanted in zip(v4_compress_step.projections(packed, x), want, strict=True):
            torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)
