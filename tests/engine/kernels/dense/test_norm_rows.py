"""A prefill chunk's RMSNorm with a float32 scale (norm_rows): the torch form is Qwen3.5's centred
norm, a bad shape gets a clear error, the Triton kernel (on CUDA, or Triton's CPU interpreter) equals
the torch form on wide, narrow and strided rows, and a Qwen3.5 prefill through it equals the torch
ops; the kernel compiles for Hopper without spills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.dense import norm_rows
from tests.engine.triton_check import hopper_ptxas_report, run_triton_check


def test_the_reference_is_the_float32_norm_times_the_scale_rounded_once() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=gen).to(torch.bfloat16)
    weight = 0.1 * torch.randn(24, generator=gen)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight)).to(
        torch.bfloat16
    )
    got = norm_rows.reference(x, 1 + weight, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-6)


def test_the_cpu_takes_the_torch_form_by_default() -> None:
    x, scale = torch.randn(3, 8), torch.rand(8)
    assert norm_rows.SWITCH.forced is None and not norm_rows.enabled(x)
    assert torch.equal(norm_rows.scaled_rms_norm(x, scale, 1e-6), norm_rows.reference(x, scale, 1e-6))


@pytest.mark.parametrize(("x_shape", "scale_shape"), [((4, 8), (7,)), ((8,), (8,)), ((2, 3, 4), (4,))])
def test_a_bad_shape_gets_a_clear_error(x_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="x must be"):
        norm_rows.scaled_rms_norm(torch.zeros(x_shape), torch.ones(scale_shape), 1e-6)


_CHECK = """
import torch
from ds4desk.engine.kernels.dense import norm_rows

device = "cuda" if torch.cuda.is_available() else "cpu"
norm_rows.SWITCH.forced = True
gen = torch.Generator().manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    # A wide row alone (1,000 columns: a partial tile), narrow rows in groups (67 rows of 48: a
    # partial group), a head's query inside a query-and-gate row (stride 2D), an empty chunk.
    for rows, width, stride in ((3, 1000, 1000), (67, 48, 48), (20, 32, 64), (0, 16, 16)):
        base = (3 * torch.randn(rows, stride, generator=gen)).to(dtype).to(device)
        x = base[:, :width]
        scale = (1 + 0.2 * torch.randn(width, generator=gen)).to(device)
        ours, want = norm_rows.scaled_rms_norm(x, scale, 1e-6), norm_rows.reference(x, scale, 1e-6)
        assert ours.dtype == dtype and ours.shape == (rows, width) and ours.is_contiguous()
        # float32: the sum's order differs. bf16: one rounding step apart at most.
        tol = 1e-5 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(ours.float(), want.float(), rtol=tol, atol=1e-5)
print("norm ok")
"""


def test_the_triton_kernel_equals_the_torch_form() -> None:
    assert "norm ok" in run_triton_check(_CHECK)


def test_a_qwen35_prefill_through_the_kernel_equals_the_torch_ops(tmp_path) -> None:
    script = f"""
import pathlib, torch
from ds4desk.engine.kernels.dense import norm_rows
from ds4desk.engine.loader import load_model
from tests.engine.models.qwen3_5.tiny import as_source, save_tiny

folder = pathlib.Path({str(tmp_path)!r})
save_tiny(folder, seed=3)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
outs = []
for on in (False, True):
    with norm_rows.SWITCH.force(on):
        model = load_model(as_source(folder), device, torch.float32).model
        model.allocate_cache(64)
        with torch.inference_mode():
            outs.append(model.forward(torch.arange(3, 40, device=device), 0, "all"))
# The sums' order differs: within the 1e-4 the model is held to against transformers.
torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
print("prefill ok")
"""
    assert "prefill ok" in run_triton_check(script)


def test_the_torch_form_matches_f_rms_norm_with_a_weight_in_float32() -> None:
    x, weight = torch.randn(6, 40), torch.randn(40)
    torch.testing.assert_close(
        norm_rows.reference(x, weight, 1e-5), F.rms_norm(x, (40,), weight, 1e-5), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("width", [4096, 256, 128])
def test_the_kernel_compiles_for_hopper_without_spills(tmp_path: Path, width: int) -> None:
    """The interpreter never compiles: the bf16 launch at Qwen3.5-9B's hidden width and head widths,
    compiled for sm_90 ahead of time (no GPU needed), then ptxas: no register spills."""
    constants: dict[str, object] = dict(norm_rows.launch_constants(width))
    warps = constants.pop("num_warps")
    signature = {
        "x": "*bf16",
        "scale": "*fp32",
        "out": "*bf16",
        "rows": "i32",
        "in_stride": "i32",
        "eps": "fp32",
    }
    report = hopper_ptxas_report(tmp_path, norm_rows.jit_kernel(), signature, constants, int(warps))
    assert "0 bytes spill stores" in report, report
