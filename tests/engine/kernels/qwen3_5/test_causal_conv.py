"""Qwen3.5's linear-attention input stage over a prefill chunk (qwen35_conv_heads): the reference is
the model's eager convolution and head split op for op, the op is one op, the model's prefill
through it equals its eager prefill (logits, the kept windows and the states, both key-head orders),
and the Triton kernel (on CUDA, or Triton's CPU interpreter) equals the reference at the published
configs' head shapes and small odd ones, on rows and windows that are views into wider tensors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.qwen3_5 import causal_conv
from tests.engine.kernels.qwen3_5.test_linear_decode import (
    SHAPES,
    load_tiny,
    relative_error,
    tokens,
    write_tiny_folder,
    write_tiny_gguf,
)
from tests.engine.op_names import OpNames
from tests.engine.triton_check import hopper_ptxas_report, run_triton_check


def conv_inputs(
    rows: int, shape: str, dtype: torch.dtype, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, int]]:
    """Inputs [T, C] as a view with a wider row stride, the window [C, K - 1] as a view into a state
    block (as the model's are), the weight [C, K] as the checkpoint's [C, 1, K] without its middle
    dimension, and the head sizes of `shape` (test_linear_decode.SHAPES)."""
    key_heads, heads, dk, dv, taps = SHAPES[shape]
    channels = 2 * key_heads * dk + heads * dv
    gen = torch.Generator().manual_seed(seed)
    wide = (2 * torch.randn(rows, channels + 24, generator=gen)).to(device, dtype)
    block = torch.randn(2, channels, taps + 2, generator=gen).to(device, dtype)
    weight = (0.4 * torch.randn(channels, 1, taps, generator=gen)).to(device, dtype)
    sizes = {"key_heads": key_heads, "key_dim": dk, "value_heads": heads, "value_dim": dv}
    return wide[:, 8 : 8 + channels], block[1, :, 1:taps], weight[:, 0, :], sizes


def test_the_op_is_one_op_with_the_reference_result() -> None:
    inputs, window, weight, sizes = conv_inputs(6, "tiny", torch.float32, seed=1, device=torch.device("cpu"))
    window_before = window.clone()
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = causal_conv.conv_heads(inputs, window, weight, **sizes)
    assert seen.names == ["qwen35_conv_heads"]  # what a graph capture or an op counter sees
    expected = causal_conv.reference(inputs, window, weight, **sizes)
    for got, want in zip(ours, expected, strict=True):
        assert torch.equal(got, want) and got.dtype == torch.float32
    assert [tuple(t.shape) for t in ours] == [(6, 2, 8), (6, 2, 8), (6, 4, 12)]  # q, k per key head
    assert torch.equal(window, window_before)  # read only: the caller moves the window


def test_the_reference_convolves_from_the_window_and_splits_the_heads() -> None:
    """Position t sums tap j times input t - (K - 1) + j, the window standing in before the chunk; q
    and k come per key head (the tiny shape's 2), v per value head (4)."""
    inputs, window, weight, sizes = conv_inputs(5, "tiny", torch.float64, seed=2, device=torch.device("cpu"))
    history = torch.cat((window.t(), inputs))  # [K - 1 + T, C]
    mixed = F.silu(torch.stack([(history[t : t + 4] * weight.t()).sum(0) for t in range(5)]))
    q, k, v = causal_conv.reference(inputs, window, weight, **sizes)
    close = {"rtol": 1e-5, "atol": 1e-6}  # the reference's heads are float32
    for j in range(2):
        query = mixed[:, j * 8 : (j + 1) * 8]
        key = mixed[:, 16 + j * 8 : 16 + (j + 1) * 8]
        torch.testing.assert_close(q[:, j], (F.normalize(query, dim=-1, eps=0) * 8**-0.5).float(), **close)
        torch.testing.assert_close(k[:, j], F.normalize(key, dim=-1, eps=0).float(), **close)
    for h in range(4):
        torch.testing.assert_close(v[:, h], mixed[:, 32 + h * 12 : 32 + (h + 1) * 12].float(), **close)


def test_bad_arguments_get_a_clear_error() -> None:
    inputs, window, weight, sizes = conv_inputs(4, "tiny", torch.float32, seed=3, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="window"):
        causal_conv.conv_heads(inputs, window[:, :2], weight, **sizes)
    with pytest.raises(ValueError, match=r"\[T, 80\]"):
        causal_conv.conv_heads(inputs[:, :79], window, weight, **sizes)
    with pytest.raises(ValueError, match="dtype"):
        causal_conv.conv_heads(inputs, window.double(), weight, **sizes)
    with pytest.raises(ValueError, match="multiple"):
        causal_conv.conv_heads(inputs, window, weight, 3, 8, 2, 16)  # 80 channels too


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert causal_conv.SWITCH.forced is None and not causal_conv.enabled(torch.zeros(1))


@pytest.mark.parametrize("layout", ["folder", "gguf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_prefill_through_the_op_equals_its_eager_prefill(
    tmp_path: Path, layout: str, dtype: torch.dtype
) -> None:
    """On the CPU the op's body is the reference: the model's chunks through it (2 rows: fewer than the
    window; 7; 64) equal its eager ones to the bit, logits and the kept windows and states alike, in
    both key-head orders (a folder's and a GGUF's)."""
    path = write_tiny_folder(tmp_path / "hf") if layout == "folder" else write_tiny_gguf(tmp_path)
    ids = tokens(73, seed=5)
    results = []
    seen = OpNames()
    for flag in (True, False):
        model = load_tiny(path, dtype)
        with causal_conv.SWITCH.force(flag), torch.inference_mode(), seen:
            logits = [
                model.forward(torch.tensor(ids[start:stop]), start, "all")
                for start, stop in itertools.pairwise([0, 2, 9, 73])
            ]
        results.append((torch.cat(logits), model.export_state(73)))
    (ours, our_state), (eager, eager_state) = results
    assert seen.names.count("qwen35_conv_heads") == 3 * 4  # three chunks, four linear layers
    assert torch.equal(ours, eager)
    for name, value in eager_state.items():
        assert torch.equal(our_state[name], value), name


def check_kernel(device: torch.device) -> None:
    """The kernel against the reference: float32 tight, bfloat16 within its rounding (the reference
    rounds the convolution and the silu where the kernel does, its sums in another order)."""
    launch = causal_conv._triton_kernel()
    assert launch is not None
    for shape, rows in (("9b", 37), ("equal-heads", 2), ("tiny", 5), ("odd", 19)):
        for dtype in (torch.float32, torch.bfloat16):
            inputs, window, weight, sizes = conv_inputs(rows, shape, dtype, seed=rows, device=device)
            got = launch(inputs, window, weight, *sizes.values())
            expected = causal_conv.reference(inputs, window, weight, *sizes.values())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for name, ours, want in zip("qkv", got, expected, strict=True):
                where = (shape, rows, dtype, name)
                assert ours.dtype == torch.float32 and ours.shape == want.shape, where
                assert relative_error(ours, want) < tol, (where, relative_error(ours, want))


_KERNEL_CHECK = """
import torch
from tests.engine.kernels.qwen3_5.test_causal_conv import check_kernel

check_kernel(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
print("triton ok")
"""


def test_the_triton_kernel_equals_the_reference() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter. Skipped without Triton."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


def test_the_kernel_compiles_for_hopper_without_spills(tmp_path: Path) -> None:
    """The interpreter never compiles: the bf16 launch at Qwen3.5-9B's shapes (a key head's query and
    key, then its two value heads' values), compiled for sm_90 ahead of time (no GPU needed), then
    ptxas: no register spills."""
    from ds4desk.engine.kernels.qwen3_5.causal_conv_triton import conv_heads_kernel

    key_heads, heads, dk, dv, taps = SHAPES["9b"]
    signature = {"inputs": "*bf16", "window": "*bf16", "weight": "*bf16"}
    signature |= {"q_out": "*fp32", "k_out": "*fp32", "v_out": "*fp32", "rows": "i32"}
    signature |= {
        "in_stride": "i32",
        "window_stride": "i32",
        "weight_stride": "i32",
        "q_scale": "fp32",
        "eps": "fp32",
    }
    constants = {"KEY_HEADS": key_heads, "HEADS": heads, "DK": dk, "DV": dv, "BLOCK_DK": dk, "BLOCK_DV": dv}
    constants |= {"K": taps, "BLOCK_T": causal_conv.BLOCK_T}
    report = hopper_ptxas_report(tmp_path, conv_heads_kernel, signature, constants, warps=4)
    assert "0 bytes spill stores" in report, report
