"""At temperature > 0, speculative decoding draws every token from exactly the target's
distribution: the acceptance rule and its residual on one position, and the whole decode loop on a
tiny Markov "model" (its logits depend on the last token only, so the exact distribution of a
sequence is a product of table rows), for a deterministic drafter and a sampling draft model.

Expected distributions are written here from their definitions (temperature, top-k, top-p), not
taken from the code under test; the comparisons are chi-square tests at the 0.1% level, with seeded
generators, so they are deterministic."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from ds4desk.engine.api import GenerateStats, SamplingParams
from ds4desk.engine.sampling import sample
from ds4desk.engine.speculative.accept import accept_flags, draw, probabilities, residual
from ds4desk.engine.speculative.adaptive import AdaptiveK
from ds4desk.engine.speculative.decode import SpeculativeDecode
from ds4desk.engine.speculative.drafter import Proposal

V = 5
# The 99.9% points of the chi-square distribution (standard tables) by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def chi2_limit(dof: int) -> float:
    """The 99.9% point: the table, else the Wilson-Hilferty approximation (z = 3.09)."""
    if dof in CHI2_999:
        return CHI2_999[dof]
    h = 2 / (9 * dof)
    return dof * (1 - h + 3.09 * math.sqrt(h)) ** 3


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


def expected(logits: Sequence[float], params: SamplingParams) -> list[float]:
    """The sampler's distribution from its definition: softmax(logits / T) over the k most likely
    tokens, then the smallest set of the most likely whose mass reaches top_p, renormalised."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[: params.top_k] if params.top_k > 0 else order
    weights = {i: math.exp(logits[i] / params.temperature) for i in kept}
    total = sum(weights.values())
    if params.top_p < 1.0:
        mass, chosen = 0.0, []
        for i in kept:
            if mass >= params.top_p:
                break
            chosen.append(i)
            mass += weights[i] / total
        weights = {i: weights[i] for i in chosen}
        total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(len(logits))]


def chi_square(counts: Counter[object], probs: dict[object, float], draws: int) -> tuple[float, int]:
    """The statistic over the cells of nonzero probability, and its degrees of freedom; a draw in a
    cell of probability zero fails at once."""
    assert all(probs.get(cell, 0.0) > 0 for cell in counts), f"impossible draws: {counts}"
    cells = [cell for cell, p in probs.items() if p > 0]
    stat = sum((counts[cell] - draws * probs[cell]) ** 2 / (draws * probs[cell]) for cell in cells)
    return stat, len(cells) - 1


def assert_matches(counts: Counter[object], probs: dict[object, float], draws: int) -> None:
    stat, dof = chi_square(counts, probs, draws)
    # Cells sparse enough for the table: merge is not needed with these sizes, but check it.
    assert min(draws * p for p in probs.values() if p > 0) >= 5
    assert stat < chi2_limit(dof), (stat, dof)


def test_probabilities_are_what_the_sampler_draws_from() -> None:
    """speculative/accept.probabilities against sampling.sample and against the definition."""
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, 0.0])
    generator = torch.Generator().manual_seed(1)
    for params in SETTINGS:
        want = expected(logits.tolist(), params)
        assert probabilities(logits, params).tolist() == pytest.approx(want, abs=1e-6)
        draws = 6000
        counts = Counter(int(sample(logits, params, generator)[0]) for _ in range(draws))
        assert_matches(counts, dict(enumerate(want)), draws)
    greedy = probabilities(logits, SamplingParams())
    assert greedy.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("drafter", ["one-hot", "distribution"])
@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "top-k", "top-p"])
def test_accept_or_resample_gives_the_target_distribution(drafter: str, params: SamplingParams) -> None:
    target_logits = torch.tensor([0.5, 1.5, -1.0, 0.2, 1.0])
    p = probabilities(target_logits, params)
    q = torch.tensor([0.05, 0.1, 0.5, 0.15, 0.2])  # puts mass where p has little or none
    generator = torch.Generator().manual_seed(7)
    draws, counts = 4000, Counter[object]()
    for index in range(draws):
        if drafter == "one-hot":
            token, draft_q = index % V, None  # a deterministic guess that cycles through the vocabulary
        else:
            token, draft_q = int(draw(q, generator)), q
        passed = accept_flags(
            p.view(1, V), torch.tensor([token]), None if draft_q is None else draft_q.view(1, V), generator
        )
        if bool(passed[0]):
            counts[token] += 1
        else:
            counts[int(draw(residual(p, draft_q, token), generator))] += 1
    want = expected(target_logits.tolist(), params)
    assert_matches(counts, dict(enumerate(want)), draws)


