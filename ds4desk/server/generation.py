"""One answer on the engine for one HTTP request: its text split into reasoning and reply, the reply
passed through the stop strings as it streams, and the log-probabilities that came with it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds4desk.engine.api import (
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SaveSnapshot,
    TextDelta,
    ThinkingBudget,
    ThinkingFormat,
)
from ds4desk.engine.client import EngineClient
from ds4desk.server.protocol import (
    ApiError,
    ChatParams,
    CompletionParams,
    GenerationParams,
    error_of_engine,
)
from ds4desk.server.stops import StopScanner, first_stop
from ds4desk.server.thinking import Split, ThinkSplitter, split_text

log = logging.getLogger(__name__)

# Without max_tokens an answer may run this long, or to the end of the context when the prompt
# leaves less (then the request is sent again with what is left: see Generation._run).
DEFAULT_MAX_TOKENS = 2048


@dataclass(slots=True)
class Piece:
    """What one batch of tokens added: reasoning, reply, and the tokens' log-probabilities (the
    engine's TokenLogprob entries, one per token)."""

    reasoning: str = ""
    content: str = ""
    logprobs: tuple[Any, ...] = ()


@dataclass(slots=True)
class Finished:
    result: GenerateResult
    reasoning: str
    content: str
    finish_reason: str  # OpenAI's: "stop" or "length"
    logprobs: list[Any] = field(default_factory=list)


def chat_request(params: ChatParams, context: int, fmt: ThinkingFormat) -> GenerateRequest:
    budget = None
    if params.thinking_budget is not None:
        # close_tokens left empty: the engine fills in the loaded tokenizer's </think>.
        budget = ThinkingBudget(max_tokens=params.thinking_budget, close_tokens=[])
    return _request(
        params, context, messages=params.messages, thinking=params.thinking, thinking_budget=budget
    )


def completion_request(params: CompletionParams, context: int) -> GenerateRequest:
    return _request(params, context, raw_text=params.text, prompt_tokens=params.tokens)


def _request(params: GenerationParams, context: int, **prompt: Any) -> GenerateRequest:
    return GenerateRequest(
        sampling=SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed),
        max_new_tokens=params.max_tokens or min(DEFAULT_MAX_TOKENS, context - 1),
        stop_tokens=[] if params.ignore_eos else None,
        save_snapshot=SaveSnapshot() if params.cache_prompt else None,
        top_logprobs=params.logprobs,  # per-token entries (GenerateResult.token_logprobs) when asked
        **prompt,
    )


