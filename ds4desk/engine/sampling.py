"""Choosing the next token from one row of logits, on the logits' device (batch size 1).

Nothing here synchronises with the device: the token and its log-probability come back as 0-d
tensors, and the random draw uses the exponential race (argmax of p / Exp(1) noise picks index i
with probability p_i) instead of a host-side comparison.
"""

from __future__ import annotations

import math

import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams


def check_sampling(params: SamplingParams) -> None:
    """BAD_REQUEST for settings that have no meaning (checked once per request, not per token)."""
    if not math.isfinite(params.temperature):
        raise EngineFailure(
            ErrorCode.BAD_REQUEST, f"temperature must be a finite number, got {params.temperature}"
        )
    if not 0.0 < params.top_p <= 1.0:
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"top_k must be 0 (off) or positive, got {params.top_k}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for one request: seeded when a seed is given, freshly random otherwise."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()  # nondeterministic, and independent of torch's global RNG state
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick a token from float32 logits [V]. Returns (token: 0-d long, logprob: 0-d float32).

    The logprob is the token's natural log-probability under the raw logits, before temperature
    and truncation, so it describes the model rather than the sampler.
    """
    token = torch.argmax(logits) if params.greedy else _draw(logits, params, generator)
    return token, logprob_of(logits, token)


def logprob_of(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The 0-d token's log-probability under float32 logits [V], as a 0-d tensor. A gather, not
    logits[token]: indexing with a 0-d tensor reads it back to the host first (a wait for the
    device, in the middle of the launches that follow a forward)."""
    return logits.gather(0, token.view(1))[0] - torch.logsumexp(logits, dim=0)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    scaled = logits / params.temperature
    indices: torch.Tensor | None = None
    if 0 < params.top_k < scaled.shape[0]:
        scaled, indices = torch.topk(scaled, params.top_k)  # sorted, largest first
    elif params.top_p < 1.0:
        scaled, indices = torch.sort(scaled, descending=True)
    if params.top_p < 1.0:
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p: a token stays
        # when the mass strictly before it is still short of top_p (so the first always stays).
        probs = torch.softmax(scaled, dim=0)
        before = torch.cumsum(probs, dim=0) - probs
        scaled = scaled.masked_fill(before >= params.top_p, float("-inf"))
    probs = torch.softmax(scaled, dim=0)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    choice = torch.argmax(probs / noise)
    return choice if indices is None else indices.gather(0, choice.view(1))[0]  # no host read
