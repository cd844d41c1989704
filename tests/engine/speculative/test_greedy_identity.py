"""Greedy decoding with speculation on is token-identical to off, for prompt lookup and draft
models, on two families (llama; Gemma 3 with its 5-row ring for local layers), and speculation
really runs: tokens are drafted, and where the drafter can be right they are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.speculative.draft_model import DraftModel
from tests.engine.speculative.tiny_pairs import PLAIN, REPEATING, load, run, runtime

# target family -> (target seed, a draft family with the same vocabulary)
PAIRS = {"llama": (2, "qwen3"), "gemma3": (1, "gemma3")}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, CausalLM]:
    family = request.param
    seed, draft_family = PAIRS[family]
    folder: Path = tmp_path_factory.mktemp(family)
    return {
        "target": load(family, folder / "target", seed),
        "self": load(family, folder / "self", seed),  # the same weights: a draft that always agrees
        "other": load(draft_family, folder / "other", seed + 10),  # a draft that mostly does not
        "family": family,  # type: ignore[dict-item]
    }


@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_lookup_is_token_identical_and_accepts(models: dict[str, CausalLM], prompt: list[int]) -> None:
    rt = runtime(models["target"])
    off = run(rt, prompt, "off", 60)
    on = run(rt, prompt, "lookup", 60)
    assert on.tokens == off.tokens
    assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
    assert on.finish_reason == off.finish_reason
    stats = on.stats
    assert stats.speculative == "lookup" and off.stats.speculative == "off"
    assert off.stats.drafted_tokens == 0
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    if prompt is REPEATING:
        # The tiny random models fall into loops, which lookup predicts: tokens are drafted and kept.
        assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0


@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("chunk", [3, 64])
def test_a_draft_model_is_token_identical(models: dict[str, CausalLM], draft: str, chunk: int) -> None:
    rt = runtime(models["target"], models[draft], chunk=chunk)
    for prompt in (PLAIN, REPEATING):
        off = run(rt, prompt, "off", 48)
        on = run(rt, prompt, "draft", 48)
        assert on.tokens == off.tokens
        assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
        stats = on.stats
        assert stats.speculative == "draft" and stats.drafted_tokens > 0
        if draft == "self":
            # The target as its own draft agrees everywhere: every drafted token is kept.
            assert stats.accepted_tokens == stats.drafted_tokens
        else:
            assert stats.accepted_tokens < stats.drafted_tokens  # rejections happened and rolled back


def test_auto_picks_the_draft_when_there_is_one_else_lookup(models: dict[str, CausalLM]) -> None:
    rt = runtime(models["target"])
    assert run(rt, PLAIN, "auto", 4).stats.speculative == "lookup"
    rt.draft = DraftModel(models["self"], 192, 8, "draft", 0)
    assert run(rt, PLAIN, "auto", 4).stats.speculative == "draft"


def test_a_draft_shorter_than_the_context_drafts_nothing_past_it(models: dict[str, CausalLM]) -> None:
    """A draft whose cache ends early stops drafting there; the answer stays exact."""
    rt = runtime(models["target"])
    rt.draft = DraftModel(models["self"], len(PLAIN) + 6, 8, "draft", 0)
    off = run(rt, PLAIN, "off", 30)
    on = run(rt, PLAIN, "draft", 30)
    assert on.tokens == off.tokens
    assert 0 < on.stats.drafted_tokens <= 6


def test_the_runtime_keeps_no_state_between_modes(models: dict[str, CausalLM]) -> None:
    """Speculative and plain requests interleave on one cache without any effect on each other."""
    rt = runtime(models["target"], models["other"])
    first = run(rt, REPEATING, "off", 30).tokens
    for mode in ("draft", "lookup", "off", "draft"):
        assert run(rt, REPEATING, mode, 30).tokens == first
    with torch.inference_mode():
        assert torch.isfinite(rt.prefill_logits(PLAIN)).all()
