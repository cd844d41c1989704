"""Everything around the decode loop keeps working with speculation on: max_tokens, stop tokens,
cancel, snapshots (after the answer and inside the prompt, the state itself compared), the
thinking budget's forced close, and the cache after rejections (the next request equals a fresh
run). Each case runs with a draft that always agrees (many drafted tokens in flight when the answer
must end) and one that mostly does not (rejections and roll-backs), on llama and Gemma 3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import FinishReason, SamplingParams, SaveSnapshot, ThinkingBudget
from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore
from tests.engine.speculative.tiny_pairs import CONTEXT, PLAIN, REPEATING, load, run, runtime

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(family: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, CausalLM]:
    folder: Path = tmp_path_factory.mktemp(f"features-{family}")
    draft_family = "qwen3" if family == "llama" else "gemma3"
    return {
        "target": load(family, folder / "target", 4),
        "self": load(family, folder / "self", 4),
        "other": load(draft_family, folder / "other", 14),
    }


@pytest.fixture(params=["self", "other", "lookup"])
def setup(request: pytest.FixtureRequest, models: dict[str, CausalLM]) -> tuple[Runtime, str]:
    """(runtime, mode): a draft model that agrees, one that does not, or prompt lookup."""
    if request.param == "lookup":
        return runtime(models["target"]), "lookup"
    return runtime(models["target"], models[request.param]), "draft"


def test_max_tokens_is_never_passed(setup: tuple[Runtime, str]) -> None:
    rt, mode = setup
    full = run(rt, REPEATING, "off", 12, stop=set()).tokens
    for count in (1, 2, 3, 5, 8):
        on = run(rt, REPEATING, mode, count)
        assert on.tokens == full[:count]
        assert on.stats.generated_tokens == count and on.finish_reason == FinishReason.LENGTH


def test_a_stop_token_ends_the_answer_where_it_would_without_speculation(setup: tuple[Runtime, str]) -> None:
    rt, mode = setup
    free = run(rt, REPEATING, "off", 30).tokens
    # The latest token that appears for the first time: it ends the answer there.
    index = max(i for i in range(1, len(free)) if free[i] not in free[:i])
    off = run(rt, REPEATING, "off", 30, stop={free[index]})
    on = run(rt, REPEATING, mode, 30, stop={free[index]})
    assert off.tokens == free[:index] and off.finish_reason == FinishReason.STOP
    assert on.tokens == off.tokens and on.finish_reason == FinishReason.STOP
    assert on.stats.generated_tokens == off.stats.generated_tokens == index + 1


@pytest.mark.parametrize("after", [1, 3, 7])
def test_cancel_stops_at_the_same_token(setup: tuple[Runtime, str], after: int) -> None:
    rt, mode = setup
    off = run(rt, REPEATING, "off", 30, should_cancel=lambda seen: len(seen) >= after)
    on = run(rt, REPEATING, mode, 30, should_cancel=lambda seen: len(seen) >= after)
    assert on.finish_reason == off.finish_reason == FinishReason.CANCELLED
    assert on.tokens == off.tokens and len(on.tokens) == after


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_snapshot_after_the_answer_holds_the_same_state(
    setup: tuple[Runtime, str], sampling: SamplingParams
) -> None:
    """The state saved after a speculative answer is the state of its tokens, exactly as a plain
    decode of the same tokens leaves it (the rolled-back rows of rejected drafts included), and a
    next turn continues from it as from a fresh prefill."""
    rt, mode = setup
    identity = ModelIdentity("tiny", "float32", CONTEXT)
    spec_store, plain_store = SnapshotStore(identity), SnapshotStore(identity)
    on = run(rt, REPEATING, mode, 24, sampling, save=SaveSnapshot(), snapshots=spec_store)
    assert on.snapshot_slot is not None
    # Replay the same tokens without speculation (forced through a prompt of them) for the reference.
    saved = spec_store.get(on.snapshot_slot)
    assert list(saved.tokens) == [*REPEATING, *on.tokens][: len(saved.tokens)]
    assert len(saved.tokens) == len(REPEATING) + len(on.tokens) - 1  # the last token is not fed
    reference = run(
        rt, list(saved.tokens), "off", 1, save=SaveSnapshot(at=len(saved.tokens)), snapshots=plain_store
    )
    assert reference.snapshot_slot is not None
    expected = plain_store.get(reference.snapshot_slot)
    assert saved.state.keys() == expected.state.keys()
    for key in saved.state:
        torch.testing.assert_close(saved.state[key], expected.state[key], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(saved.logits, expected.logits, atol=2e-4, rtol=1e-4)
    # The next turn: continued from the snapshot, with speculation, equals a fresh plain run.
    follow = [*saved.tokens, on.tokens[-1], 9, 10, 11]
    continued = run(rt, follow, mode, 16, snapshots=spec_store)
    assert continued.stats.reused_tokens == len(saved.tokens)
    assert continued.tokens == run(rt, follow, "off", 16).tokens


def test_a_snapshot_inside_the_prompt(setup: tuple[Runtime, str]) -> None:
    rt, mode = setup
    store = SnapshotStore(ModelIdentity("tiny", "float32", CONTEXT))
    on = run(rt, PLAIN, mode, 20, save=SaveSnapshot(at=11), snapshots=store)
    assert on.snapshot_slot is not None and store.get(on.snapshot_slot).tokens == tuple(PLAIN[:11])
    again = run(rt, PLAIN, mode, 20, snapshots=store)
    assert again.stats.reused_tokens == 11
    assert again.tokens == on.tokens == run(rt, PLAIN, "off", 20).tokens


def test_the_thinking_budget_forces_its_close_exactly(setup: tuple[Runtime, str]) -> None:
    """Drafted tokens meet forced ones: the close sequence still lands where the budget says, a
    draft that guesses it is accepted, and the answer equals the plain one."""
    rt, mode = setup
    free = run(rt, REPEATING, "off", 16).tokens
    close = [t for t in range(150, 250) if t not in free][:2]
    for spent in (0, 3, 6):
        budget = ThinkingBudget(max_tokens=spent, close_tokens=close)
        off = run(rt, REPEATING, "off", 16, budget=budget)
        on = run(rt, REPEATING, mode, 16, budget=budget)
        assert on.tokens == off.tokens and on.budget_forced_close and off.budget_forced_close
        assert on.tokens[spent : spent + 2] == close and on.tokens[:spent] == free[:spent]
    # A close the model writes by itself (it is in the free answer) is not forced.
    natural = ThinkingBudget(max_tokens=12, close_tokens=free[4:6])
    on = run(rt, REPEATING, mode, 16, budget=natural)
    assert on.tokens == run(rt, REPEATING, "off", 16, budget=natural).tokens


def test_sampled_runs_are_reproducible_with_a_seed(setup: tuple[Runtime, str]) -> None:
    rt, mode = setup
    first = run(rt, REPEATING, mode, 20, SAMPLED)
    second = run(rt, REPEATING, mode, 20, SAMPLED)
    assert first.tokens == second.tokens and len(first.tokens) == 20
