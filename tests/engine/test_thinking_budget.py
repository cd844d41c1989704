"""The thinking budget on a tiny random model: forced close, natural close, a half-written close,
and the same through the engine thread."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams, ThinkingBudget
from ds4desk.engine.loader import load_model
from ds4desk.engine.runtime import RunOutcome, Runtime
from tests.engine.tiny_dense import save_tiny

GREEDY = SamplingParams()
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    _, source = save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), seed=4)
    return Runtime(load_model(source, torch.device("cpu"), torch.float32).model, torch.device("cpu"), 64, 4)


def run(
    runtime: Runtime, count: int, budget: ThinkingBudget | None, prompt: list[int] = PROMPT
) -> RunOutcome:
    seen: list[int] = []
    outcome = runtime.generate(prompt, GREEDY, count, set(), seen.append, lambda: False, budget)
    assert seen == outcome.tokens  # forced tokens stream like any other
    return outcome


def unused_tokens(tokens: list[int], count: int) -> list[int]:
    return [t for t in range(200, 256) if t not in tokens][:count]


def test_the_budget_forces_the_close_then_sampling_resumes(runtime: Runtime) -> None:
    free = run(runtime, 12, None).tokens
    close = unused_tokens(free, 2)
    outcome = run(runtime, 12, ThinkingBudget(max_tokens=4, close_tokens=close))
    assert outcome.budget_forced_close
    assert outcome.tokens[:4] == free[:4]
    assert outcome.tokens[4:6] == close
    # After the close the model answers on its own: what a free run continues from there.
    assert outcome.tokens[6:] == run(runtime, 6, None, PROMPT + outcome.tokens[:6]).tokens
    assert outcome.stats.generated_tokens == 12
    # A forced token's logprob is still the model's own opinion of it.
    logits = runtime.prefill_logits(PROMPT + outcome.tokens[:4])
    assert outcome.logprobs[4] == pytest.approx(float(torch.log_softmax(logits, 0)[close[0]]), abs=1e-5)


def test_a_model_that_closes_by_itself_is_not_forced(runtime: Runtime) -> None:
    free = run(runtime, 12, None).tokens
    outcome = run(runtime, 12, ThinkingBudget(max_tokens=6, close_tokens=free[2:4]))
    assert outcome.tokens == free and not outcome.budget_forced_close


def test_a_close_sequence_the_model_began_is_completed(runtime: Runtime) -> None:
    free = run(runtime, 12, None).tokens
    [other] = [t for t in unused_tokens(free, 3) if t != free[4]][:1]
    outcome = run(runtime, 8, ThinkingBudget(max_tokens=4, close_tokens=[free[3], other]))
    assert outcome.budget_forced_close
    assert outcome.tokens[:5] == [*free[:4], other]


def test_budget_zero_closes_at_once(runtime: Runtime) -> None:
    outcome = run(runtime, 4, ThinkingBudget(max_tokens=0, close_tokens=[201, 202]))
    assert outcome.tokens[:2] == [201, 202] and outcome.budget_forced_close


@pytest.mark.parametrize(
    "budget", [ThinkingBudget(-1, [1]), ThinkingBudget(3, []), ThinkingBudget(3, [10**6])]
)
def test_a_meaningless_budget_is_a_bad_request(runtime: Runtime, budget: ThinkingBudget) -> None:
    with pytest.raises(EngineFailure) as failure:
        run(runtime, 4, budget)
    assert failure.value.error.code == ErrorCode.BAD_REQUEST


def test_through_the_engine_on_the_real_model() -> None:
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    engine = Engine()
    try:
        assert engine.load(LoadRequest(context=256)).ok
        close = [1000, 1001]
        result = engine.generate(
            GenerateRequest(
                raw_text="Let me think step by step.",
                max_new_tokens=8,
                stop_tokens=[],
                thinking_budget=ThinkingBudget(max_tokens=3, close_tokens=close),
            )
        )
    finally:
        engine.close()
    assert result.ok and result.budget_forced_close
    assert result.tokens[3:5] == close and len(result.tokens) == 8
    assert result.to_json()["budget_forced_close"] is True


def test_the_engine_spells_the_close_itself_when_none_is_given() -> None:
    """The window cannot know token ids: an empty close sequence means the tokenizer's `</think>`."""
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest
    from ds4desk.engine.loading.default_model import default_model_path
    from ds4desk.engine.loading.detect import read_source
    from ds4desk.engine.tokenizer import ChatTokenizer

    source = read_source(default_model_path())
    spelled = ChatTokenizer.from_source(source).encode("</think>")
    assert len(spelled) >= 1
    engine = Engine()
    try:
        assert engine.load(LoadRequest(context=256)).ok
        result = engine.generate(
            GenerateRequest(
                raw_text="Let me think step by step.",
                max_new_tokens=3 + len(spelled) + 2,
                stop_tokens=[],
                thinking_budget=ThinkingBudget(max_tokens=3, close_tokens=[]),
                sampling=SamplingParams(temperature=0.0),
            )
        )
    finally:
        engine.close()
    assert result.ok and result.budget_forced_close
    assert result.tokens[3 : 3 + len(spelled)] == spelled
