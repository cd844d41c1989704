"""Speculative decoding on Qwen3.5 (float32, CPU): a rejected draft rolls the linear layers' recurrent
state (and convolution window) back exactly, and greedy output with speculation on is token-identical
to off, for prompt lookup and for draft models (one that always agrees, one that mostly does not),
dense and MoE, from a Hugging Face folder and from a GGUF with packed weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine import runtime as runtime_module
from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.qwen3_5 import causal_conv, gates
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.qwen3_5.model import Qwen35Model
from ds4desk.engine.speculative.drafter import Proposal
from ds4desk.engine.speculative.rollback import rollback_of
from tests.engine.models.qwen3_5.gguf_writer import MIXED, make_hf, write_qwen35_gguf
from tests.engine.models.qwen3_5.tiny import save_tiny, save_tiny_moe
from tests.engine.speculative.tiny_pairs import CONTEXT, PLAIN, REPEATING, run, runtime

CPU = torch.device("cpu")


class _OpeningDrafter:
    """Stands in for prompt lookup where a random Qwen3.5 never repeats a pair of tokens (lookup then
    drafts nothing): it proposes the prompt's opening tokens at every step, so drafts are made and
    mostly rejected, and the recurrent state must roll back."""

    name = "lookup"

    def propose(self, seq, count, sampling, generator) -> Proposal:
        return Proposal(list(seq[:count]))

    def settle(self, accepted: int) -> None:
        return None


@pytest.fixture
def drafts_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_module, "LookupDrafter", _OpeningDrafter)


def _load(source) -> Qwen35Model:
    model = load_model(source, CPU, torch.float32).model
    assert isinstance(model, Qwen35Model)
    return model


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Qwen35Model]:
    root = tmp_path_factory.mktemp("qwen35_spec")
    return {
        "target": _load(save_tiny(root / "target", seed=2)[1]),
        "self": _load(save_tiny(root / "self", seed=2)[1]),  # the same weights: always agrees
        "other": _load(save_tiny(root / "other", seed=12)[1]),  # another random model: mostly not
    }


def _states(model: Qwen35Model, length: int) -> dict[str, torch.Tensor]:
    return model.export_state(length)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


@pytest.mark.parametrize("kept", [0, 1, 3, 6])
@pytest.mark.parametrize(
    ("one_forward", "ops"),
    [(True, False), (True, True), (False, False)],
    ids=["verify", "verify-on-the-prefill-ops", "draft-steps"],
)
def test_a_rollback_leaves_the_state_of_the_kept_positions(
    dense, kept: int, one_forward: bool, ops: bool
) -> None:
    """Checkpoint, write 6 positions (one verify forward, or six one-token steps as a draft model
    does), keep `kept`: the state equals a run that only ever fed the kept positions, and the model
    continues from there as that run does. `ops`: the forwards of more than one token through the
    prefill's custom ops, as on a GPU (the convolution's gives the keys per key head, which the
    verify's record repeats to the value heads)."""
    with launch.force({causal_conv.SWITCH: ops or None, gates.SWITCH: ops or None}):
        check_rollback(dense["target"], kept, one_forward)


def check_rollback(model: Qwen35Model, kept: int, one_forward: bool) -> None:
    hooks = rollback_of(model)
    assert hooks is not None and hooks.max_verify_tokens() is None
    prompt, tail = REPEATING[:20], torch.tensor([5, 9, 77, 120, 3, 250])
    model.allocate_cache(64)
    with torch.inference_mode():
        model.forward(torch.tensor(prompt), 0, "none")
        before = {k: v.clone() for k, v in _states(model, 20).items()}
        saved = hooks.verify_checkpoint(20, 6)
        if one_forward:
            model.forward(tail, 20, "all")
        else:
            for i in range(6):
                model.forward(tail[i : i + 1], 20 + i, "last")
        hooks.verify_rollback(saved, 20, kept)
        assert model.length == 20 + kept
        rolled = _states(model, 20 + kept)
        after = model.forward(torch.tensor([42]), 20 + kept, "last")

        model.forward(torch.tensor(prompt), 0, "none")
        if kept == 0:
            for name, value in before.items():  # nothing kept: exactly the checkpoint, bit for bit
                assert torch.equal(rolled[name], value), name
        else:
            model.forward(tail[:kept], 20, "none")
        expected = _states(model, 20 + kept)
        expected_after = model.forward(torch.tensor([42]), 20 + kept, "last")
    # Equal up to the rounding of a 6-position batch against a `kept`-position one (the positions
    # kept were computed inside the longer verify): a wrong roll-back is off by whole positions.
    for name, value in expected.items():
        assert relative_error(rolled[name], value) < 1e-5, name
    assert relative_error(after, expected_after) < 1e-5


