"""A draft model: a small dense model with the target's vocabulary, drafting from its own cache.

The draft keeps the tokens whose cache entries are valid (`fed`). Each proposal first feeds what
the target emitted since (the whole prompt on a request's first step), then drafts one token per
step; after the target's verify, `settle` rolls the cache back to the drafts the target kept, so
`fed` is always a prefix of the sequence. A later request continues from `fed` when its prompt
starts with it (a chat's next turn), else the draft prefills from position 0.

On a GPU whose target decodes through captured graphs a dense draft does too: its drafting steps
replay its own decode graphs, and a short catch-up (the tokens the target kept) its prompt-piece
graphs, so a proposal of k tokens costs k replays rather than k eager forwards' launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.graphs import GraphedDecode
from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.speculative.accept import draw, probabilities
from ds4desk.engine.speculative.drafter import Proposal
from ds4desk.engine.speculative.rollback import Rollback, rollback_of


def check_draft_pair(target: CausalLM, draft: CausalLM, draft_name: str) -> None:
    """LOAD_FAILED unless `draft` can draft for `target`: the same vocabulary, and a cache that rolls
    back. Works on meta models (before any memory is taken)."""
    if rollback_of(draft) is None:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"the draft model {draft_name} cannot roll its cache back; a draft must be a Llama, "
            "Mistral, Qwen2, Qwen3, Gemma 3, Qwen3.5 or DeepSeek-V4 model",
        )
    if draft.vocab_size != target.vocab_size:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"the draft model {draft_name} has a vocabulary of {draft.vocab_size} tokens and the target "
            f"{target.vocab_size}: a draft must share the target's tokenizer",
        )


def _rolls_back_graph_steps(model: CausalLM) -> bool:
    """Whether `model`'s roll-back undoes steps a graph replayed: a family whose verify runs in a
    graph and that may feed a position again. DeepSeek-V4 and Qwen3.5 only continue: their
    roll-backs recompute from what their eager steps record (compressor inputs, delta-rule inputs),
    which a decode graph's step does not."""
    return model.has_graphable_verify and getattr(model, "rewinds", True)


class DraftModel:
    """Owns `model`'s cache for `context` positions; `path` and `weight_bytes` describe it."""

    name = "draft"

    def __init__(
        self, model: CausalLM, context: int, chunk: int, path: str, weight_bytes: int, graphs: bool = False
    ) -> None:
        """`graphs`: capture the draft's own decode graphs (a CUDA device), where its roll-back
        undoes what they write."""
        hooks = rollback_of(model)
        if hooks is None:
            raise EngineFailure(ErrorCode.LOAD_FAILED, f"the draft model {path} cannot roll its cache back")
        self.model = model
        self.path = path
        self.weight_bytes = weight_bytes
        self.chunk = chunk
        self._hooks: Rollback = hooks
        model.allocate_cache(context)
        self.context = context
        self.graphs = (
            GraphedDecode(model, model.device) if graphs and _rolls_back_graph_steps(model) else None
        )
        self.fed: list[int] = []
        # The last proposal's roll-back: (checkpoint, first draft position, drafts fed, tokens).
        self._pending: tuple[Any, int, list[int]] | None = None

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.model.free_cache()
        self.fed = []
        self._pending = None

    def bytes(self) -> int:
        return self.weight_bytes + self.model.cache_bytes()

    def propose(
        self, seq: Sequence[int], count: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        # Positions written: the catch-up up to len(seq) - 1, then drafts 1..count-1 after it.
        count = min(count, self.context - len(seq) + 1)
        limit = self._hooks.max_verify_tokens()
        if limit is not None:
            count = min(count, limit + 1)
        if count <= 0 or not seq:
            return Proposal([])
        try:
            return self._propose(seq, count, sampling, generator)
        except Exception:
            self.fed, self._pending = [], None  # whatever the cache holds now is not trusted
            raise

    def _propose(
        self, seq: Sequence[int], count: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        model, device = self.model, self.model.device
        fed = len(self.fed)
        if fed > len(seq) or list(seq[:fed]) != self.fed:
            fed = 0  # not a prefix: rows past the common part may have overwritten ring rows
        fed = min(fed, len(seq) - 1)  # the last token is fed again for the logits after it
        if fed < len(self.fed) and not getattr(model, "rewinds", True):
            fed = 0  # a model that only continues (DeepSeek-V4's compressors) cannot feed it again
        ids = torch.tensor(list(seq[fed:]), dtype=torch.long, device=device)
        logits = self.graphs.prefill(ids, fed) if self.graphs is not None else None
        if logits is None:
            for begin in range(0, ids.shape[0], self.chunk):
                part = ids[begin : begin + self.chunk]
                last = begin + self.chunk >= ids.shape[0]
                logits = model.forward(part, fed + begin, "last" if last else "none")
        assert logits is not None
        start = len(seq)
        saved = self._hooks.verify_checkpoint(start, count - 1) if count > 1 else None
        picks: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for index in range(count):
            if sampling.greedy:
                pick = torch.argmax(logits)
            else:
                q = probabilities(logits, sampling)
                pick = draw(q, generator)
                rows.append(q)
            picks.append(pick)
            if index + 1 < count:
                if self.graphs is not None:  # the logits in the graph's buffer: read before the next
                    logits = self.graphs.step(pick.view(1), start + index)[0]
                else:
                    logits = model.forward(pick.view(1), start + index, "last")
                assert logits is not None
        tokens = [int(t) for t in torch.stack(picks).tolist()]  # the one host sync of the proposal
        self.fed = list(seq) + tokens[: count - 1]
        self._pending = (saved, start, tokens[: count - 1])
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def settle(self, accepted: int) -> None:
        if self._pending is None:
            return
        saved, start, drafted = self._pending
        self._pending = None
        kept = min(accepted, len(drafted))
        if saved is not None:
            self._hooks.verify_rollback(saved, start, kept)
        self.fed = self.fed[: start + kept]

    def forget(self) -> None:
        """A proposal that was never verified (an error on the way): start over next time."""
        self.fed, self._pending = [], None
