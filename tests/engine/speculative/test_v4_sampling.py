"""At temperature > 0, speculative decoding on DeepSeek-V4 draws its tokens from exactly the
target's distribution, for each drafter (prompt lookup, a sampling V4 draft model, the model's own
MTP block): the joint distribution of the first two tokens of many seeded runs against the product
of the target's own distributions, computed here from its logits by the sampler's definition
(test_rejection_sampling.expected), with a chi-square test at the 0.1% level. The second token
comes out of a verify step (accepted, or drawn from the residual after a rejection, with the
target's cache rolled back), so a roll-back that left anything behind would skew it."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import GenerateStats, SamplingParams
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.speculative.adaptive import AdaptiveK
from ds4desk.engine.speculative.decode import SpeculativeDecode
from ds4desk.engine.speculative.draft_model import DraftModel
from ds4desk.engine.speculative.drafter import Drafter, LookupDrafter
from ds4desk.engine.speculative.mtp import MtpDrafter, track_mtp
from ds4desk.engine.speculative.rollback import rollback_of
from tests.engine.speculative.test_rejection_sampling import chi2_limit, chi_square, expected
from tests.engine.speculative.tiny_v4_mtp import VOCAB, load_v4, save_tiny_v4_with_mtp

CONTEXT = 2 * VOCAB + 8
PARAMS = SamplingParams(temperature=1.0, top_k=2)
RUNS = 200
# Token 0 before every token, and last: whatever the first token t is, the prompt holds the pair
# (0, t) that prompt lookup drafts from (it needs a match of two tokens).
EVERY_PAIR = [token for t in range(VOCAB) for token in (0, t)] + [0]
# A draft model restarts from position 0 each run (V4 cannot rewind): a short prompt.
SHORT = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).tolist()[:20]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DeepseekV4Model]:
    root: Path = tmp_path_factory.mktemp("v4-sampling")
    return {
        "target": load_v4(save_tiny_v4_with_mtp(root / "target", seed=8)),
        "other": load_v4(save_tiny_v4_with_mtp(root / "other", seed=18, template_layer=None)),
    }


def first_two(
    model: DeepseekV4Model,
    drafter: Drafter,
    state: dict[str, torch.Tensor],
    prompt: list[int],
    logits: torch.Tensor,
    generator: torch.Generator,
    totals: GenerateStats,
) -> tuple[int, int]:
    """One speculative run from the prompt's saved state: its first two tokens (its drafted and
    accepted counts added to `totals`)."""
    hooks = rollback_of(model)
    assert hooks is not None
    model.import_state(state, len(prompt))
    tokens: list[int] = []
    stats = GenerateStats()

    def emit(token: int, _logprob: float) -> bool:
        tokens.append(token)
        stats.generated_tokens += 1
        return len(tokens) >= 2

    def plain_step(token: torch.Tensor, at: int) -> torch.Tensor:
        out = model.forward(token.view(1), at, "last")
        assert out is not None
        return out

    loop = SpeculativeDecode(
        model, hooks, drafter, PARAMS, generator, None, stats, emit, plain_step, 2, AdaptiveK(k=2),
    )  # fmt: skip
    loop.run(list(prompt), logits, len(prompt))
    totals.drafted_tokens += stats.drafted_tokens
    totals.accepted_tokens += stats.accepted_tokens
    return tokens[0], tokens[1]


@pytest.mark.parametrize("name", ["lookup", "draft", "mtp"])
def test_the_first_two_tokens_follow_the_target(models: dict[str, DeepseekV4Model], name: str) -> None:
    model = models["target"]
    prompt = EVERY_PAIR if name == "lookup" else SHORT
    drafter: Drafter
    if name == "draft":
        drafter = DraftModel(models["other"], CONTEXT, 64, "draft", 0)
    elif name == "mtp":
        drafter = MtpDrafter(model)
    else:
        drafter = LookupDrafter()
    with torch.inference_mode():
        model.allocate_cache(CONTEXT)
        track_mtp(model, name == "mtp")
        logits = model.forward(torch.tensor(prompt), 0, "last")
        assert logits is not None
        state = model.export_state(len(prompt))
        # The target's own distributions: the first token's, and the second's after each first one.
        first = expected(logits.tolist(), PARAMS)
        second = {}
        for token in (t for t, p in enumerate(first) if p > 0):
            model.import_state(state, len(prompt))
            after = model.forward(torch.tensor([token]), len(prompt), "last")
            assert after is not None
            second[token] = expected(after.tolist(), PARAMS)
        generator = torch.Generator().manual_seed(21)
        stats = GenerateStats()
        joint: Counter[object] = Counter(
            first_two(model, drafter, state, prompt, logits, generator, stats) for _ in range(RUNS)
        )
    assert stats.drafted_tokens > 0 and stats.accepted_tokens <= stats.drafted_tokens
    probs: dict[object, float] = {
        (a, b): first[a] * second[a][b] for a, b in itertools.product(second, range(VOCAB)) if first[a] > 0
    }
    probs = {cell: p for cell, p in probs.items() if p > 0}
    rare = [cell for cell, p in probs.items() if p * RUNS < 5]
    if rare:
        probs["rare"] = sum(probs.pop(cell) for cell in rare)
        joint["rare"] = sum(joint.pop(cell, 0) for cell in rare)
    stat, dof = chi_square(joint, probs, RUNS)
    assert stat < chi2_limit(dof), (stat, dof, stats)
