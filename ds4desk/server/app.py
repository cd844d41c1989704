"""The Starlette application: OpenAI's routes over one EngineClient.

Requests queue in arrival order behind the one engine thread (the engine's own command queue). A
request whose client goes away is cancelled at the engine's next step, waiting or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ds4desk.engine.api import (
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    SamplingParams,
    TextDelta,
)
from ds4desk.engine.client import EngineClient
from ds4desk.server.protocol import ApiError, ChatParams, error_of_engine, parse_chat, parse_json
from ds4desk.server.stops import StopScanner, first_stop

log = logging.getLogger(__name__)

T = TypeVar("T")

# Without max_tokens an answer may run this long, or to the end of the context when the prompt
# leaves less (then the request is sent again with what is left: see _Generation._run).
DEFAULT_MAX_TOKENS = 2048


@dataclass(slots=True)
class ServerLimits:
    max_body_bytes: int = 8 * 2**20
    max_requests: int = 64  # generations waiting or running; more are refused with 429


@dataclass(slots=True)
class _Served:
    """What the engine did for this server's clients since it started (GET /health)."""

    answers: int = 0
    cancelled: int = 0  # their client left before the end
    failed: int = 0
    generated_tokens: int = 0  # every token the model produced, cancelled answers' included


class _ClientGone(Exception):
    """The client closed the connection before its answer began."""


