"""Qwen3.5's write strengths and log-decays over a prefill's rows (qwen35_gates): the reference is the
formula, with padding rows zeroed; the op is one op; bad arguments get clear errors; the Triton
kernel (on CUDA, or Triton's CPU interpreter) equals the reference on strided rows, odd head counts
and padding; and a padded prompt piece of the tiny model through the input-stage kernels (this one,
the convolution's and the delta rule's) equals the same piece on the eager ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.qwen3_5 import gates
from tests.engine.kernels.qwen3_5.test_linear_decode import relative_error
from tests.engine.op_names import OpNames
from tests.engine.triton_check import hopper_ptxas_report, run_triton_check


def gate_inputs(
    rows: int, heads: int, dtype: torch.dtype, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """b and a as column ranges of one wider projection output (rows at a stride, as a fused
    projection's would be), -exp(A_log) and dt_bias as a checkpoint's."""
    gen = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(rows, 2 * heads + 5, generator=gen)).to(device, dtype)
    wide[0, heads + 1] = 30.0  # softplus's linear side (above its threshold of 20)
    neg_rate = -torch.rand(heads, generator=gen).mul(16).exp().to(device)
    dt_bias = torch.randn(heads, generator=gen).to(device)
    return wide[:, :heads], wide[:, heads + 1 : 2 * heads + 1], neg_rate, dt_bias


def test_the_reference_is_the_formula_and_zeroes_padding() -> None:
    b, a, neg_rate, dt_bias = gate_inputs(6, 3, torch.float32, seed=1, device=torch.device("cpu"))
    beta, decay = gates.reference(b, a, neg_rate, dt_bias)
    wide = {"dtype": torch.float64}
    torch.testing.assert_close(beta, (1 / (1 + torch.exp(-b.to(**wide)))).float())
    x = a.to(**wide) + dt_bias.to(**wide)
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(decay, (neg_rate.to(**wide) * softplus).float())
    assert (decay <= 0).all()
    padded_beta, padded_decay = gates.reference(b, a, neg_rate, dt_bias, torch.tensor([4]))
    assert torch.equal(padded_beta[:4], beta[:4]) and torch.equal(padded_decay[:4], decay[:4])
    assert not padded_beta[4:].any() and not padded_decay[4:].any()


def test_the_op_is_one_op_with_the_reference_result() -> None:
    arguments = gate_inputs(7, 4, torch.bfloat16, seed=2, device=torch.device("cpu"))
    real = torch.tensor([5])
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = gates.gates(*arguments, real=real)
    assert seen.names == ["qwen35_gates"]  # what a graph capture or an op counter sees
    expected = gates.reference(*arguments, real=real)
    for got, want in zip(ours, expected, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_bad_arguments_get_a_clear_error() -> None:
    b, a, neg_rate, dt_bias = gate_inputs(4, 3, torch.float32, seed=3, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="must match"):
        gates.gates(b, a[:, :2], neg_rate, dt_bias)
    with pytest.raises(ValueError, match="neg_rate"):
        gates.gates(b, a, neg_rate.double(), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        gates.gates(b, a, neg_rate, dt_bias[:2])
    with pytest.raises(ValueError, match="real"):
        gates.gates(b, a, neg_rate, dt_bias, torch.tensor([2, 3]))


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert gates.SWITCH.forced is None and not gates.enabled(torch.zeros(1))


def check_kernel(device: torch.device) -> None:
    """The kernel against the reference: float32 to rounding, bf16 within one of its steps (the
    sigmoid is rounded to bf16 on both sides, from float32 values that may differ in the last bit)."""
    launch = gates._triton_kernel()
    assert launch is not None
    for rows, heads, real in ((1, 32, None), (37, 32, None), (64, 32, 33), (19, 9, 19), (5, 9, 1)):
        for dtype in (torch.float32, torch.bfloat16):
            b, a, neg_rate, dt_bias = gate_inputs(rows, heads, dtype, seed=rows, device=device)
            at = None if real is None else torch.tensor([real], device=device)
            got = launch(b, a, neg_rate, dt_bias, at)
            expected = gates.reference(b, a, neg_rate, dt_bias, at)
            for name, ours, want in zip(("beta", "decay"), got, expected, strict=True):
                where = (rows, heads, real, dtype, name)
                assert ours.dtype == torch.float32 and ours.shape == want.shape, where
                tol = 1e-5 if dtype == torch.float32 or name == "decay" else 1e-2
                assert relative_error(ours, want) < tol, (where, relative_error(ours, want))
                if real is not None:
                    assert not ours[real:].any(), where


def check_padded_piece(path: str) -> None:
    """The tiny model's padded prompt piece (prefill_graphable: 16 rows, 9 real, continuing a prefill)
    with the convolution, gates and delta-rule kernels forced on (the interpreter on the CPU) against
    the same on the eager ops: logits at the last real token and the state it leaves."""
    from ds4desk.engine.kernels import launch
    from ds4desk.engine.kernels.qwen3_5 import causal_conv, chunked_delta
    from ds4desk.engine.loader import load_model
    from ds4desk.engine.loading.detect import read_source
    from tests.engine.kernels.qwen3_5.test_linear_decode import CONTEXT, tokens

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    switches = (causal_conv.SWITCH, gates.SWITCH, chunked_delta.SWITCH)
    for switch in switches:
        switch.kernel_on_cpu = True
    ids = torch.tensor(tokens(37, seed=12), device=device)
    piece = torch.cat((ids[30:], ids[:9]))  # 7 real tokens, then junk
    results = []
    for flag in (True, False):
        model = load_model(read_source(Path(path)), device, torch.float32).model
        model.allocate_cache(CONTEXT)
        with launch.force(dict.fromkeys(switches, flag)), torch.inference_mode():
            model.forward(ids[:30], 0, "none")
            at, real = torch.tensor([30], device=device), torch.tensor([7], device=device)
            logits = model.prefill_graphable(piece, at, real, span=64)
            assert logits is not None
            model.set_length(37)
            results.append((logits, model.export_state(37)))
    (ours, our_state), (eager, eager_state) = results
    assert relative_error(ours, eager) < 1e-5, relative_error(ours, eager)
    for name, value in eager_state.items():
        assert relative_error(our_state[name], value) < 1e-5, name


_KERNEL_CHECK = """
import torch
from tests.engine.kernels.qwen3_5.test_gates import check_kernel

check_kernel(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
print("triton ok")
"""


def test_the_triton_kernel_equals_the_reference() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter. Skipped without Triton."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


@pytest.mark.parametrize("layout", ["folder", "gguf"])
def test_a_padded_prompt_piece_through_the_kernels_equals_the_eager_ops(tmp_path: Path, layout: str) -> None:
    """Both key-head orders: a folder's (value heads grouped by key head) and a GGUF's (tiled)."""
    from tests.engine.kernels.qwen3_5.test_linear_decode import write_tiny_folder, write_tiny_gguf

    path = write_tiny_folder(tmp_path / "hf") if layout == "folder" else write_tiny_gguf(tmp_path)
    script = "from tests.engine.kernels.qwen3_5.test_gates import check_padded_piece\n"
    script += f"check_padded_piece({str(path)!r})\nprint('piece ok')\n"
    assert "piece ok" in run_triton_check(script)


@pytest.mark.parametrize("has_real", [False, True])
def test_the_kernel_compiles_for_hopper_without_spills(tmp_path: Path, has_real: bool) -> None:
    """The interpreter never compiles: the bf16 launch at Qwen3.5-9B's 32 value heads, compiled for
    sm_90 ahead of time (no GPU needed), then ptxas: no register spills."""
    signature = {"b": "*bf16", "a": "*bf16", "neg_rate": "*fp32", "dt_bias": "*fp32", "real": "*i64"}
    signature |= {
        "beta_out": "*fp32",
        "decay_out": "*fp32",
        "rows": "i32",
        "b_stride": "i32",
        "a_stride": "i32",
    }
    constants = {"H": 32, "BLOCK_H": 32, "BLOCK_T": gates.BLOCK_T, "HAS_REAL": has_real, "THRESHOLD": 20.0}
    report = hopper_ptxas_report(tmp_path, gates._jit_kernel(), signature, constants, warps=4)
    assert "0 bytes spill stores" in report, report
