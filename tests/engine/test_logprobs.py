"""token_logprobs against a direct computation in float64 and against the sampler's own logprob."""

from __future__ import annotations

import math

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.logprobs import MAX_TOP_N, token_logprobs
from ds4desk.engine.sampling import sample


def direct(values: list[float]) -> list[float]:
    """log softmax in float64, written out: x - max - log(sum(exp(x - max)))."""
    peak = max(values)
    total = math.fsum(math.exp(v - peak) for v in values)
    return [v - peak - math.log(total) for v in values]


@pytest.mark.parametrize("top_n", [0, 1, 5, MAX_TOP_N])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_direct_computation(top_n: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(top_n)
    logits = (torch.randn(5000, generator=generator) * 4).to(dtype)
    token = int(torch.randint(5000, (1,), generator=generator))
    expected = direct(logits.float().tolist())  # the model's values as float32 sees them
    chosen, top = token_logprobs(logits, token, top_n)
    assert chosen == pytest.approx(expected[token], abs=2e-5)
    order = sorted(range(5000), key=lambda i: (-expected[i], i))
    if dtype == torch.float32:  # no ties among random float32 values: the ids are exact
        assert [i for i, _ in top] == order[:top_n]
    assert len(top) == top_n
    for i, logprob in top:
        assert logprob == pytest.approx(expected[i], abs=2e-5)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_ties_come_out_in_id_order() -> None:
    logits = torch.zeros(50)
    logits[31] = 2.0
    logits[7] = 2.0
    logits[40] = 1.0
    _chosen, top = token_logprobs(logits, 3, 6)
    assert [i for i, _ in top] == [7, 31, 40, 0, 1, 2]


def test_the_sampled_token_agrees_with_the_sampler() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(300, generator=generator) * 3
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=4)):
        token, logprob = sample(logits, params, torch.Generator().manual_seed(4))
        chosen, top = token_logprobs(logits, int(token), 3)
        assert chosen == pytest.approx(float(logprob), abs=1e-5)
        if params.greedy:
            assert top[0][0] == int(token) and top[0][1] == pytest.approx(chosen, abs=1e-6)


def test_a_small_vocabulary_gives_what_there_is() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    _chosen, top = token_logprobs(logits, 0, MAX_TOP_N)
    assert [i for i, _ in top] == [2, 1, 0]
    assert math.fsum(math.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    ("logits", "token", "top_n", "mentions"),
    [
        (torch.zeros(2, 5), 0, 1, "one row"),
        (torch.zeros(5), 5, 1, "outside"),
        (torch.zeros(5), -1, 1, "outside"),
        (torch.zeros(5), 0, MAX_TOP_N + 1, "top_n"),
        (torch.zeros(5), 0, -1, "top_n"),
    ],
)
def test_bad_arguments_are_refused(logits: torch.Tensor, token: int, top_n: int, mentions: str) -> None:
    with pytest.raises(ValueError, match=mentions):
        token_logprobs(logits, token, top_n)
