"""Prompt lookup's choice of occurrence and AdaptiveK's choice of draft count (speculative/lookup.py,
speculative/adaptive.py): the occurrence that agrees with the tail longest, a count that maximises
the expected tokens per second of measured step costs, pauses and probes where drafting does not pay.
Neither can change the tokens (test_greedy_identity.py runs them through the decode loop); these
tests pin what makes them fast."""

from __future__ import annotations

import random

import pytest

from ds4desk.engine.speculative.adaptive import COST_CLIP, CPU_CURVE, GRAPHED_CURVE, AdaptiveK
from ds4desk.engine.speculative.lookup import PromptLookup


def test_lookup_takes_the_occurrence_that_agrees_longest() -> None:
    # "7 8" occurs twice before the tail; only the first is preceded by "5 6" as the tail is.
    seq = [5, 6, 7, 8, 1, 2, 3, 9, 7, 8, 4, 4, 4, 0, 5, 6, 7, 8]
    lookup = PromptLookup()
    assert lookup.propose(seq, 3) == [1, 2, 3]
    assert lookup.last_match == 4


def test_lookup_takes_the_latest_of_equal_matches_and_stops_at_the_sequence_end() -> None:
    seq = [1, 7, 8, 2, 3, 1, 7, 8, 4, 5, 1, 7, 8]
    assert PromptLookup().propose(seq, 4) == [4, 5, 1, 7]
    # The continuation runs into the tail itself: never past the last token.
    assert PromptLookup().propose([3, 4, 3, 4], 5) == [3, 4]


def test_lookup_drafts_nothing_from_a_single_matching_token() -> None:
    lookup = PromptLookup()
    assert lookup.propose([1, 2, 3, 9, 3], 4) == []  # only "3" recurs: too weak a match
    assert lookup.last_match == 0
    assert PromptLookup().propose([1, 2, 3, 9, 2, 3], 0) == []
    assert PromptLookup().propose([1, 2, 3, 9, 2, 3], 4) == [9, 2, 3]
    with pytest.raises(ValueError):
        PromptLookup(min_match=1)


def test_lookup_indexes_a_growing_sequence_as_a_fresh_one_would() -> None:
    rng = random.Random(4)
    seq = [rng.randrange(6) for _ in range(40)]
    growing = PromptLookup()
    for end in range(3, len(seq) + 1):
        count = rng.randrange(1, 8)
        assert growing.propose(seq[:end], count) == PromptLookup().propose(seq[:end], count), end


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(adaptive: AdaptiveK, clock: Clock, cost, accept, steps: int) -> list[int]:
    """Runs `steps` steps as the decode loop does: next_count, then (when drafting) update, with
    step costs cost(T) and accept(k) drafts of k accepted. Returns the counts chosen."""
    counts = []
    for _ in range(steps):
        count = adaptive.next_count()
        counts.append(count)
        if count:
            adaptive.update(count, accept(count))
        clock.now += cost(count + 1)
    return counts


def test_k_grows_to_the_most_where_drafts_are_cheap_and_always_accepted() -> None:
    clock = Clock()
    adaptive = AdaptiveK(clock=clock)
    counts = _steps(adaptive, clock, lambda t: 1.0 + 0.05 * (t - 1), lambda k: k, 12)
    assert counts[-1] == adaptive.k_max
    assert adaptive.rate > 0.9


def test_the_count_maximises_expected_tokens_per_second_of_the_measured_costs() -> None:
    clock = Clock()
    adaptive = AdaptiveK(clock=clock, k_max=7)
    curve = {1: 8.0, 2: 10.1, 3: 11.8, 4: 13.5, 5: 16.1, 6: 18.7, 7: 21.3, 8: 23.9}
    for tokens, cost in curve.items():  # every size measured, exactly
        adaptive.costs[tokens] = cost
    chosen = []
    for accepted, rejected in ((1.0, 9.0), (6.0, 4.0), (8.5, 1.5), (30.0, 0.5)):
        adaptive.accepted, adaptive.rejected = accepted, rejected
        p = accepted / (accepted + rejected)
        gains = [sum(p**i for i in range(k + 1)) / curve[k + 1] for k in range(8)]
        want = max(range(8), key=lambda k: gains[k])
        assert adaptive._best_count() == want, p
        chosen.append(want)
    # A low rate drafts nothing, a high one the most, one between something between.
    assert chosen[0] == 0 and chosen[-1] == 7 and 0 < chosen[1] < 7


def test_where_verifying_costs_too_much_it_pauses_and_probes_with_one_draft() -> None:
    clock = Clock()
    adaptive = AdaptiveK(clock=clock)
    # A verify costs five plain steps (an eager verify against graphed steps): never pays.
    counts = _steps(adaptive, clock, lambda t: 1.0 if t == 1 else 5.0, lambda k: k // 2, 40)
    assert counts[0] == 2 and 0 in counts
    # Once a plain step is measured, only the probes after each pause draft, one token each.
    after = counts[counts.index(0) + 1 :]
    drafting = [c for c in after if c]
    assert drafting and set(drafting) == {1}, counts
    assert len(drafting) <= 5, counts  # pauses that double: 2, 4, 8, 16 ... plain steps between


def test_a_plain_step_is_measured_even_where_every_step_could_draft() -> None:
    clock = Clock()
    adaptive = AdaptiveK(clock=clock)
    counts = _steps(adaptive, clock, lambda t: 1.0 if t == 1 else 12.0, lambda k: k // 2, 6)
    assert 0 in counts[:5], counts
    assert adaptive.costs[1] == 1.0


def test_an_outlier_step_moves_the_cost_estimate_a_bounded_amount() -> None:
    clock = Clock()
    adaptive = AdaptiveK(clock=clock)
    adaptive.costs[1] = 1.0
    adaptive.next_count()
    adaptive.idle = 10  # plain steps from here
    clock.now += 1000.0  # the OS held the process for a long time
    adaptive.next_count()
    assert adaptive.costs[1] == pytest.approx(1.0 + 0.2 * (COST_CLIP - 1.0))


def test_without_a_clock_the_counts_depend_on_the_acceptances_alone() -> None:
    """The default: a seeded sampled answer must come out the same however long its steps took."""
    runs = []
    for step_cost in (lambda t: 1.0, lambda t: 1.0 + 4.0 * (t - 1)):
        adaptive = AdaptiveK()
        counts = []
        for step in range(30):
            count = adaptive.next_count()
            counts.append(count)
            if count:
                adaptive.update(count, count if step % 5 else count // 2)
            step_cost(count + 1)
        runs.append(counts)
    assert runs[0] == runs[1]
    assert max(runs[0]) > 2  # the prior curve lets k grow where drafts keep being accepted


@pytest.mark.parametrize("rate", [0.6, 0.8])
def test_graphed_verify_steps_draft_more_at_the_same_rate(rate: float) -> None:
    """Where a verify replays a graph (GRAPHED_CURVE: nearly one plain step whatever T), the same
    acceptance rate drafts more than on the CPU's curve, the count that maximises each curve's own
    expected tokens per step cost."""
    counts = {}
    for name, curve in (("cpu", CPU_CURVE), ("graphed", GRAPHED_CURVE)):
        adaptive = AdaptiveK(curve=curve, k_max=7)
        adaptive.accepted, adaptive.rejected = rate, 1.0 - rate
        gains = [sum(rate**i for i in range(k + 1)) / curve(k + 1) for k in range(8)]
        counts[name] = adaptive._best_count()
        assert counts[name] == max(range(8), key=lambda k: gains[k])
    assert counts["graphed"] > counts["cpu"] >= 1, counts
