"""The asyncio face of the engine, for the UI's qasync loop.

Tokens are produced on the engine thread one at a time; the client gathers them and hands them to
the loop in batches at most `updates_per_second` times a second, never one callback per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from ds4desk.engine.api import (
    EngineFailure,
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    MemoryStats,
    ModelInfo,
    ModelPreview,
    ParkResult,
    SlotResult,
    TextDelta,
    TokenLogprob,
)
from ds4desk.engine.engine import Engine

T = TypeVar("T")


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
    """From the engine thread onto `loop`, unless the loop has closed meanwhile (a window closed while
    the engine was still finishing a request): a closed Qt loop must never be called into."""
    if loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


async def _result_of(future: Future[T]) -> T:
    """Await a concurrent future of the engine thread, resolved through _call_soon."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def settle(done: Future[T]) -> None:
        if waiter.done():  # the awaiting task was cancelled
            return
        error = done.exception()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    future.add_done_callback(lambda done: _call_soon(loop, settle, done))
    return await waiter


class _Coalescer:
    """Updates pushed from the engine thread reach the loop at most once per interval: the first
    push of an interval arms one timer, the ones after it only add to what that flush delivers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self._loop = loop
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._armed = False
        self._last_flush = 0.0

    def _pushed(self) -> None:
        """Engine thread, with the update stored under the lock already released."""
        with self._lock:
            if self._armed:
                return
            self._armed = True
        _call_soon(self._loop, self._arm)

    def _arm(self) -> None:
        delay = max(0.0, self._last_flush + self._interval_s - self._loop.time())
        self._loop.call_later(delay, self.flush)

    def flush(self) -> None:
        """Loop thread."""
        with self._lock:
            taken = self._take()
            self._armed = False
        self._last_flush = self._loop.time()
        self._send(taken)

    def _take(self) -> Any:
        raise NotImplementedError

    def _send(self, taken: Any) -> None:
        raise NotImplementedError


class _DeltaBatcher(_Coalescer):
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: int,
        deliver: Callable[[TextDelta], None],
        interval_s: float,
    ) -> None:
        super().__init__(loop, interval_s)
        self._request_id = request_id
        self._deliver = deliver
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []

    def push(self, token: int | None, text: str, entry: TokenLogprob | None = None) -> None:
        """Engine thread."""
        with self._lock:
            if token is not None:
                self._tokens.append(token)
            if entry is not None:
                self._logprobs.append(entry)
            self._text.append(text)
        self._pushed()

    def _take(self) -> tuple[list[int], str, list[TokenLogprob]]:
        taken = self._tokens, "".join(self._text), self._logprobs
        self._tokens, self._text, self._logprobs = [], [], []
        return taken

    def _send(self, taken: tuple[list[int], str, list[TokenLogprob]]) -> None:
        tokens, text, logprobs = taken
        if tokens or text:
            self._deliver(TextDelta(self._request_id, tuple(tokens), text, tuple(logprobs)))


class _ProgressBatcher(_Coalescer):
    """Load progress: only the latest (done, total, unit) matters, the ones in between are dropped."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[int, int, str], None],
        interval_s: float,
    ) -> None:
        super().__init__(loop, interval_s)
        self._deliver = deliver
        self._latest: tuple[int, int, str] | None = None

    def push(self, done: int, total: int, unit: str) -> None:
        """Engine thread."""
        with self._lock:
            self._latest = (done, total, unit)
        self._pushed()

    def _take(self) -> tuple[int, int, str] | None:
        latest, self._latest = self._latest, None
        return latest

    def _send(self, taken: tuple[int, int, str] | None) -> None:
        if taken is not None:
            self._deliver(*taken)


def _preview_now(engine: Engine, request: LoadRequest) -> ModelPreview:
    from ds4desk.engine.loading.default_model import default_model_path
    from ds4desk.engine.preflight import preview_model

    try:
        path = request.path or default_model_path()
    except EngineFailure as failure:
        return ModelPreview(str(request.path), error=failure.error, message=failure.error.detail)
    return preview_model(
        path,
        request.device,
        request.dtype,
        request.context,
        weights=request.weights,
        resident=engine.resident_bytes(),
    )


def _in_thread(work: Callable[[], T]) -> Future[T]:
    """Run `work` on a short-lived thread: header reads must not wait behind a load on the engine."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="ds4desk-preflight", daemon=True).start()
    return future


class EngineClient:
    def __init__(self, engine: Engine, updates_per_second: float = 40.0) -> None:
        self._engine = engine
        self._interval_s = 1.0 / updates_per_second
        self._progress_interval_s = max(self._interval_s, 0.05)  # a progress bar needs no more than 20/s

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def model_info(self) -> ModelInfo | None:
        return self._engine.model_info

    @property
    def parked(self) -> bool:
        return self._engine.parked

    async def load(
        self, request: LoadRequest, on_progress: Callable[[int, int, str], None] | None = None
    ) -> LoadResult:
        """`on_progress(done, total, unit)` runs on the loop, batched like the text of an answer."""
        batcher = None
        if on_progress is not None:
            batcher = _ProgressBatcher(asyncio.get_running_loop(), on_progress, self._progress_interval_s)
        try:
            return await _result_of(self._engine.submit_load(request, batcher.push if batcher else None))
        finally:
            if batcher is not None:
                batcher.flush()

    def cancel_load(self) -> None:
        """The running (and any queued) load stops at its next tensor with `cancelled`."""
        self._engine.cancel_load()

    async def preview(self, request: LoadRequest) -> ModelPreview:
        """What loading request.path would take, from headers only, on a worker thread (never the
        loop, never behind the engine's queue). Never raises: problems come back in `error`."""
        return await _result_of(_in_thread(lambda: _preview_now(self._engine, request)))

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        batcher = None
        if on_delta is not None:
            batcher = _DeltaBatcher(
                asyncio.get_running_loop(), request.request_id, on_delta, self._interval_s
            )
        future = self._engine.submit_generate(request, batcher.push if batcher else None)
        try:
            return await _result_of(future)
        except asyncio.CancelledError:
            self._engine.cancel(request.request_id)
            raise
        finally:
            if batcher is not None:
                batcher.flush()  # whatever is still gathered arrives before the result

    def cancel(self, request_id: int) -> None:
        self._engine.cancel(request_id)

    async def park(self, selector: str = "", *, cancel_running: bool | None = None) -> ParkResult:
        return await _result_of(self._engine.submit_park(selector, cancel_running=cancel_running))

    async def unpark(self, selector: str = "") -> ParkResult:
        return await _result_of(self._engine.submit_unpark(selector))

    # ---- snapshot slots and memory ------------------------------------------------------------

    async def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        """op: "list", "free", "pin", "unpin", "save" (slot to path) or "load" (path into slot)."""
        return await _result_of(self._engine.submit_slots(op, slot, path))

    async def memory(self) -> MemoryStats:
        """A fresh reading when the engine is free; while it works (a long answer, a load), the latest
        one it took, so a 1 Hz chart never waits behind an answer."""
        latest = self._engine.memory_stats
        if latest is not None and self._engine.busy:
            return latest
        return await _result_of(self._engine.submit_memory())

    def idle_park_deadline(self) -> float | None:
        """time.monotonic() at which the engine parks itself for being idle; None when it won't."""
        return self._engine.idle_park_deadline()

    def close(self) -> None:
        self._engine.close()
