"""One loaded model and its KV cache: chunked prefill, the decode loop, sampling and stats."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ds4desk.engine.api import (
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateStats,
    SamplingParams,
    ThinkingBudget,
)
from ds4desk.engine.budget import ThinkingGate
from ds4desk.engine.models.registry import CausalLM
from ds4desk.engine.sampling import check_sampling, make_generator, sample


@dataclass(slots=True)
class RunOutcome:
    tokens: list[int] = field(default_factory=list)  # generated, without the stop token
    logprobs: list[float] = field(default_factory=list)  # one per entry of tokens
    finish_reason: FinishReason = FinishReason.LENGTH
    stats: GenerateStats = field(default_factory=GenerateStats)
    budget_forced_close: bool = False


class Runtime:
    """Owns `model`'s cache for `context` positions. Every generate starts at position 0; the
    cache is overwritten in place and attention never reads past what this request wrote, so no
    state carries over from one request to the next."""

    def __init__(self, model: CausalLM, device: torch.device, context: int, chunk: int = 512) -> None:
        if context <= 0 or chunk <= 0:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"context ({context}) and chunk ({chunk}) must be positive"
            )
        self.model = model
        self.device = device
        self.context = context
        self.chunk = chunk
        try:
            model.allocate_cache(context)
        except torch.OutOfMemoryError as exc:
            raise EngineFailure(
                ErrorCode.OUT_OF_MEMORY, f"KV cache for {context} positions on {device}: {exc}"
            ) from exc

    def close(self) -> None:
        """Free the cache (the weights belong to whoever loaded the model)."""
        self.model.free_cache()

    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        """Prefill `ids` from position 0 in chunks and return the last position's float32 logits [V]."""
        if not ids:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
        if len(ids) > self.context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW, f"{len(ids)} prompt tokens do not fit a context of {self.context}"
            )
        logits = self._prefill(ids, lambda: False)
        assert logits is not None
        return logits

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        stop_ids: set[int],
        on_token: Callable[[int], None],
        should_cancel: Callable[[], bool],
        thinking: ThinkingBudget | None = None,
    ) -> RunOutcome:
        started = time.perf_counter()
        if not prompt_ids:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
        if max_new_tokens < 0:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"max_new_tokens must not be negative, got {max_new_tokens}"
            )
        if len(prompt_ids) + max_new_tokens > self.context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW,
                f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens exceed the context of "
                f"{self.context}",
            )
        vocab = self.model.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            )
        check_sampling(sampling)
        gate = ThinkingGate(thinking, vocab) if thinking is not None else None

        out = RunOutcome()
        stats = out.stats
        stats.prompt_tokens = len(prompt_ids)
        if max_new_tokens == 0:
            return out

        generator = make_generator(sampling, self.device)
        logits = self._prefill(prompt_ids, should_cancel)
        stats.prefill_s = time.perf_counter() - started
        if logits is None:
            out.finish_reason = FinishReason.CANCELLED
            return out

        pos = len(prompt_ids)
        decode_start = 0.0
        with torch.inference_mode():
            while True:
                try:
                    forced = gate.forced_token() if gate is not None else None
                    if forced is None:
                        token_t, logprob_t = sample(logits, sampling, generator)
                    else:
                        token_t = torch.tensor(forced, device=logits.device)
                        logprob_t = logits[forced] - torch.logsumexp(logits, dim=0)
                    token = int(token_t)  # the one host sync per step: stop checks and streaming need it
                    logprob = float(logprob_t)
                except EngineFailure:
                    raise
                except Exception as exc:
                    raise _failure(exc, ErrorCode.DECODE_FAILED) from exc
                stats.generated_tokens += 1
                if gate is not None:
                    gate.observe(token)
                if stats.generated_tokens == 1:
                    decode_start = time.perf_counter()
                    stats.time_to_first_token_s = decode_start - started
                if token in stop_ids:
                    out.finish_reason = FinishReason.STOP
                    break
                out.tokens.append(token)
                out.logprobs.append(logprob)
                on_token(token)
                if stats.generated_tokens >= max_new_tokens:
                    out.finish_reason = FinishReason.LENGTH
                    break
                if should_cancel():
                    out.finish_reason = FinishReason.CANCELLED
                    break
                try:
                    logits = self.model.forward(token_t.view(1), pos, "last")
                except EngineFailure:
                    raise
                except Exception as exc:
                    raise _failure(exc, ErrorCode.DECODE_FAILED) from exc
                pos += 1
        stats.decode_s = time.perf_counter() - decode_start
        out.budget_forced_close = gate is not None and gate.forced
        return out

    def _prefill(self, ids: list[int], should_cancel: Callable[[], bool]) -> torch.Tensor | None:
        """Last-position logits of `ids` prefilled from position 0; None when cancelled."""
        with torch.inference_mode():
            try:
                all_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
                logits = None
                for start in range(0, len(ids), self.chunk):
                    if should_cancel():
                        return None
                    stop = min(start + self.chunk, len(ids))
                    # Only the chunk that ends the prompt needs logits; the others just fill the cache.
                    mode = "last" if stop == len(ids) else "none"
                    logits = self.model.forward(all_ids[start:stop], start, mode)
            except EngineFailure:
                raise
            except Exception as exc:
                raise _failure(exc, ErrorCode.PREFILL_FAILED) from exc
        return logits


def _failure(exc: Exception, code: ErrorCode) -> EngineFailure:
    if isinstance(exc, torch.OutOfMemoryError):
        return EngineFailure(ErrorCode.OUT_OF_MEMORY, str(exc))
    return EngineFailure(code, f"{type(exc).__name__}: {exc}")
