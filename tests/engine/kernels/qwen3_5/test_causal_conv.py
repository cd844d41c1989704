"""Qwen3.5's causal convolution + silu over a prefill chunk (qwen35_causal_conv): the reference is
the model's eager convolution op for op, the op is one op, the model's prefill through it equals its
eager prefill (logits and the kept windows), and the Triton kernel (on CUDA, or Triton's CPU
interpreter) equals the reference at Qwen3.5-9B's channel count and at small odd shapes, on rows and
windows that are views into wider tensors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.qwen3_5 import causal_conv
from tests.engine.kernels.qwen3_5.test_linear_decode import (
    load_tiny,
    relative_error,
    tokens,
    write_tiny_folder,
)
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check


def conv_inputs(
    rows: int, channels: int, taps: int, dtype: torch.dtype, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs [T, C] as a view with a wider row stride, the window [C, K - 1] as a view into a state
    block (as the model's are), and the weight [C, K] as the checkpoint's [C, 1, K] seen without its
    middle dimension."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, channels + 24, generator=gen).to(device, dtype)
    block = torch.randn(2, channels, taps + 2, generator=gen).to(device, dtype)
    weight = (0.4 * torch.randn(channels, 1, taps, generator=gen)).to(device, dtype)
    return wide[:, 8 : 8 + channels], block[1, :, 1:taps], weight[:, 0, :]


def test_the_op_is_one_op_with_the_reference_result() -> None:
    inputs, window, weight = conv_inputs(6, 20, 4, torch.float32, seed=1, device=torch.device("cpu"))
    window_before = window.clone()
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = causal_conv.causal_conv_silu(inputs, window, weight)
    assert seen.names == ["qwen35_causal_conv"]  # what a graph capture or an op counter sees
    assert torch.equal(ours, causal_conv.reference(inputs, window, weight))
    assert ours.is_contiguous() and ours.shape == (6, 20)
    assert torch.equal(window, window_before)  # read only: the caller moves the window


def test_the_reference_is_a_causal_convolution_from_the_window() -> None:
    """Position t sums tap j times input t - (K - 1) + j, the window standing in before the chunk."""
    inputs, window, weight = conv_inputs(5, 7, 3, torch.float64, seed=2, device=torch.device("cpu"))
    history = torch.cat((window.t(), inputs))  # [K - 1 + T, C]
    by_hand = torch.stack([(history[t : t + 3] * weight.t()).sum(0) for t in range(5)])
    expected = torch.nn.functional.silu(by_hand)
    torch.testing.assert_close(causal_conv.reference(inputs, window, weight), expected)


def test_bad_arguments_get_a_clear_error() -> None:
    inputs, window, weight = conv_inputs(4, 10, 4, torch.float32, seed=3, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="window"):
        causal_conv.causal_conv_silu(inputs, window[:, :2], weight)
    with pytest.raises(ValueError, match=r"\[T, C\]"):
        causal_conv.causal_conv_silu(inputs, window, weight[:9])
    with pytest.raises(ValueError, match="dtype"):
        causal_conv.causal_conv_silu(inputs, window.double(), weight)


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert causal_conv.SWITCH.forced is None and not causal_conv.enabled(torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_prefill_through_the_op_equals_its_eager_prefill(tmp_path: Path, dtype) -> None:
    """On the CPU the op's body is the reference: the model's chunks through it (2 rows: fewer than the
    window; 7; 64) equal its eager ones to the bit, logits and the kept windows and states alike."""
    path = write_tiny_folder(tmp_path / "hf")
    ids = tokens(73, seed=5)
    bounds = [0, 2, 9, 73]
    results = []
    seen = OpNames()
    for flag in (True, False):
        model = load_tiny(path, dtype)
        with causal_conv.SWITCH.force(flag), torch.inference_mode(), seen:
            logits = [
                model.forward(torch.tensor(ids[start:stop]), start, "all")
                for start, stop in itertools.pairwise(bounds)
            ]
        results.append((torch.cat(logits), model.export_state(73)))
    (ours, our_state), (eager, eager_state) = results
    assert seen.names.count("qwen35_causal_conv") == 3 * 4  # three chunks, four linear layers
    assert torch.equal(ours, eager)
    for name, value in eager_state.items():
        assert torch.equal(our_state[name], value), name


def check_kernel(device: torch.device) -> None:
    """The kernel against the reference: float32 tight, bfloat16 within its rounding (the reference
    rounds the convolution and the silu where the kernel does, its sums in another order)."""
    launch = causal_conv._triton_kernel()
    assert launch is not None
    # (rows, channels, taps): Qwen3.5-9B's 8,192 channels; fewer rows than the window; odd sizes.
    for rows, channels, taps in ((37, 8192, 4), (2, 300, 4), (5, 100, 3), (70, 129, 4)):
        for dtype in (torch.float32, torch.bfloat16):
            inputs, window, weight = conv_inputs(rows, channels, taps, dtype, seed=rows, device=device)
            got = launch(inputs, window, weight)
            expected = causal_conv.reference(inputs, window, weight)
            assert got.dtype == dtype and got.shape == expected.shape
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert relative_error(got, expected) < tol, (rows, channels, taps, dtype)


_KERNEL_CHECK = """
import torch
from tests.engine.kernels.qwen3_5.test_causal_conv import check_kernel

check_kernel(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
print("triton ok")
"""


def test_the_triton_kernel_equals_the_reference() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter. Skipped without Triton."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)