class Generation:
    """The engine's answer to `request`, as pieces to stream or one finished whole.

    `thinking`: (the model's thinking format, thinking on) to split the reasoning off; None for
    plain completions, whose text is all reply. Stop strings apply to the reply only: the reasoning
    is the model's own, and a stop string in it would end the answer before it began.
    """

    def __init__(
        self,
        client: EngineClient,
        request: GenerateRequest,
        params: GenerationParams,
        context: int,
        thinking: tuple[ThinkingFormat, bool] | None,
        on_finished: Callable[[Generation], None],
        on_first_token: Callable[[Generation], None] | None = None,
        prefix: str = "chatcmpl-",
    ) -> None:
        self.id = prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.accepted_at = time.monotonic()
        self._client = client
        self._params = params
        self._context = context
        self._thinking = thinking
        self._splitter = ThinkSplitter(*thinking) if thinking else None
        self._scanner = StopScanner(params.stop)
        self._pieces: asyncio.Queue[Piece | None] = asyncio.Queue()
        self._request = request
        self._on_first_token = on_first_token
        self._seen_token = False
        self.result: GenerateResult | None = None
        self.left = False  # the client went away before the end
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._task.add_done_callback(lambda _task: on_finished(self))

    async def _run(self) -> None:
        try:
            result = await self._client.generate(self._request, self._on_delta)
            overflow = result.error is not None and result.error.code == ErrorCode.CONTEXT_OVERFLOW
            room = self._context - len(result.prompt_tokens)
            if (
                overflow
                and self._params.max_tokens is None
                and result.prompt_tokens
                and room > 0
                and not self.left
            ):
                # No max_tokens: as much as the context leaves, from the prompt tokens already made.
                self._request = dataclasses.replace(
                    self._request,
                    prompt_tokens=result.prompt_tokens,
                    messages=None,
                    raw_text=None,
                    max_new_tokens=room,
                )
                result = await self._client.generate(self._request, self._on_delta)
            self.result = result
            tail = self._splitter.flush() if self._splitter else Split()
            content = self._scanner.feed(tail.content) + self._scanner.flush()
            if tail.reasoning or content:
                self._pieces.put_nowait(Piece(tail.reasoning, content))
        finally:
            self._pieces.put_nowait(None)

    def _on_delta(self, delta: TextDelta) -> None:
        if delta.tokens and not self._seen_token:
            self._seen_token = True
            if self._on_first_token is not None:
                self._on_first_token(self)
        split = self._splitter.feed(delta.text) if self._splitter else Split(content=delta.text)
        shown = self._scanner.feed(split.content)
        logprobs = tuple(getattr(delta, "logprobs", ()) or ())
        if split.reasoning or shown or logprobs:
            self._pieces.put_nowait(Piece(split.reasoning, shown, logprobs))
        if self._scanner.stopped:
            self._client.cancel(self._request.request_id)  # a stop string: the rest is not wanted

    async def next_piece(self) -> Piece | None:
        """The next piece to send; None at the end."""
        return await self._pieces.get()

    async def finished(self) -> Finished:
        await asyncio.wait({self._task})  # cancelling this wait leaves the task running
        return self.whole(self.check())

    def check(self) -> GenerateResult:
        """The finished result, or the ApiError that its engine error means."""
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            error = self._task.exception()
            log.error("generation failed: %s: %s", type(error).__name__, error)
            raise ApiError(500, "the engine failed", kind="server_error")
        result = self.result
        assert result is not None
        stopped_by_us = self._scanner.stopped and result.finish_reason == FinishReason.CANCELLED
        if result.error is not None and not stopped_by_us:
            raise error_of_engine(result.error.code, result.error.detail)
        return result

    def whole(self, result: GenerateResult) -> Finished:
        """The answer at once, split and cut as the streamed one is."""
        split = split_text(result.text, *self._thinking) if self._thinking else Split(content=result.text)
        cut = first_stop(split.content, self._params.stop)
        content = split.content if cut is None else split.content[:cut]
        logprobs = list(getattr(result, "token_logprobs", ()) or ())
        if cut is not None:  # the reply is the end of the text: where the cut falls in the whole
            logprobs = _within(logprobs, len(result.text) - len(split.content) + cut)
        return Finished(result, split.reasoning, content, self.finish_reason(result), logprobs)

    def finish_reason(self, result: GenerateResult) -> str:
        if self._scanner.stopped:
            return "stop"
        if self._params.stop:
            split = split_text(result.text, *self._thinking) if self._thinking else None
            if first_stop(split.content if split else result.text, self._params.stop) is not None:
                return "stop"
        return "length" if result.finish_reason == FinishReason.LENGTH else "stop"

    def close(self) -> None:
        """However the response ended: an answer still running was left by its client and is cancelled
        at the engine's next step. The task itself runs on to the engine's result, so what it did is
        counted and the request stays in flight until the engine is really free of it."""
        if not self._task.done():
            self.left = True
            self._client.cancel(self._request.request_id)


def _within(entries: list[Any], chars: int) -> list[Any]:
    """The entries whose text starts before `chars` characters of the answer (a stop string's cut)."""
    kept, used = [], 0
    for entry in entries:
        if used >= chars:
            break
        kept.append(entry)
        used += len(getattr(entry, "text", ""))
    return kept
