"""The chunked gated delta rule against the recurrence it condenses, token by token: the same
outputs and the same final state, from an empty or a carried state, at any chunk size."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.qwen3_5 import chunked_delta
from ds4desk.engine.models.qwen3_5 import delta_rule


def inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0, decay: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q = delta_rule.unit_rows(torch.randn(heads, length, dk, generator=gen)) * dk**-0.5
    k = delta_rule.unit_rows(torch.randn(heads, length, dk, generator=gen))
    v = torch.randn(heads, length, dv, generator=gen)
    # Log-decays from almost none to strong (exp(-decay * 4) per token at the far end).
    g = -decay * 4 * torch.rand(heads, length, generator=gen)
    beta = torch.rand(heads, length, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


def token_by_token(q, k, v, g, beta, state):
    state = state.clone()
    outs = [delta_rule.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state) for t in range(q.shape[1])]
    return torch.stack(outs, dim=1), state


def test_one_step_is_the_rule_as_written() -> None:
    """The step against the rule spelled out for one head with plain vectors."""
    q, k, v, g, beta, state = inputs(1, heads=1)
    expected_state = state[0] * g[0, 0].exp()
    write = beta[0, 0] * (v[0, 0] - expected_state.t() @ k[0, 0])
    expected_state = expected_state + torch.outer(k[0, 0], write)
    carried = state.clone()
    out = delta_rule.step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], carried)
    torch.testing.assert_close(carried[0], expected_state)
    torch.testing.assert_close(out[0], expected_state.t() @ q[0, 0])


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 64), (64, 64), (100, 64), (37, 8), (40, 8), (9, 1)])
@pytest.mark.parametrize("from_empty", [True, False])
def test_chunked_equals_the_recurrence(length: int, chunk: int, from_empty: bool) -> None:
    q, k, v, g, beta, state = inputs(length, seed=length + chunk)
    if from_empty:
        state = torch.zeros_like(state)
    expected, expected_state = token_by_token(q, k, v, g, beta, state)
    carried = state.clone()
    out = chunked_delta.reference(q, k, v, g, beta, carried, chunk=chunk)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(carried, expected_state, rtol=1e-5, atol=1e-5)


def test_strong_decay_over_a_long_chunk_stays_finite() -> None:
    """Decays summed over a 64-token chunk reach exp(-250): the chunk's factors underflow to 0,
    never overflow, and the result still equals the recurrence."""
    q, k, v, g, beta, state = inputs(128, seed=3, decay=2.0)
    expected, expected_state = token_by_token(q, k, v, g, beta, state)
    carried = state.clone()
    out = delta_rule.chunked(q, k, v, g, beta, carried, torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(carried).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(carried, expected_state, rtol=1e-5, atol=1e-5)
