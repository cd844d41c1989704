"""DeepSeek-V4's grouped output projection held in FP8, as the official checkpoint stores o_a:
ops.grouped_low_rank equals group g's heads times its rows of the dequantized weight, for one row
(the one-row FP8 kernel reading each group's own columns), a few rows (an FP8 GEMV a group) and a
prefill chunk (the weight dequantized), on the CPU's torch forms and on the kernels (Triton's
interpreter without a GPU)."""

from __future__ import annotations

import torch

from ds4desk.engine.make_tiny import TINY_CONFIG
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.modules import Fp8Weight
from tests.engine.kernels.quant.samples import fp8_weight, rel_error
from tests.engine.triton_check import run_triton_check

GROUPS, RANK, COLUMNS = 4, 128, 256  # out [T, 8 heads, 128]: two heads (256 columns) a group


def fp8_holder(seed: int) -> tuple[Fp8Weight, torch.Tensor]:
    """An FP8 o_a of GROUPS x RANK rows by COLUMNS and its float32 dequantized reference."""
    q, scale, reference = fp8_weight(GROUPS * RANK, COLUMNS, seed=seed)
    holder = Fp8Weight((GROUPS * RANK, COLUMNS))
    holder.weight.data, holder.weight_scale_inv.data = q, scale
    return holder, reference


def by_group(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The projection in float32: group g's heads (side by side) times rows g RANK .. (g + 1) RANK."""
    grouped = out.float().reshape(out.shape[0], GROUPS, COLUMNS)
    return torch.cat([grouped[:, g] @ reference[g * RANK : (g + 1) * RANK].t() for g in range(GROUPS)], 1)


def test_a_quantized_model_keeps_o_a_in_fp8() -> None:
    config = DeepseekV4Config.from_hf(TINY_CONFIG)
    with torch.device("meta"):
        quantized = DeepseekV4Model(config, torch.bfloat16, quantized=True)
        plain = DeepseekV4Model(config, torch.bfloat16)
    for layer in quantized.model.layers:
        assert isinstance(layer.self_attn.o_a_proj, Fp8Weight)
    assert all(layer.self_attn.o_a_proj.weight.dtype == torch.bfloat16 for layer in plain.model.layers)


def test_the_torch_forms_equal_the_dequantized_product() -> None:
    holder, reference = fp8_holder(seed=5)
    gen = torch.Generator().manual_seed(0)
    for count in (1, 3, 40):
        out = torch.randn(count, 8, 128, generator=gen)
        got = ops.grouped_low_rank(out, holder, GROUPS)
        assert got.shape == (count, GROUPS * RANK)
        assert rel_error(got, by_group(out, reference)) < 1e-6, count


_KERNELS_CHECK = """
import torch
from ds4desk.engine.kernels.quant import fp8
from ds4desk.engine.models.deepseek_v4 import ops
from tests.engine.kernels.quant.samples import rel_error
from tests.engine.models.deepseek_v4.test_grouped_fp8 import GROUPS, by_group, fp8_holder
from tests.engine.op_names import OpNames

fp8.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
grouped_rows = []
real = fp8.fp8_row_
fp8.fp8_row_ = lambda *args, **kwargs: grouped_rows.append(kwargs.get("groups")) or real(*args, **kwargs)
holder, reference = fp8_holder(seed=9)
holder.to(device)
gen = torch.Generator().manual_seed(1)
for count in (1, 3):
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.randn(count, 8, 128, generator=gen).to(device, dtype)
        seen = OpNames()
        with seen:
            got = ops.grouped_low_rank(out, holder, GROUPS)
        error = rel_error(got, by_group(out, reference.to(device)))
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3
        assert got.dtype == dtype and error < tolerance, (count, dtype, error)
        print("checked", count, str(dtype)[6:], seen.names.count("fp8_gemv"), grouped_rows)
        grouped_rows.clear()
"""


def test_one_row_runs_the_grouped_row_kernel_and_a_few_rows_a_gemv_a_group() -> None:
    stdout = run_triton_check(_KERNELS_CHECK)
    for dtype in ("float32", "bfloat16"):
        assert f"checked 1 {dtype} 0 [4]" in stdout  # one launch, the four groups in it
        assert f"checked 3 {dtype} {GROUPS} []" in stdout  # one FP8 GEMV a group