class _Server:
    def __init__(self, client: EngineClient, api_key: str | None, limits: ServerLimits) -> None:
        self.client = client
        self.api_key = api_key.encode() if api_key else None
        self.limits = limits
        self.requests = 0  # generations accepted whose engine work has not ended
        self.served = _Served()

    @property
    def info(self) -> ModelInfo:
        info = self.client.model_info
        if info is None:
            raise ApiError(503, "no model is loaded", kind="server_error", code="model_not_loaded")
        return info

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # Constant time, so the key cannot be guessed a character at a time from response times.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key):
            raise ApiError(
                401, "a valid API key is needed (Authorization: Bearer KEY)", code="invalid_api_key"
            )

    async def body(self, request: Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        # The length of the digits first: int() refuses strings of thousands of digits with an error.
        if length is not None and (not length.isdigit() or len(length) > 15 or int(length) > limit):
            raise ApiError(413, f"the request body is limited to {limit} bytes", code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():  # a chunked body has no length to check up front
                size += len(chunk)
                if size > limit:
                    raise ApiError(
                        413, f"the request body is limited to {limit} bytes", code="request_too_large"
                    )
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body arrived: an answer nobody will read
            raise ApiError(400, "the client went away") from None
        return parse_json(b"".join(chunks))

    # ---- routes ---------------------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        info = self.client.model_info
        body = {
            "status": "ok" if info else "no_model",
            "model": info.name if info else None,
            "parked": self.client.parked,
            "requests": self.requests,
            "served": {
                "answers": self.served.answers,
                "cancelled": self.served.cancelled,
                "failed": self.served.failed,
                "generated_tokens": self.served.generated_tokens,
            },
        }
        return JSONResponse(body, status_code=200 if info else 503)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        info = self.info
        model = {"id": info.name, "object": "model", "created": 0, "owned_by": "ds4desk"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        info = self.info
        params = parse_chat(await self.body(request), info.context)
        if self.requests >= self.limits.max_requests:
            raise ApiError(429, "too many requests are waiting; try again later", code="server_busy")
        self.requests += 1
        generation = _Generation(self.client, params, info.context, on_finished=self._finished)
        handed_over = False
        try:
            if not params.stream:
                result = await _unless_gone(request, generation.finished())
                return JSONResponse(_completion(generation, info.name, result))
            # The first piece (or the end) before the headers: an error found by the engine (a prompt
            # longer than the context, say) is still an HTTP error, not a broken stream.
            first = await _unless_gone(request, generation.next_piece())
            if first is None:
                generation.check()
            handed_over = True
            return _EventStream(self._events(generation, info.name, params, first), generation)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was cancelled
        finally:
            if not handed_over:
                generation.close()

    def _finished(self, generation: _Generation) -> None:
        """The engine is done with `generation` (answered, cancelled or failed), on the loop."""
        self.requests -= 1
        result = generation.result
        if result is None or (result.error is not None and result.finish_reason != FinishReason.CANCELLED):
            self.served.failed += 1
        elif generation.left:
            self.served.cancelled += 1
        else:
            self.served.answers += 1
        if result is not None:
            self.served.generated_tokens += result.stats.generated_tokens

    async def _events(
        self, generation: _Generation, model: str, params: ChatParams, first: str | None
    ) -> AsyncIterator[str]:
        """The SSE stream. Closing it (the client went away: Starlette cancels it) cancels the answer."""
        base = {"id": generation.id, "object": "chat.completion.chunk", "created": generation.created}
        base["model"] = model

        def chunk(delta: dict[str, str], finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return _sse({**base, "choices": [choice]})

        try:
            yield chunk({"role": "assistant", "content": ""})
            piece = first
            while piece is not None:
                yield chunk({"content": piece})
                piece = await generation.next_piece()
            try:
                result = generation.check()
            except ApiError as error:  # the headers are gone: the error travels as an event
                yield _sse(error.body)
                return
            yield chunk({}, generation.finish_reason(result))
            if params.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(result)})
            yield "data: [DONE]\n\n"
        finally:
            generation.close()


class _EventStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends: a client that leaves
    before the first event never starts the event generator, so its `finally` alone is not enough."""

    def __init__(self, events: AsyncIterator[str], generation: _Generation) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


class _Generation:
    """One answer on the engine, its text passed through the stop strings as it streams."""

    def __init__(
        self,
        client: EngineClient,
        params: ChatParams,
        context: int,
        on_finished: Callable[[_Generation], None],
    ) -> None:
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self._client = client
        self._params = params
        self._context = context
        self._scanner = StopScanner(params.stop)
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self._request = GenerateRequest(
            messages=params.messages,
            sampling=SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=params.seed),
            max_new_tokens=params.max_tokens or min(DEFAULT_MAX_TOKENS, context - 1),
            stop_tokens=[] if params.ignore_eos else None,
        )
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
                self._request = GenerateRequest(
                    prompt_tokens=result.prompt_tokens,
                    sampling=self._request.sampling,
                    max_new_tokens=room,
                    stop_tokens=self._request.stop_tokens,
                )
                result = await self._client.generate(self._request, self._on_delta)
            self.result = result
            if tail := self._scanner.flush():
                self._pieces.put_nowait(tail)
        finally:
            self._pieces.put_nowait(None)

    def _on_delta(self, delta: TextDelta) -> None:
        if shown := self._scanner.feed(delta.text):
            self._pieces.put_nowait(shown)
        if self._scanner.stopped:
            self._client.cancel(self._request.request_id)  # a stop string: the rest is not wanted

    async def next_piece(self) -> str | None:
        """The next text to show; None at the end."""
        return await self._pieces.get()

    async def finished(self) -> GenerateResult:
        await asyncio.wait({self._task})  # cancelling this wait leaves the task running
        return self.check()

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

    def text(self, result: GenerateResult) -> str:
        cut = first_stop(result.text, self._params.stop)
        return result.text if cut is None else result.text[:cut]

    def finish_reason(self, result: GenerateResult) -> str:
        if self._scanner.stopped or first_stop(result.text, self._params.stop) is not None:
            return "stop"
        return "length" if result.finish_reason == FinishReason.LENGTH else "stop"

    def close(self) -> None:
        """However the response ended: an answer still running was left by its client and is cancelled
        at the engine's next step. The task itself runs on to the engine's result, so what it did is
        counted and the request stays in `requests` until the engine is really free of it."""
        if not self._task.done():
            self.left = True
            self._client.cancel(self._request.request_id)


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`, unless the client closes the connection first (then _ClientGone)."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
    if not working.done():
        working.cancel()
        raise _ClientGone
    return working.result()


def _completion(generation: _Generation, model: str, result: GenerateResult) -> dict[str, Any]:
    message = {"role": "assistant", "content": generation.text(result)}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": generation.finish_reason(result),
    }
    return {
        "id": generation.id,
        "object": "chat.completion",
        "created": generation.created,
        "model": model,
        "choices": [choice],
        "usage": _usage(result),
    }


def _usage(result: GenerateResult) -> dict[str, int]:
    # Every token the model produced counts, its end-of-turn token and any past a stop string too.
    prompt, completion = result.stats.prompt_tokens, result.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error_response(error: ApiError) -> Response:
    return JSONResponse(error.body, status_code=error.status)


async def _on_api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _on_http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(ApiError(exc.status_code, str(exc.detail), kind=kind))


async def _on_bug(_request: Request, exc: Exception) -> Response:
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return _error_response(ApiError(500, "internal server error", kind="server_error"))


def build_app(
    client: EngineClient, api_key: str | None = None, limits: ServerLimits | None = None
) -> Starlette:
    server = _Server(client, api_key, limits or ServerLimits())
    return Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        ],
        exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error, Exception: _on_bug},
    )