class MarkovModel:
    """The decode loop's view of a model: logits depend on the last token only (table[token])."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.device = torch.device("cpu")
        self.context = 10_000
        self.supports_speculation = True

    def forward(self, ids: torch.Tensor, start_pos: int, logits: str = "last") -> torch.Tensor:
        rows = self.table[ids]
        return rows if logits == "all" else rows[-1]

    def max_verify_tokens(self) -> int | None:
        return None

    def verify_checkpoint(self, start_pos: int, count: int) -> None:
        return None

    def verify_rollback(self, saved: None, start_pos: int, kept: int) -> None:
        return None


class GuessDrafter:
    """Deterministic: proposes (last + 1) % V, (last + 2) % V, ... (q one-hot)."""

    name = "guess"

    def propose(self, seq, count, sampling, generator) -> Proposal:  # type: ignore[no-untyped-def]
        return Proposal([(seq[-1] + i) % V for i in range(1, count + 1)])

    def settle(self, accepted: int) -> None:
        pass


class MarkovDraft:
    """A sampling draft model: its own Markov table, its tokens drawn from its processed q."""

    name = "draft"

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def propose(self, seq, count, sampling, generator) -> Proposal:  # type: ignore[no-untyped-def]
        last, tokens, rows = seq[-1], [], []
        for _ in range(count):
            q = probabilities(self.table[last], sampling)
            last = int(draw(q, generator))
            tokens.append(last)
            rows.append(q)
        return Proposal(tokens, torch.stack(rows))

    def settle(self, accepted: int) -> None:
        pass


def first_tokens(
    model: MarkovModel, drafter: object, params: SamplingParams, generator: torch.Generator, length: int
) -> tuple[list[int], GenerateStats]:
    """One speculative run from token 0: its first `length` tokens and its stats."""
    tokens: list[int] = []
    stats = GenerateStats()

    def emit(token: int, _logprob: float) -> bool:
        tokens.append(token)
        stats.generated_tokens += 1
        return len(tokens) >= length

    table = model.table
    loop = SpeculativeDecode(
        model,  # type: ignore[arg-type]
        model,  # type: ignore[arg-type]
        drafter,  # type: ignore[arg-type]
        params,
        generator,
        None,
        stats,
        emit,
        lambda token, _pos: table[int(token)],
        length,
        AdaptiveK(k=2),
    )
    loop.run([0], table[0], 1)
    return tokens, stats


@pytest.mark.parametrize("drafter", ["guess", "draft"])
@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "top-k", "top-p"])
def test_the_decode_loop_samples_the_target_sequence_distribution(
    drafter: str, params: SamplingParams
) -> None:
    """The first three tokens, over many runs: their joint distribution is the product of the
    target's rows, whatever the drafter proposed and however much of it was accepted (the first
    token is a plain draw; the second and third come out of verify steps and residuals)."""
    torch.manual_seed(3)
    table = torch.randn(V, V) * 1.5
    model = MarkovModel(table)
    generator = torch.Generator().manual_seed(11)
    draft_table = table + torch.randn(V, V)  # close to the target's, not equal
    length, runs = 3, 2500
    joint: Counter[object] = Counter()
    drafted = accepted = 0
    for _ in range(runs):
        drafter_now = GuessDrafter() if drafter == "guess" else MarkovDraft(draft_table)
        tokens, stats = first_tokens(model, drafter_now, params, generator, length)
        joint[tuple(tokens)] += 1
        drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # both paths (accept, resample) were taken
    rows = [expected(table[i].tolist(), params) for i in range(V)]
    first = expected(table[0].tolist(), params)
    probs: dict[object, float] = {
        (a, b, c): first[a] * rows[a][b] * rows[b][c] for a, b, c in itertools.product(range(V), repeat=3)
    }
    # Merge the rare pairs (expected count under 5) into one cell, as the chi-square table needs.
    rare = [cell for cell, p in probs.items() if 0 < p * runs < 5]
    if rare:
        probs["rare"] = sum(probs.pop(cell) for cell in rare)
        joint["rare"] = sum(joint.pop(cell, 0) for cell in rare)
    stat, dof = chi_square(joint, probs, runs)
    assert stat < chi2_limit(dof), (stat, dof)
