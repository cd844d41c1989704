"""Tiny random targets and drafts (written by transformers, loaded by ds4desk) for the speculative
tests: float32 on the CPU, two families, drafts that agree with the target (itself) and drafts that
mostly do not (another random model with the same vocabulary)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ds4desk.engine.api import SamplingParams, ThinkingBudget
from ds4desk.engine.loader import load_model
from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.runtime import RunOutcome, Runtime
from ds4desk.engine.speculative.draft_model import DraftModel
from tests.engine.models.gemma3 import tiny as gemma3_tiny
from tests.engine.tiny_dense import save_tiny

CPU = torch.device("cpu")
CONTEXT = 192
GREEDY = SamplingParams()

# A prompt that quotes itself: prompt lookup finds its n-grams again.
REPEATING = [*range(40, 60), *range(40, 60), 7, 8, *range(40, 52)]
# No repeated n-gram at all (every token distinct).
PLAIN = [(i * 37 + 11) % 200 + 3 for i in range(30)]


def load(family: str, folder: Path, seed: int, **overrides: object) -> CausalLM:
    """`family`: "llama", "qwen3" (vocab 256) or "gemma3" (vocab 300; an 5-token window)."""
    if family == "gemma3":
        _, source = gemma3_tiny.save_tiny(folder, "tiny", seed, **overrides)
    else:
        _, source = save_tiny(family, folder, seed, **overrides)
    return load_model(source, CPU, torch.float32).model


def runtime(model: CausalLM, draft: CausalLM | None = None, chunk: int = 8) -> Runtime:
    rt = Runtime(model, CPU, context=CONTEXT, chunk=chunk)
    if draft is not None:
        rt.draft = DraftModel(draft, CONTEXT, chunk, "draft", 0)
    return rt


def run(
    rt: Runtime,
    prompt: list[int],
    mode: str,
    count: int = 40,
    sampling: SamplingParams = GREEDY,
    stop: set[int] | None = None,
    budget: ThinkingBudget | None = None,
    should_cancel: Callable[[list[int]], bool] | None = None,
    **kwargs: object,
) -> RunOutcome:
    """One generate; checks that what streamed is what came back."""
    seen: list[int] = []
    cancel = should_cancel or (lambda _seen: False)
    outcome = rt.generate(
        prompt,
        sampling,
        count,
        stop or set(),
        seen.append,
        lambda: cancel(seen),
        budget,
        speculative=mode,
        **kwargs,  # type: ignore[arg-type]
    )
    assert seen == outcome.tokens
    assert len(outcome.logprobs) == len(outcome.tokens)
    assert outcome.stats.generated_tokens <= count
    return outcome
