"""Prefill's row-wise C ops in quant/gguf_cpu.py (RMSNorm, RoPE after a per-head norm, gated activation)
against the torch ops they stand in for, on the AVX-512 and the portable kernels, on rows that are
views into wider tensors (as a prompt's q/k heads are views into its qkv projection)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import switches
from ds4desk.engine.kernels.quant import gguf_cpu

TIGHT = {"rtol": 2e-6, "atol": 2e-6}  # float32, sums in another order


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), None, eps) * (1 if weight is None else weight)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("tokens", [1, 3, 130])
@pytest.mark.parametrize("dim", [64, 640, 1152])
def test_rms_norm_rows_is_torchs(tokens: int, dim: int, isa: str) -> None:
    generator = torch.Generator().manual_seed(dim + tokens)
    wide = torch.randn(tokens, dim + 48, generator=generator) * 3
    x = wide[:, 16 : 16 + dim]  # rows apart by more than their width
    weight = torch.randn(dim, generator=generator)
    torch.testing.assert_close(
        gguf_cpu.rms_norm_rows(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6), **TIGHT
    )
    torch.testing.assert_close(gguf_cpu.rms_norm_rows(x, None, 1e-5), torch_rms_norm(x, None, 1e-5), **TIGHT)


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("sin_folded", [False, True])
@pytest.mark.parametrize(("heads", "dim"), [(5, 256), (12, 64)])
def test_rope_rotates_the_heads_in_place_after_their_norm(
    heads: int, dim: int, sin_folded: bool, normed: bool, isa: str
) -> None:
    tokens, kv_width = 37, 2 * dim
    generator = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, heads * dim + kv_width, generator=generator) * 2
    values_before = qkv[:, heads * dim :].clone()
    norm = torch.randn(heads, dim, generator=generator) if normed else None
    angles = torch.randn(tokens, dim // 2, generator=generator) * 4
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    source = torch_rms_norm(qk, norm, 1e-6) if normed else qk
    expected = torch_rope(source, cos[:, None], sin[:, None])
    given_sin = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1) if sin_folded else sin

    returned = gguf_cpu.rope_(qk, cos, given_sin.contiguous(), sin_folded, norm, 1e-6)

    assert returned is qk
    torch.testing.assert_close(qk, expected, **TIGHT)
    assert torch.equal(qkv[:, heads * dim :], values_before)  # the values beside them are untouched


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "silu"])
@pytest.mark.parametrize("tokens", [1, 64])
def test_gated_rows_is_the_activation_times_up(activation: str, tokens: int, isa: str) -> None:
    ffn = 2048 + 3  # a tail the 16-lane loop masks
    generator = torch.Generator().manual_seed(tokens)
    wide = torch.randn(tokens, 2 * ffn + 8, generator=generator) * 4
    gate_up = wide[:, : 2 * ffn]
    gate, up = gate_up[:, :ffn], gate_up[:, ffn:]
    if activation == "silu":
        expected = F.silu(gate) * up
    else:
        expected = F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up
    # The AVX-512 kernel takes GELU's tanh form as a sigmoid of an approximated exponential.
    torch.testing.assert_close(gguf_cpu.gated_rows(gate_up, activation), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not gguf_cpu.available(), reason="the C extension is not built")
def test_rows_that_do_not_fit_are_refused() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError):
        gguf_cpu.rms_norm_rows(x.double(), None, 1e-6)
    with pytest.raises(ValueError):
        gguf_cpu.rms_norm_rows(x.t(), None, 1e-6)  # values not contiguous within a row
    with pytest.raises(ValueError):
        gguf_cpu.rms_norm_rows(x, torch.ones(32), 1e-6)  # a weight of the wrong width
    heads = torch.randn(4, 2, 64)
    table = torch.ones(4, 64)
    with pytest.raises(ValueError):  # rows that overlap: an in-place rotation would read its own writes
        gguf_cpu.rope_(heads[:1].expand(4, 2, 64), table, table, False, torch.ones(2, 64), 1e-6)
    with pytest.raises(ValueError):
        gguf_cpu.rope_(heads, table[:3], table[:3], False)  # tables too short
    with pytest.raises(ValueError):
        gguf_cpu.gated_rows(torch.randn(4, 7), "silu")  # gate and up of unequal widths
    with pytest.raises(ValueError):
        gguf_cpu.gated_rows(torch.randn(4, 8), "relu")


def test_the_row_ops_are_a_switch_for_float32_cpu_rows_only() -> None:
    assert gguf_cpu.ROW_OPS in switches()
    with gguf_cpu.ROW_OPS.force(None):
        assert gguf_cpu.row_ops_take(torch.randn(2, 8)) == gguf_cpu.available()
        assert not gguf_cpu.row_ops_take(torch.randn(2, 8, dtype=torch.bfloat16))
        assert not gguf_cpu.row_ops_take(torch.randn(8, 2).t())
    with gguf_cpu.ROW_OPS.force(False):
        assert not gguf_cpu.row_ops_take(torch.randn(2, 8))
