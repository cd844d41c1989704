"""How many tokens to draft next: the count that makes the most tokens per second, from the running
acceptance rate and what a verify step of T tokens costs against a plain step.

A verify step of T tokens (T - 1 drafts and the token before them) costs more than a plain step,
by an amount that depends on the device and the model: on a small CPU model one more token costs a
quarter of a plain step up to T = 4 and a third past it. A step that drafts k tokens, each accepted
with probability p while the ones before it were (a geometric model), makes 1 + p + ... + p^k
tokens on average; the count chosen is the k that makes the most of them per unit of its step's
cost, 0 (a plain step) included:

    k = argmax (1 + p + ... + p^k) / cost(k + 1)

p is a running estimate over the recent steps (accepted drafts over accepted drafts plus the
rejections, with older steps weighing less), so a long quote lets k grow and text with nothing to
predict brings it to 0. While k is 0 nothing is learnt about p, so after a number of plain steps
that doubles each time (up to MAX_PAUSE) one draft is tried again.

cost(T) is a prior curve by default (CPU_CURVE, or GRAPHED_CURVE where verify steps replay CUDA
graphs), so the counts depend on the acceptances alone and a seeded sampled answer comes out the
same every time (the drafts a step verifies decide which random draws it takes). Given a `clock`,
the steps' own times replace the prior as they are measured (the time from one `next_count` call
to the next, per T): for a device whose curve differs, where the caller does not need the counts
reproducible (greedy on the CPU's fused layers, whose verify rows are bit for bit the decode
steps', so the tokens never depend on k).

The count is a ceiling: the drafter may propose fewer (prompt lookup proposes none where its match
is too short to trust). Which k is chosen never changes greedy tokens where verify rows equal decode
rows, only the speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Verify steps of up to 16 tokens run in one call of the CPU kernels (gguf_cpu.MAX_TOKENS) and one
# graphed verify on the GPU (graphs.MAX_VERIFY_TOKENS); 7 drafts keep the measured curve short.
DEFAULT_MAX_K = 7
MAX_PAUSE = 64
# Each measurement moves a cost estimate this far; one is clipped to [1/CLIP, CLIP] times the
# estimate first, so a step the OS held up (another program, a page fault) cannot swing it.
COST_SMOOTHING = 0.2
COST_CLIP = 2.0
RATE_MEMORY = 0.75  # weight of the past in the acceptance counts, per verify step
PLAIN_AFTER = 3  # verify steps after which a plain step is measured, if none was yet


@dataclass(frozen=True, slots=True)
class CostCurve:
    """What a verify step of T tokens costs against a plain step, before either is measured:
    1 + jump + slope (T - 1) for T >= 2 (`jump`: what verifying at all costs beyond the tokens)."""

    jump: float
    slope: float

    def __call__(self, tokens: int) -> float:
        return 1.0 if tokens <= 1 else 1.0 + self.jump + self.slope * (tokens - 1)


# The CPU kernels' curve for SmolLM2 (8.0 / 10.1 / 13.5 / 23.9 ms at T = 1 / 2 / 4 / 8 in
# docs/BENCHMARKS.md: 0.26 and 0.21 of a plain step per token up to T = 4, 0.33 past it). Replayed
# over the greedy answers of bench/prompts/quote_back.json with that curve, slope 0.23 made the most
# tokens per second of 0.23 / 0.25 / 0.3 (1.82x / 1.81x / 1.78x speculation off; the curve itself
# as the prior, 1.84x).
CPU_CURVE = CostCurve(jump=0.0, slope=0.23)
# Graphed verify steps on an H200 (docs/BENCHMARKS.md, bench/speculative_gpu.py): a step reads the
# weights once whatever T, so verifying costs a jump and each token little. At T = 2 / 3 / 5 / 9 the
# dense 1.07B model measured 1.30 / 1.30 / 1.34 / 1.35 plain steps and the DeepSeek-V4 synthetic
# model 1.22 / 1.26 / 1.32 / 1.39; the curve (1.30 / 1.32 / 1.37 / 1.47) errs towards drafting less.
GRAPHED_CURVE = CostCurve(jump=0.27, slope=0.025)


@dataclass(slots=True)
class AdaptiveK:
    # The last count chosen (the first step drafts this many, before anything is measured).
    k: int = 2
    k_max: int = DEFAULT_MAX_K
    # The running acceptance counts: drafts accepted and drafts rejected, decayed per step. The
    # prior (0.6 / 0.4) is a doubtful start: it drafts a little and lets the first steps decide.
    accepted: float = 1.5
    rejected: float = 1.0
    idle: int = 0  # plain steps left before drafting again
    pause: int = 2  # the next pause's length
    probe: bool = False  # a pause just ended: draft one token even where the rate says not to
    clock: Callable[[], float] | None = None  # e.g. time.perf_counter: measure the steps' costs
    curve: CostCurve = CPU_CURVE  # the prior: the costs before (or without) a clock
    # What a step of T tokens costs (index T; 0 unused): the prior curve in plain steps without a
    # clock; with one, seconds, None until measured.
    costs: list[float | None] = field(default_factory=list)
    _started: float | None = None  # when the step in progress started (its next_count call)
    _fed: int = 1  # tokens the step in progress fed: 1 until update() says it verified drafts
    _verified: int = 0  # verify steps measured so far

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be at least 1, got {self.k_max}")
        self.k = min(max(self.k, 1), self.k_max)
        if len(self.costs) < self.k_max + 2:
            self.costs = self.costs + [None] * (self.k_max + 2 - len(self.costs))
        if self.clock is None:
            self.costs = [c if c is not None else self.curve(t) for t, c in enumerate(self.costs)]

    @property
    def rate(self) -> float:
        """The running chance that the next draft is accepted, given the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def cost(self, tokens: int) -> float | None:
        """A step of `tokens` tokens in seconds: measured, or else the measured step of the nearest
        size scaled by the prior curve; None while nothing was measured."""
        measured = self.costs[tokens]
        if measured is not None:
            return measured
        nearest = min(
            (t for t, c in enumerate(self.costs) if c is not None),
            key=lambda t: abs(t - tokens),
            default=None,
        )
        if nearest is None:
            return None
        known = self.costs[nearest]
        assert known is not None
        return known * self.curve(tokens) / self.curve(nearest)

    def next_count(self) -> int:
        """How many tokens to draft at this step (0 for a plain step). Called once a step: the time
        since the last call is what that step cost."""
        if self.clock is not None:
            now = self.clock()
            if self._started is not None:
                self._measure(self._fed, now - self._started)
            self._started, self._fed = now, 1
        if self.costs[1] is None and self._verified >= PLAIN_AFTER:
            # Every step so far drafted: one plain step, so that the verifies are weighed against a
            # measured plain step rather than the prior's guess of it (on a GPU an eager verify can
            # cost ten plain steps, where the prior says two).
            return 0
        if self.idle > 0:
            self.idle -= 1
            self.probe = self.idle == 0
            return 0
        best = self._best_count()
        if best == 0:
            if self.probe:  # the rate only moves with drafts: try one after each pause
                self.probe = False
                return 1
            # Nothing pays at this rate: plain steps for a while, then one draft to look again.
            self.idle, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE)
            return 0
        self.probe = False
        self.k = best
        return best

    def update(self, drafted: int, accepted: int) -> None:
        """After a verify step that scored `drafted` proposals and kept `accepted` of them."""
        if drafted <= 0:
            return
        self._fed = drafted + 1
        self.accepted = RATE_MEMORY * self.accepted + accepted
        self.rejected = RATE_MEMORY * self.rejected + (1.0 if accepted < drafted else 0.0)
        if accepted == drafted:
            self.pause = 2

    def _measure(self, tokens: int, seconds: float) -> None:
        if tokens >= len(self.costs) or seconds <= 0.0:
            return
        self._verified += tokens > 1
        known = self.costs[tokens]
        if known is None:
            # A first measurement counts at most COST_CLIP times the prior (a plain step, the
            # first of all, has nothing to compare with).
            prior = self.cost(tokens)
            self.costs[tokens] = seconds if prior is None else min(seconds, COST_CLIP * prior)
            return
        seconds = min(max(seconds, known / COST_CLIP), known * COST_CLIP)
        self.costs[tokens] = known + COST_SMOOTHING * (seconds - known)

    def _best_count(self) -> int:
        """The k in 0..k_max with the most expected tokens per second (the last k while no cost is
        known yet)."""
        plain = self.cost(1)
        if plain is None:
            return self.k
        p = self.rate
        best, best_gain = 0, 1.0 / plain
        expected, term = 1.0, 1.0
        for count in range(1, self.k_max + 1):
            term *= p
            expected += term
            cost = self.cost(count + 1)
            assert cost is not None
            gain = expected / cost
            if gain > best_gain:
                best, best_gain = count, gain
        return best
