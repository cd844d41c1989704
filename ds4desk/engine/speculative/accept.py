"""The acceptance rules of speculative decoding.

Greedy: a drafted token stands when it is the target's argmax at its position. Sampled: the
standard rejection rule, so the tokens that come out are distributed exactly as the target's own
samples: accept draft d (drawn from q) with probability min(1, p(d) / q(d)); on a rejection draw
the position's token from norm(max(0, p - q)). p and q are the distributions the sampler would draw
from (temperature, top-k and top-p applied, as `sampling.sample` applies them); a deterministic
drafter (prompt lookup, a greedy draft) has a one-hot q.
"""

from __future__ import annotations

import torch

from ds4desk.engine.api import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sampling.sample` draws from, for logits [..., V]: float32 [..., V].

    The same steps as sampling._draw, written over the last dimension so k verify rows go at once:
    scale by temperature, keep the top-k, then the smallest sorted prefix whose mass reaches top-p."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    indices: torch.Tensor | None = None
    if 0 < params.top_k < vocab:
        scaled, indices = torch.topk(scaled, params.top_k, dim=-1)
    elif params.top_p < 1.0:
        scaled, indices = torch.sort(scaled, dim=-1, descending=True)
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        scaled = scaled.masked_fill(before >= params.top_p, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if indices is None:
        return probs
    full = torch.zeros((*probs.shape[:-1], vocab), dtype=probs.dtype, device=probs.device)
    return full.scatter_(-1, indices, probs)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index drawn from probs [V] (0-d long), by the exponential race sampling.py uses: no host
    sync, and a zero-probability index can never win."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / noise)


def accept_flags(
    target: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Whether each drafted token passes its test, as bool [k] (on the device; the caller reads it
    with the other values of the step in one copy).

    `target` [k, V] is p at each drafted position, `drafts` [k] the tokens, `draft_probs` [k, V]
    the drafter's q (None: one-hot on the drafts). Greedy callers pass one-hot p (probabilities()
    does for greedy params), which makes the test the argmax agreement with no random draw."""
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    p = target[rows, drafts]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, drafts]
    if generator is None:  # greedy: p is one-hot, so the ratio is 1 or 0
        return p >= q
    u = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype)
    # u < p / q, written without the division (q > 0: the draft was drawn from it).
    return u * q < p


def residual(target: torch.Tensor, draft: torch.Tensor | None, drafted: int) -> torch.Tensor:
    """norm(max(0, p - q)) [V] after the draft `drafted` was rejected at this position (q: the
    drafter's distribution there, None: one-hot on `drafted`). When rounding leaves no mass, p."""
    if draft is None:
        left = target.clone()
        left[drafted] = 0.0
    else:
        left = (target - draft).clamp_(min=0.0)
    total = left.sum()
    return torch.where(total > 0, left / total.clamp(min=torch.finfo(left.dtype).tiny), target)
