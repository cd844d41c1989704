"""The MTP drafter: a model's own multi-token-prediction block drafts the next tokens.

DeepSeek-V4 checkpoints carry one MTP block (models/deepseek_v4/mtp.py has its math and cache).
It drafts from the target's hidden state at its last position and the token just chosen, and
chains for more: its own output stands in for the target's hidden state at the next position. A
model offers it through three members: `has_mtp`, `set_mtp_tracking(on)` (the block follows every
forward of the target from the request's prefill on; off by default, since it costs a layer) and
`mtp_ready(length)` / `mtp_draft(token, count, choose)`. The block's cache rolls back with the
target's (the model's verify hooks), so the drafter keeps no state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.speculative.accept import draw, probabilities
from ds4desk.engine.speculative.drafter import Proposal
from ds4desk.engine.speculative.rollback import rollback_of


def mtp_available(model: object) -> bool:
    """Whether `model` can draft with its own MTP block: it has one, and its cache rolls back."""
    return bool(getattr(model, "has_mtp", False)) and rollback_of(model) is not None


def track_mtp(model: object, on: bool) -> None:
    """Before a request's prefill: let the model's MTP block follow the target (on: the request
    drafts with it) or stop it (off: no layer of cost for nothing). Nothing for other models."""
    if mtp_available(model):
        model.set_mtp_tracking(on)  # type: ignore[attr-defined]


class MtpDrafter:
    """Drafts with `model`'s MTP block; the model follows the target itself (track_mtp on)."""

    name = "mtp"

    def __init__(self, model: Any) -> None:
        if not mtp_available(model):
            raise ValueError("this model has no MTP block that can draft")
        self.model = model

    def propose(
        self, seq: Sequence[int], count: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        # The target holds every token of seq but the last (the one it just chose).
        if count <= 0 or not self.model.mtp_ready(len(seq) - 1):
            return Proposal([])
        rows: list[torch.Tensor] = []

        def choose(logits: torch.Tensor) -> torch.Tensor:
            if sampling.greedy:
                return torch.argmax(logits)
            q = probabilities(logits, sampling)
            rows.append(q)
            return draw(q, generator)

        picks = self.model.mtp_draft(seq[-1], count, choose)
        if not picks:
            return Proposal([])
        tokens = [int(t) for t in torch.stack(picks).tolist()]  # the one host sync of the proposal
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def settle(self, accepted: int) -> None:
        return None  # the block's cache rolled back with the target's
