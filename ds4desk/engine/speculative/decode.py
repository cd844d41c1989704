"""The speculative decode loop: each step emits the target's token, drafts a few more, scores them
all in one target forward and keeps the longest prefix the target agrees with.

Positions: `pos` is the number of positions in the target's cache, `logits` the target's logits for
position `pos`. A step picks the token at `pos` from them (forced by the thinking budget, drawn from
the residual a rejection left, or sampled as without speculation) and emits it; then it feeds that
token and the k drafts at pos..pos+k in one forward, whose row i gives the logits after input i.
Draft i (1-based) is tested against row i-1; when j drafts pass, the cache keeps pos..pos+j, the
rest is rolled back, and row j is the logits for the next step. A step with no drafts is a plain
decode step. When the answer ends on a token, that token is not fed, exactly as without
speculation, so a snapshot saved after the answer holds the same state either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ds4desk.engine.api import GenerateStats, SamplingParams
from ds4desk.engine.budget import ThinkingGate
from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.sampling import logprob_of, sample
from ds4desk.engine.speculative.accept import accept_flags, draw, probabilities, residual
from ds4desk.engine.speculative.adaptive import AdaptiveK
from ds4desk.engine.speculative.drafter import Drafter
from ds4desk.engine.speculative.rollback import Rollback

# emit(token, logprob) -> True when the answer has ended (stop token, length, cancel).
Emit = Callable[[int, float], bool]
# step(token, pos) -> the target's logits after feeding `token` at `pos` (the plain decode step).
PlainStep = Callable[[torch.Tensor, int], torch.Tensor]
# verify(ids, pos) -> logits [T, V] after each of ids fed at pos.. from a captured graph, or None
# where there is none for them (graphs.GraphedDecode.verify); then the model's forward runs it.
GraphedVerify = Callable[[torch.Tensor, int], torch.Tensor | None]


@dataclass(slots=True)
class _Rejected:
    """What the next pick needs after a rejected draft: the drafter's q there (None: one-hot)."""

    token: int
    probs: torch.Tensor | None


@dataclass(slots=True)
class SpeculativeDecode:
    model: CausalLM
    hooks: Rollback
    drafter: Drafter
    sampling: SamplingParams
    generator: torch.Generator | None
    gate: ThinkingGate | None
    stats: GenerateStats
    emit: Emit
    plain_step: PlainStep
    max_new_tokens: int
    adaptive: AdaptiveK = field(default_factory=AdaptiveK)
    graphed_verify: GraphedVerify | None = None

    def run(self, seq: list[int], logits: torch.Tensor, pos: int) -> tuple[int, torch.Tensor]:
        """Decode from `logits` at `pos` (seq: the prompt, extended in place with what is emitted)
        until the answer ends; returns the final (pos, logits), as the plain loop leaves them."""
        preset: int | None = None  # a forced token the verify already took from the gate
        rejected: _Rejected | None = None
        limit = self.hooks.max_verify_tokens()
        while True:
            forced = preset if preset is not None else self.gate.forced_token() if self.gate else None
            preset = None
            token_t = self._pick(logits, forced, rejected)
            rejected = None
            logprob_t = logprob_of(logits, token_t)
            token_f, logprob = torch.stack((token_t.double(), logprob_t.double())).tolist()
            token = int(token_f)
            if self.emit(token, logprob):
                return pos, logits
            seq.append(token)
            count = min(
                self.adaptive.next_count(),
                self.max_new_tokens - self.stats.generated_tokens,
                self.model.context - pos - 1,
                (limit - 1) if limit is not None else self.adaptive.k_max,
            )
            drafts = self.drafter.propose(seq, count, self.sampling, self.generator) if count > 0 else None
            if drafts is None or not drafts.tokens:
                logits = self.plain_step(token_t.view(1), pos)
                pos += 1
                continue
            outcome = self._verify(seq, token, drafts.tokens, drafts.probs, pos)
            pos, logits, preset, rejected, finished = outcome
            if finished:
                return pos, logits

    def _pick(self, logits: torch.Tensor, forced: int | None, rejected: _Rejected | None) -> torch.Tensor:
        if forced is not None:
            return torch.tensor(forced, device=logits.device)
        if rejected is not None and not self.sampling.greedy:
            # The residual norm(max(0, p - q)): with the acceptances, exactly the target's p.
            left = residual(probabilities(logits, self.sampling), rejected.probs, rejected.token)
            return draw(left, self.generator)
        return sample(logits, self.sampling, self.generator)[0]

    def _verify(
        self, seq: list[int], token: int, drafts: list[int], probs: torch.Tensor | None, pos: int
    ) -> tuple[int, torch.Tensor, int | None, _Rejected | None, bool]:
        count = len(drafts)
        device = self.model.device
        ids = torch.tensor([token, *drafts], dtype=torch.long, device=device)
        saved = self.hooks.verify_checkpoint(pos, count + 1)
        scored = self.graphed_verify(ids, pos) if self.graphed_verify is not None else None
        if scored is None:
            scored = self.model.forward(ids, pos, "all")  # [count + 1, V]
        assert scored is not None
        rows = scored[:count]
        drafted = ids[1:].to(rows.device)
        if probs is not None:
            probs = probs.to(rows.device)
        if probs is None and self.sampling.greedy:
            # What the one-hot test of accept_flags decides, without building k one-hot rows of V.
            flags = rows.argmax(-1) == drafted
        else:
            flags = accept_flags(probabilities(rows, self.sampling), drafted, probs, self.generator)
        logprobs = rows.gather(1, drafted.view(-1, 1)).squeeze(1) - torch.logsumexp(rows, dim=1)
        host = torch.cat((flags.double(), logprobs.double())).tolist()  # one sync for the step
        passed, logprob_of = host[:count], host[count:]
        self.stats.drafted_tokens += count
        accepted = 0
        preset: int | None = None
        rejected: _Rejected | None = None
        finished = False
        for index, draft in enumerate(drafts):
            forced = self.gate.forced_token() if self.gate is not None else None
            if forced is not None and forced != draft:
                preset = forced  # the budget decides this position: the draft is dead
                break
            if forced is None and not passed[index]:
                rejected = _Rejected(draft, None if probs is None else probs[index])
                break
            self.stats.accepted_tokens += 1
            if self.emit(draft, logprob_of[index]):
                finished = True  # emitted, but not fed: the plain loop would not feed it either
                break
            accepted += 1
            seq.append(draft)
        kept = accepted + 1  # the step's own token and the drafts fed after it
        self.hooks.verify_rollback(saved, pos, kept)
        self.drafter.settle(accepted)
        self.adaptive.update(count, accepted + (1 if finished else 0))
        return pos + kept, scored[accepted], preset, rejected, finished
