"""The load's last stage: run what the first request would otherwise pay for, so that the first
answer is as fast as the next.

A fresh process pays on its first request for work no later request repeats: the CUDA graphs'
capture (when the runtime left it to this stage), Triton kernels compiled or read from the disk
cache, cuBLAS and oneDNN picking kernels for each shape, the CPU's fused decode layers built
(models/cpu_decode.py), the C extension's and torch's thread pools started, the sampling kernels
loaded. The warm-up runs requests of its own through `Runtime.generate`, the very path a first
request takes, on made-up token ids:

1. the graph capture, one step per span bucket, when the runtime deferred it;
2. a greedy answer: a prompt of one prefill chunk, then decode steps (replayed from the graphs, or
   eager), with the speculative mode the model was loaded with (the verify forward; a draft model's
   prefill and steps);
3. a prompt prefilled in two chunks: the second starts past position 0, as a long prompt's later
   chunk and a chat's follow-up after its snapshot do;
4. a sampled answer with log-probabilities (temperature, top-k, top-p, the seeded generator, the
   log-probability entries);
5. on a model that pads its prefill chunks to row buckets (the dense family on a GPU), a prompt of
   each bucket's length, so that cuBLAS has met every row count a prompt can bring.

Nothing of it stays behind. No snapshot store is passed, so no slot is written or read; every
request starts at position 0 and attention never reads rows it did not write (Runtime's contract),
so the cache holds nothing a later request sees; the draft model forgets what it was fed; the
sampled answer draws from its own seeded generator, never torch's global one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.speculative.mode import resolve_mode
from ds4desk.engine.speculative.mtp import mtp_available
from ds4desk.engine.speculative.rollback import rollback_of

log = logging.getLogger(__name__)

# The repeating pattern of the made-up prompts: prompt lookup then finds drafts to verify.
PATTERN_LENGTH = 8
SAMPLED_TOKENS = 2


@dataclass(slots=True, frozen=True)
class WarmUpSizes:
    """Token counts of the warm-up's requests (before they are fitted to a context)."""

    prompt: int  # the greedy answer's prompt, one prefill chunk
    answer: int  # its decode steps: a few speculative verify rounds
    split_prompt: int  # the prompt prefilled in two chunks
    split_at: int  # where its second chunk starts
    sampled_prompt: int  # the sampled answer's prompt

    @staticmethod
    def for_runtime(runtime: Runtime) -> WarmUpSizes:
        """The device's sizes, fitted to the runtime's context (tests load 16-token contexts) and
        chunk."""
        wanted = _SIZES.get(runtime.device.type, _SIZES["cuda"])
        context = runtime.context
        answer = max(1, min(wanted.answer, context // 4))
        prompt = max(1, min(wanted.prompt, runtime.chunk, context - answer))
        split_prompt = min(wanted.split_prompt, context)
        split_at = max(1, min(wanted.split_at, split_prompt - 1))
        sampled_prompt = max(1, min(wanted.sampled_prompt, context - SAMPLED_TOKENS))
        return WarmUpSizes(prompt, answer, split_prompt, split_at, sampled_prompt)


# On a GPU the prompt is long enough for the paths that start at a length: DeepSeek-V4's 128-token
# compression, the matmuls past the GEMV row limits (8 and 16 rows), the prefill attention kernels;
# compute there is cheap. Triton compiles a kernel once per specialization of its integer arguments
# (equal to 1, divisible by 16, neither): 250 tokens is the common case of a prompt (not a multiple
# of 16), and the other requests' 8, 24 and 16 tokens cover the rest.
# On the CPU compute is what costs: a forward of more than 16 tokens leaves
# the fused C step (models/cpu_decode.py) for packed matmuls that dequantize every weight once per
# forward, whatever its length. So one prompt of 17 tokens takes that path once, and the rest stays
# in the fused step (the two-chunk prompt's second chunk starts past position 0 there).
_SIZES = {
    "cuda": WarmUpSizes(prompt=250, answer=8, split_prompt=32, split_at=8, sampled_prompt=16),
    "cpu": WarmUpSizes(prompt=17, answer=4, split_prompt=4, split_at=1, sampled_prompt=1),
}


@dataclass(slots=True)
class WarmUpReport:
    seconds: float = 0.0
    steps: int = 0  # steps run (a graph span counts as one)
    failed: str = ""  # why it stopped early (the model still answers: the first request pays)


def step_count(runtime: Runtime) -> int:
    """How many steps `warm_up` reports: the progress bar's total."""
    spans = len(_span_buckets(runtime)) if runtime.graphs_pending else 0
    return spans + 3 + bool(runtime.model.prefill_row_buckets(runtime.chunk))


def made_up_prompt(vocab: int, length: int) -> list[int]:
    """Token ids in a repeating pattern, spread over the vocabulary (any id is a valid input)."""
    pattern = [(101 + 7919 * i) % vocab for i in range(PATTERN_LENGTH)]
    return [pattern[i % PATTERN_LENGTH] for i in range(length)]


def warm_up(
    runtime: Runtime,
    speculative: str,
    should_cancel: Callable[[], bool],
    tick: Callable[[int, int], None],
) -> WarmUpReport:
    """Run the warm-up on `runtime` with the load's speculative mode. `tick(done, total)` follows
    each step and may raise EngineFailure (a cancelled load), which propagates, as does a
    cancellation `should_cancel` reports. Any other failure ends the warm-up early, logged: the
    model is loaded, and the first request pays what is left."""
    started = time.perf_counter()
    report = WarmUpReport()
    total = step_count(runtime)

    def done_one() -> None:
        report.steps += 1
        tick(report.steps, total)

    tick(0, total)
    try:
        if runtime.graphs_pending:
            runtime.capture_graphs(done_one)
        _run_requests(runtime, speculative, should_cancel, done_one)
    except EngineFailure as failure:
        if failure.error.code == ErrorCode.CANCELLED:
            raise
        report.failed = f"{failure.error.code}: {failure.error.detail}"
    except Exception as exc:
        report.failed = f"{type(exc).__name__}: {exc}"
    finally:
        if runtime.draft is not None:
            runtime.draft.forget()  # the next request's prompt never starts with made-up tokens
    if report.failed:
        log.warning("the warm-up stopped early (%s); the first request pays the rest", report.failed)
    report.seconds = time.perf_counter() - started
    return report


def _run_requests(
    runtime: Runtime, speculative: str, should_cancel: Callable[[], bool], done_one: Callable[[], None]
) -> None:
    sizes = WarmUpSizes.for_runtime(runtime)
    vocab = runtime.model.vocab_size
    greedy = SamplingParams(temperature=0.0)

    def cancelled_check() -> None:
        if should_cancel():
            raise EngineFailure(ErrorCode.CANCELLED, "the load was cancelled during its warm-up")

    def ignore(_token: int) -> None:
        pass

    # No stop ids: every step runs, whatever the made-up prompt makes the model say.
    prompt = made_up_prompt(vocab, sizes.prompt)
    runtime.generate(
        prompt, greedy, sizes.answer, set(), ignore, should_cancel,
        snapshots=None, use_snapshots=False, speculative=_mode(runtime, speculative),
    )  # fmt: skip
    cancelled_check()
    done_one()

    runtime.prefill_logits(made_up_prompt(vocab, sizes.split_prompt), split_at=sizes.split_at)
    cancelled_check()
    done_one()

    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=0)
    short = made_up_prompt(vocab, sizes.sampled_prompt)
    runtime.generate(
        short, sampled, max(1, min(SAMPLED_TOKENS, runtime.context - len(short))), set(), ignore,
        should_cancel, snapshots=None, use_snapshots=False, top_logprobs=2, scored=[],
    )  # fmt: skip
    cancelled_check()
    done_one()

    buckets = runtime.model.prefill_row_buckets(runtime.chunk)
    for rows in buckets:
        runtime.prefill_logits(made_up_prompt(vocab, rows))
        cancelled_check()
    if buckets:
        done_one()


def _mode(runtime: Runtime, wanted: str) -> str:
    """The load's speculative mode when this model can run it, else "auto" (what it can)."""
    can_roll_back = rollback_of(runtime.model) is not None
    try:
        resolve_mode(
            wanted,
            can_roll_back,
            runtime.draft is not None,
            runtime.graphs is not None,
            has_mtp=mtp_available(runtime.model),
        )
    except EngineFailure:
        return "auto"
    return wanted


def _span_buckets(runtime: Runtime) -> list[int]:
    from ds4desk.engine.graphs import span_buckets

    return span_buckets(runtime.model.context)
