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
from typing import TypeVar

from ds4desk.engine.api import (
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    ModelInfo,
    ParkResult,
    TextDelta,
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


class _DeltaBatcher:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: int,
        deliver: Callable[[TextDelta], None],
        interval_s: float,
    ) -> None:
        self._loop = loop
        self._request_id = request_id
        self._deliver = deliver
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._armed = False
        self._last_flush = 0.0

    def push(self, token: int | None, text: str) -> None:
        """Engine thread."""
        with self._lock:
            if token is not None:
                self._tokens.append(token)
            self._text.append(text)
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
            tokens, text = self._tokens, "".join(self._text)
            self._tokens, self._text = [], []
            self._armed = False
        self._last_flush = self._loop.time()
        if tokens or text:
            self._deliver(TextDelta(self._request_id, tuple(tokens), text))


class EngineClient:
    def __init__(self, engine: Engine, updates_per_second: float = 40.0) -> None:
        self._engine = engine
        self._interval_s = 1.0 / updates_per_second

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def model_info(self) -> ModelInfo | None:
        return self._engine.model_info

    @property
    def parked(self) -> bool:
        return self._engine.parked

    async def load(self, request: LoadRequest) -> LoadResult:
        return await _result_of(self._engine.submit_load(request))

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

    def close(self) -> None:
        self._engine.close()
