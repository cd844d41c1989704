"""A scripted stand-in for EngineClient: no torch, no thread, same contract.

Answers stream in batches with an `asyncio.sleep` between them (so the Qt loop really runs in
between), cancel is honoured between batches, and loads or answers can be told to fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from ds4desk.engine.api import (
    EngineError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateStats,
    LoadRequest,
    LoadResult,
    ModelInfo,
    ParkResult,
    TextDelta,
)

DEFAULT_REPLY = "Hello! I am a **fake** model.\n\nHere is a list:\n- one\n- two\n"


def fake_info(path: str | None, device: str) -> ModelInfo:
    return ModelInfo(
        name="fake-llama-1b",
        family="llama",
        architecture="LlamaForCausalLM",
        path=path or "<embedded>",
        device="cpu" if device == "auto" else device,
        dtype="float32",
        parameters=1_100_000_000,
        weight_bytes=4_400_000_000,
        context=4096,
        tokenizer="BPE, 32000 tokens",
        has_chat_template=True,
    )


@dataclass
class FakeBackend:
    reply: str = DEFAULT_REPLY  # answered when `replies` is empty
    replies: list[str] = field(default_factory=list)  # consumed one per request
    batch_chars: int = 6
    delay_s: float = 0.001
    fail_load: EngineError | None = None
    fail_generate: EngineError | None = None
    fail_after_batches: int = 0  # batches streamed before fail_generate strikes
    on_load: Callable[[LoadResult], None] | None = None
    after_batch: Callable[[], None] | None = None  # called after each on_delta (tests look at the view)
    park_bytes: int = 4_400_000_000  # what a park frees and an unpark takes back
    fail_park: EngineError | None = None
    fail_unpark: EngineError | None = None
    raise_on_park: Exception | None = None  # a broken backend: the window must survive it
    prompt_tokens: int = 12
    reused_tokens: int = 0  # reported as taken from a snapshot

    # What the window did.
    load_requests: list[LoadRequest] = field(default_factory=list)
    generate_requests: list[GenerateRequest] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    park_calls: list[tuple[str, str]] = field(default_factory=list)  # ("park" | "unpark", selector)
    batches_sent: int = 0

    _info: ModelInfo | None = None
    _progress: asyncio.Event | None = None
    _parked: bool = False

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    @property
    def parked(self) -> bool:
        return self._parked

    async def park(self, selector: str) -> ParkResult:
        self.park_calls.append(("park", selector))
        await asyncio.sleep(self.delay_s)
        if self.raise_on_park is not None:
            raise self.raise_on_park
        if self.fail_park is not None:
            return ParkResult(selector, self._parked, error=self.fail_park)
        if self._info is None or self._parked or selector == "draft":  # like the engine: no draft yet
            return ParkResult(selector, self._parked)
        self._parked = True
        return ParkResult(selector, True, bytes=self.park_bytes, seconds=0.02)

    async def unpark(self, selector: str) -> ParkResult:
        self.park_calls.append(("unpark", selector))
        await asyncio.sleep(self.delay_s)
        if self.fail_unpark is not None:
            return ParkResult(selector, self._parked, error=self.fail_unpark)
        if not self._parked or selector == "draft":
            return ParkResult(selector, self._parked)
        self._parked = False
        return ParkResult(selector, False, bytes=self.park_bytes, seconds=0.5)

    async def load(self, request: LoadRequest) -> LoadResult:
        self.load_requests.append(request)
        await asyncio.sleep(self.delay_s)
        if self.fail_load is not None:
            result = LoadResult(error=self.fail_load, seconds=0.01)
        else:
            self._info = fake_info(request.path, request.device)
            self._parked = False  # a new model replaces a parked one
            result = LoadResult(info=self._info, seconds=0.25)
        if self.on_load is not None:
            self.on_load(result)
        return result

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        self.generate_requests.append(request)
        rid = request.request_id
        if self._info is None:
            return GenerateResult(rid, error=EngineError(ErrorCode.MODEL_NOT_LOADED, "no model is loaded"))
        if self._parked:  # the engine's default: an answer to a parked model loads it back first
            await self.unpark("all")
        text = self.replies.pop(0) if self.replies else self.reply
        chunks = [text[i : i + self.batch_chars] for i in range(0, len(text), self.batch_chars)]
        sent: list[str] = []
        for index, chunk in enumerate(chunks):
            await asyncio.sleep(self.delay_s)
            if rid in self.cancelled:
                return self._result(rid, "".join(sent), len(sent), FinishReason.CANCELLED)
            if self.fail_generate is not None and index >= self.fail_after_batches:
                return GenerateResult(rid, error=self.fail_generate, finish_reason=FinishReason.ERROR)
            sent.append(chunk)
            self.batches_sent += 1
            if on_delta is not None:
                on_delta(TextDelta(rid, tuple(range(index, index + 1)), chunk))
            if self.after_batch is not None:
                self.after_batch()
            self._wake()
        return self._result(rid, text, len(chunks), FinishReason.STOP)

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    async def wait_for_batches(self, count: int) -> None:
        """Until `count` batches were streamed in total (an event, not a timer)."""
        while self.batches_sent < count:
            self._progress = asyncio.Event()
            await self._progress.wait()

    def _wake(self) -> None:
        if self._progress is not None:
            self._progress.set()

    def _result(self, rid: int, text: str, tokens: int, reason: FinishReason) -> GenerateResult:
        stats = GenerateStats(
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            prefill_tokens=self.prompt_tokens - self.reused_tokens,
            generated_tokens=tokens,
            time_to_first_token_s=0.05,
            prefill_s=0.05,
            decode_s=0.1,
        )
        return GenerateResult(rid, tokens=list(range(tokens)), text=text, finish_reason=reason, stats=stats)
