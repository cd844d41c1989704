"""How many tokens to draft next: more while the target keeps accepting them, fewer when it does not,
and none for a while when even one is mostly rejected.

A verify step scores every drafted token whether or not it is kept, so drafting past what will be
accepted costs target work (and a draft model's own steps) for nothing; drafting too few leaves
accepted tokens on the table. The running acceptance rate (an exponential average over steps)
moves k one step at a time inside 1..k_max. A step that kept nothing while the rate is low pauses
drafting (plain decode steps) for a number of steps that doubles with each such pause until a step
keeps everything, then probes again: on text with nothing to predict, speculation then costs little.
"""

from __future__ import annotations

from dataclasses import dataclass

# On the CPU a verify of up to 8 tokens (k = 7 plus the token before them) still runs the packed
# weights' GEMV, which reads each weight once for all its rows (kernels/quant/gguf_cpu.GEMV_MAX_T);
# one more token switches to the dequantizing prefill path, which costs far more per step.
DEFAULT_MAX_K = 7
MAX_PAUSE = 64


@dataclass(slots=True)
class AdaptiveK:
    # Start small and doubtful: a first guess is cheap to lose, and k grows by one with every step
    # that keeps all its drafts.
    k: int = 2
    k_max: int = DEFAULT_MAX_K
    rate: float = 0.4  # the running acceptance rate
    smoothing: float = 0.3  # weight of the latest step in the average
    grow_above: float = 0.5
    shrink_below: float = 0.35
    pause_below: float = 0.3
    idle: int = 0  # steps left without drafting
    pause: int = 2  # the next pause's length

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be at least 1, got {self.k_max}")
        self.k = min(max(self.k, 1), self.k_max)

    def next_count(self) -> int:
        """How many tokens to draft at this step (0 while paused)."""
        if self.idle > 0:
            self.idle -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        """After a verify step that scored `drafted` proposals and kept `accepted` of them."""
        if drafted <= 0:
            return
        self.rate += self.smoothing * (accepted / drafted - self.rate)
        if accepted == drafted:
            self.pause = 2
            if self.rate >= self.grow_above:
                self.k = min(self.k + 1, self.k_max)
            return
        if accepted == 0 and self.rate < self.pause_below:
            # Nothing kept, and not for a while: stop drafting for a time, longer each time.
            self.idle, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE)
        if self.rate < self.shrink_below:
            self.k = max(self.k - 1, 1)
