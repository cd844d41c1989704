"""What the decode loop asks of a drafter, and what a drafter answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.speculative.lookup import PromptLookup


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    # The drafter's distribution q at each proposed position [k, V], when it sampled them; None
    # for a deterministic drafter (q one-hot on each token).
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    name: str

    def propose(
        self, seq: Sequence[int], count: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to `count` guesses for the tokens after `seq` (the prompt and every token emitted)."""

    def settle(self, accepted: int) -> None:
        """After the verify of the last proposal: the target kept its first `accepted` tokens."""


class LookupDrafter:
    """Prompt lookup as a Drafter: deterministic, nothing to settle."""

    name = "lookup"

    def __init__(self) -> None:
        self._lookup = PromptLookup()

    def propose(
        self, seq: Sequence[int], count: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(self._lookup.propose(seq, count))

    def settle(self, accepted: int) -> None:
        return None
