"""One remote answer as it streams in: the text shown (thinking wrapped in <think>…</think>, as a
local model writes it), the bounds a server must stay within, and the stats measured here."""

from __future__ import annotations

import time
from collections.abc import Callable

from ds4desk.engine.api import (
    EngineError,
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateStats,
)
from ds4desk.remote.protocol import ChunkParts, Usage, finish_of

# A server does not say which token ids it wrote: each streamed piece of text goes to the sink with
# this id, one per chunk. Servers stream about one token a chunk (vLLM, SGLang, llama.cpp and
# Ollama by default; ds4desk serve gathers a few), so counting them gives the live speed.
REMOTE_TOKEN = -1

# Chunks with text past max_tokens that a server may send (one token's text may come in pieces)
# before the answer is cut there; chunks of any kind, and characters, are bounded too.
SLACK_CHUNKS = 16
EVENTS_PER_TOKEN = 4
CHARS_PER_TOKEN = 256

Sink = Callable[[int | None, str], None]


class Overrun(Exception):
    """The server sent more text chunks than max_tokens allows: the answer ends there, as `length`."""


class Answer:
    def __init__(
        self, request: GenerateRequest, sink: Sink | None, clock: Callable[[], float] = time.monotonic
    ):
        self._request = request
        self._sink = sink
        self._clock = clock
        self.sent_at = clock()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._pieces: list[str] = []
        self._thinking_open = False
        self._chars = 0
        self.text_chunks = 0
        self.events = 0
        self.finish: str | None = None
        self.usage: Usage | None = None
        limit = request.max_new_tokens
        self._max_text_chunks = limit + SLACK_CHUNKS
        self.max_events = EVENTS_PER_TOKEN * limit + 256
        self._max_chars = CHARS_PER_TOKEN * limit + 65536

    def start(self) -> None:
        """The request is about to be sent: time to first token counts from here."""
        self.sent_at = self._clock()

    def add(self, parts: ChunkParts) -> None:
        self.events += 1
        if self.events > self.max_events:
            raise EngineFailure(
                ErrorCode.DECODE_FAILED,
                f"the server sent more than {self.max_events} events "
                f"for max_tokens {self._request.max_new_tokens}",
            )
        if parts.usage is not None:
            self.usage = parts.usage
        if parts.finish_reason is not None:
            self.finish = parts.finish_reason
        text = ""
        if parts.reasoning:
            text += parts.reasoning if self._thinking_open else "<think>" + parts.reasoning
            self._thinking_open = True
        if parts.content:
            text += self._closing() + parts.content
        if not text:
            return
        if self.text_chunks >= self._max_text_chunks:
            raise Overrun
        self._chars += len(text)
        if self._chars > self._max_chars:
            raise EngineFailure(
                ErrorCode.DECODE_FAILED,
                f"the server sent more than {self._max_chars} characters for max_tokens "
                f"{self._request.max_new_tokens}",
            )
        now = self._clock()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.text_chunks += 1
        self._emit(text, REMOTE_TOKEN)

    def end(self) -> None:
        """The stream is over (however): an open thinking part is closed, as a local answer's is."""
        tail = self._closing()
        if tail:
            self._emit(tail, None)  # no token of its own: the live count stays the server's

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def result(
        self, request_id: int, error: EngineError | None, cancelled: bool, overrun: bool = False
    ) -> GenerateResult:
        result = GenerateResult(request_id=request_id, text=self.text, error=error, stats=self.stats())
        if error is not None:
            result.finish_reason = (
                FinishReason.CANCELLED if error.code == ErrorCode.CANCELLED else FinishReason.ERROR
            )
        elif cancelled:
            result.finish_reason = FinishReason.CANCELLED
        elif overrun:
            result.finish_reason = FinishReason.LENGTH
        else:
            result.finish_reason = finish_of(self.finish)
        return result

    def stats(self) -> GenerateStats:
        """Times measured here (network and the server's queue included); token counts from the
        server's `usage` when it sent one, else the chunks counted."""
        usage = self.usage or Usage()
        stats = GenerateStats()
        stats.prompt_tokens = usage.prompt_tokens
        stats.reused_tokens = min(usage.cached_tokens, usage.prompt_tokens)
        stats.prefill_tokens = usage.prompt_tokens - stats.reused_tokens
        stats.generated_tokens = usage.completion_tokens or self.text_chunks
        if self.first_at is not None:
            stats.time_to_first_token_s = self.first_at - self.sent_at
            stats.prefill_s = stats.time_to_first_token_s
            stats.decode_s = (self.last_at or self.first_at) - self.first_at
        return stats

    def _closing(self) -> str:
        if not self._thinking_open:
            return ""
        self._thinking_open = False
        return "</think>\n\n"

    def _emit(self, text: str, token: int | None) -> None:
        self._pieces.append(text)
        if self._sink is not None:
            self._sink(token, text)