def test_keeping_everything_changes_nothing(dense) -> None:
    model = dense["target"]
    model.allocate_cache(64)
    with torch.inference_mode():
        model.forward(torch.tensor(PLAIN[:10]), 0, "none")
        saved = model.verify_checkpoint(10, 4)
        model.forward(torch.tensor(PLAIN[10:14]), 10, "none")
        state = {k: v.clone() for k, v in model.export_state(14).items()}
        model.verify_rollback(saved, 10, 4)
    assert model.length == 14
    assert all(torch.equal(model.export_state(14)[k], v) for k, v in state.items())
    # The recording stops with the roll-back: later forwards keep nothing.
    assert all(plan.written is None for shard in model._shards for plan in shard.linear_plans)


def test_a_restart_voids_a_verify_left_unsettled(dense) -> None:
    """A draft model whose proposal failed starts over at position 0 without a roll-back: its layers
    stop recording there instead of keeping every later forward's inputs."""
    model = dense["other"]
    model.allocate_cache(64)
    with torch.inference_mode():
        model.forward(torch.tensor(PLAIN[:10]), 0, "none")
        model.verify_checkpoint(10, 3)
        model.forward(torch.tensor(PLAIN[10:12]), 10, "none")
        plans = [plan for shard in model._shards for plan in shard.linear_plans]
        assert all(plan.written for plan in plans)  # recording while the verify is open
        model.forward(torch.tensor(PLAIN[:4]), 0, "none")
    assert all(plan.written is None for plan in plans)


@pytest.mark.parametrize("prompt", [REPEATING, PLAIN], ids=["repeating", "plain"])
def test_lookup_is_token_identical(dense, prompt: list[int]) -> None:
    rt = runtime(dense["target"])
    off = run(rt, prompt, "off", 60)
    on = run(rt, prompt, "lookup", 60)
    assert on.tokens == off.tokens
    assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
    assert on.stats.speculative == "lookup"


@pytest.mark.usefixtures("drafts_always")
def test_rejected_drafts_roll_back_token_identically(dense) -> None:
    rt = runtime(dense["target"])
    off = run(rt, REPEATING, "off", 60)
    on = run(rt, REPEATING, "lookup", 60)
    assert on.tokens == off.tokens
    assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
    assert on.stats.drafted_tokens > on.stats.accepted_tokens  # rejections, rolled back


@pytest.mark.parametrize("draft", ["self", "other"])
def test_a_draft_model_is_token_identical(dense, draft: str) -> None:
    rt = runtime(dense["target"], dense[draft], chunk=5)
    for prompt in (PLAIN, REPEATING):
        off = run(rt, prompt, "off", 40)
        on = run(rt, prompt, "draft", 40)
        assert on.tokens == off.tokens
        assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
        stats = on.stats
        assert stats.speculative == "draft" and stats.drafted_tokens > 0
        if draft == "self":
            assert stats.accepted_tokens == stats.drafted_tokens
        else:
            assert stats.accepted_tokens < stats.drafted_tokens  # rejections happened and rolled back


@pytest.mark.usefixtures("drafts_always")
def test_moe_rolls_back_token_identically(tmp_path: Path) -> None:
    rt = runtime(_load(save_tiny_moe(tmp_path, seed=3)[1]))
    off = run(rt, REPEATING, "off", 48)
    on = run(rt, REPEATING, "lookup", 48)
    assert on.tokens == off.tokens and on.stats.drafted_tokens > 0


@pytest.mark.usefixtures("drafts_always")
def test_a_packed_gguf_speculates_token_identically(tmp_path: Path) -> None:
    out = write_qwen35_gguf(tmp_path / "spec.gguf", make_hf(True, seed=4), MIXED)
    rt = runtime(_load(read_source(out.path)))
    off = run(rt, REPEATING, "off", 48)
    on = run(rt, REPEATING, "lookup", 48)
    assert on.tokens == off.tokens and on.stats.drafted_tokens > 0
    assert len(REPEATING) + 48 <= CONTEXT
