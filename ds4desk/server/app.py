"""The Starlette application: OpenAI's routes, /metrics and the slot endpoints over one EngineClient.

Requests queue in arrival order behind the one engine thread (the engine's own command queue). A
request whose client goes away is cancelled at the engine's next step, waiting or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import ds4desk.server.shapes as shapes
from ds4desk.engine.api import PARK_SELECTORS, FinishReason, GenerateRequest, GenerateStats, ModelInfo
from ds4desk.engine.client import EngineClient
from ds4desk.server.generation import Generation, chat_request, completion_request
from ds4desk.server.metrics import CONTENT_TYPE, Metrics, ServedAnswer
from ds4desk.server.protocol import (
    ApiError,
    ChatParams,
    CompletionParams,
    GenerationParams,
    bad,
    parse_chat,
    parse_completion,
    parse_json,
)
from ds4desk.server.slots import engine_slot_error, park_body, run_slot_action, slot_body, slot_id

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class ServerLimits:
    max_body_bytes: int = 8 * 2**20
    max_requests: int = 64  # generations waiting or running; more are refused with 429


class _ClientGone(Exception):
    """The client closed the connection before its answer began."""


class _Server:
    def __init__(
        self, client: EngineClient, api_key: str | None, limits: ServerLimits, slot_dir: Path | None
    ) -> None:
        self.client = client
        self.api_key = api_key.encode() if api_key else None
        self.limits = limits
        self.slot_dir = slot_dir
        self.metrics = Metrics()
        # Per generation in flight: the model it was accepted for, and its arrival-to-first-token time.
        self._served: dict[str, tuple[str, float | None]] = {}

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

    async def body(self, request: Request, optional: bool = False) -> dict[str, Any]:
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
        raw = b"".join(chunks)
        if optional and not raw.strip():
            return {}
        return parse_json(raw)

    # ---- routes ---------------------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        info = self.client.model_info
        body = {
            "status": "ok" if info else "no_model",
            "model": info.name if info else None,
            "parked": self.client.parked,
            "requests": self.metrics.in_flight,
            "served": self.metrics.health(),
        }
        return JSONResponse(body, status_code=200 if info else 503)

    async def metrics_text(self, request: Request) -> Response:
        self.authorize(request)
        engine = self.client.engine
        text = self.metrics.render(self.client.model_info, self.client.parked, engine.memory_stats)
        return Response(text, media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        info = self.info
        model = {"id": info.name, "object": "model", "created": 0, "owned_by": "ds4desk"}
        model["max_model_len"] = info.context  # vLLM's name: clients read the context from it
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        info = self.info
        params = parse_chat(await self.body(request), info.context)
        engine_request = chat_request(params, info.context, info.thinking)
        generation = self._start(engine_request, params, info, (info.thinking, params.thinking), "chatcmpl-")

        def whole(done: Any) -> dict[str, Any]:
            return shapes.chat_completion(generation, info.name, done, params.logprobs is not None)

        return await self._answer(
            request, generation, params, whole, self._chat_events(generation, info.name, params)
        )

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        info = self.info
        params = parse_completion(await self.body(request), info.context)
        engine_request = completion_request(params, info.context)
        generation = self._start(engine_request, params, info, None, "cmpl-")

        def whole(done: Any) -> dict[str, Any]:
            return shapes.text_completion(generation, info.name, done, params.logprobs is not None)

        events = self._text_events(generation, info.name, params)
        return await self._answer(request, generation, params, whole, events)

    async def slots(self, request: Request) -> Response:
        self.authorize(request)
        result = await self.client.slots("list")
        if result.error is not None:
            raise engine_slot_error(result.error, self.slot_dir)
        return JSONResponse(slot_body(result, self.slot_dir))

    async def slot_action(self, request: Request) -> Response:
        self.authorize(request)
        slot = slot_id(request.path_params["slot"])
        action = request.query_params.get("action", "")
        body = await self.body(request, optional=True)
        return JSONResponse(await run_slot_action(self.client, slot, action, body, self.slot_dir))

    async def park(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(park_body(await self.client.park(_park_target(request))))

    async def unpark(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(park_body(await self.client.unpark(_park_target(request))))

    # ---- generations ----------------------------------------------------------------------------

    def _start(
        self,
        engine_request: GenerateRequest,
        params: GenerationParams,
        info: ModelInfo,
        thinking: Any,
        prefix: str,
    ) -> Generation:
        if self.metrics.in_flight >= self.limits.max_requests:
            raise ApiError(429, "too many requests are waiting; try again later", code="server_busy")
        self.metrics.in_flight += 1
        generation = Generation(
            self.client,
            engine_request,
            params,
            info.context,
            thinking,
            on_finished=self._finished,
            on_first_token=self._first_token,
            prefix=prefix,
        )
        self._served.setdefault(generation.id, (info.name, None))
        return generation

    async def _answer(
        self,
        request: Request,
        generation: Generation,
        params: GenerationParams,
        whole: Callable[[Any], dict[str, Any]],
        events: Callable[[Any], AsyncIterator[str]],
    ) -> Response:
        handed_over = False
        try:
            if not params.stream:
                done = await _unless_gone(request, generation.finished())
                return JSONResponse(whole(done))
            # The first piece (or the end) before the headers: an error found by the engine (a prompt
            # longer than the context, say) is still an HTTP error, not a broken stream.
            first = await _unless_gone(request, generation.next_piece())
            if first is None:
                generation.check()
            handed_over = True
            return _EventStream(events(first), generation)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the request was cancelled
        finally:
            if not handed_over:
                generation.close()

    def _first_token(self, generation: Generation) -> None:
        ttft = time.monotonic() - generation.accepted_at
        self.metrics.ttft.observe(ttft)
        self.metrics.last_ttft_s = ttft
        model, _ = self._served.get(generation.id, ("", None))
        self._served[generation.id] = (model, ttft)

    def _finished(self, generation: Generation) -> None:
        """The engine is done with `generation` (answered, cancelled or failed), on the loop."""
        metrics = self.metrics
        metrics.in_flight -= 1
        result = generation.result
        if result is None or (result.error is not None and result.finish_reason != FinishReason.CANCELLED):
            metrics.failed += 1
            outcome = "failed"
        elif generation.left:
            metrics.cancelled += 1
            outcome = "cancelled"
        else:
            metrics.answers += 1
            outcome = "answered"
        if result is not None:
            metrics.generated_tokens += result.stats.generated_tokens
            metrics.prompt_tokens += result.stats.prompt_tokens
            if result.stats.decode_tok_s > 0:
                metrics.last_decode_tok_s = result.stats.decode_tok_s
        model, waited = self._served.pop(generation.id, ("", None))
        if metrics.listeners:
            stats = result.stats if result is not None else GenerateStats()
            metrics.served(ServedAnswer(model, stats, outcome, waited))

    def _chat_events(
        self, generation: Generation, model: str, params: ChatParams
    ) -> Callable[[Any], AsyncIterator[str]]:
        """The SSE stream: the reasoning as `delta.reasoning_content` (DeepSeek's field), then the
        reply as `delta.content`. Closing it (the client went away: Starlette cancels it) cancels
        the answer."""

        async def events(first: Any) -> AsyncIterator[str]:
            try:
                yield shapes.chat_chunk(generation, model, {"role": "assistant", "content": ""})
                piece = first
                while piece is not None:
                    delta: dict[str, Any] = {}
                    if piece.reasoning:
                        delta["reasoning_content"] = piece.reasoning
                    if piece.content or not piece.reasoning:
                        delta["content"] = piece.content
                    yield shapes.chat_chunk(generation, model, delta, logprobs=piece.logprobs)
                    piece = await generation.next_piece()
                try:
                    result = generation.check()
                except ApiError as error:  # the headers are gone: the error travels as an event
                    yield shapes.sse(error.body)
                    return
                yield shapes.chat_chunk(generation, model, {}, generation.finish_reason(result))
                if params.include_usage:
                    yield shapes.chat_usage_chunk(generation, model, result)
                yield "data: [DONE]\n\n"
            finally:
                generation.close()

        return events

    def _text_events(
        self, generation: Generation, model: str, params: CompletionParams
    ) -> Callable[[Any], AsyncIterator[str]]:
        async def events(first: Any) -> AsyncIterator[str]:
            try:
                piece, offset = first, 0
                while piece is not None:
                    yield shapes.text_chunk(
                        generation, model, piece.content, logprobs=piece.logprobs, offset=offset
                    )
                    offset += len(piece.content)
                    piece = await generation.next_piece()
                try:
                    result = generation.check()
                except ApiError as error:
                    yield shapes.sse(error.body)
                    return
                yield shapes.text_chunk(generation, model, "", generation.finish_reason(result))
                if params.include_usage:
                    yield shapes.text_usage_chunk(generation, model, result)
                yield "data: [DONE]\n\n"
            finally:
                generation.close()

        return events


class _EventStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends: a client that leaves
    before the first event never starts the event generator, so its `finally` alone is not enough."""

    def __init__(self, events: AsyncIterator[str], generation: Generation) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


class _CountRequests:
    """Counts every HTTP answer by endpoint and status for /metrics, errors and refusals included."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
                self.metrics.counted(scope["path"], status[0])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not status:  # a bug of ours: the outer handler answers 500
                self.metrics.counted(scope["path"], 500)
            raise


def _park_target(request: Request) -> str:
    target = request.query_params.get("target", "")
    if target not in PARK_SELECTORS:
        raise bad(f"target must be one of {', '.join(repr(s) for s in PARK_SELECTORS)}", "target")
    return target


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
    client: EngineClient,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    slot_dir: Path | None = None,
) -> Starlette:
    """`slot_dir`: the only folder slot files are saved to and restored from (None: slot files off)."""
    server = _Server(client, api_key, limits or ServerLimits(), slot_dir)
    app = Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics_text, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/slots", server.slots, methods=["GET"]),
            Route("/slots/{slot}", server.slot_action, methods=["POST"]),
            Route("/park", server.park, methods=["POST"]),
            Route("/unpark", server.unpark, methods=["POST"]),
        ],
        middleware=[Middleware(_CountRequests, metrics=server.metrics)],
        exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error, Exception: _on_bug},
    )
    # Where a host of the server (the window's background server) adds its ServedAnswer listeners.
    app.state.metrics = server.metrics
    return app
