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


def test_the_engine_gives_each_token_its_entry_and_alternatives() -> None:
    """Through the engine on the real SmolLM2: one TokenLogprob per generated token, in the result
    and in the streamed deltas; the first one equals token_logprobs of the prompt's own logits."""
    import asyncio

    from ds4desk.engine import Engine, EngineClient, GenerateRequest, LoadRequest
    from ds4desk.engine.loading.default_model import default_model_path

    engine = Engine()
    try:
        assert engine.load(LoadRequest(path=str(default_model_path()), device="cpu", context=256)).ok
        request = GenerateRequest(raw_text="The capital of France is", max_new_tokens=6, top_logprobs=3)
        result = engine.generate(request)
        assert result.ok and result.tokens
        entries = result.token_logprobs
        assert [e.token for e in entries] == result.tokens
        assert [e.logprob for e in entries] == pytest.approx(result.logprobs, abs=1e-5)
        for entry in entries:  # greedy: the token chosen leads its alternatives
            assert len(entry.top) == 3 and entry.top[0].token == entry.token
            assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
        assert "".join(e.text for e in entries) == result.text
        loaded = engine._loaded
        assert loaded is not None
        first = loaded.runtime.prefill_logits(result.prompt_tokens)
        chosen, top = token_logprobs(first, result.tokens[0], 3)
        assert entries[0].logprob == pytest.approx(chosen, abs=1e-4)
        assert [(t.token, t.logprob) for t in entries[0].top] == [
            (i, pytest.approx(v, abs=1e-4)) for i, v in top
        ]

        async def streamed() -> list:
            client = EngineClient(engine)
            deltas = []
            done = await client.generate(
                GenerateRequest(raw_text="The capital of France is", max_new_tokens=6, top_logprobs=2),
                on_delta=deltas.append,
            )
            return [done, deltas]

        done, deltas = asyncio.run(streamed())
        assert [e.token for d in deltas for e in d.logprobs] == done.tokens == result.tokens
    finally:
        engine.close()
