"""A model behind an OpenAI-compatible server, with the local Engine's interface: commands on one
thread of its own, concurrent futures back, nothing raised across the boundary.

`EngineClient(RemoteEngine(config))` is then a ChatBackend like the local one: the window streams,
stops and shows the speed footer the same way. What a server cannot do (park, unpark, snapshot
slots, the memory readout) answers a clear EngineError ("not available for a remote model");
`is_remote(model_info)` says to grey those out.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds4desk.engine.api import (
    EngineError,
    EngineFailure,
    ErrorCode,
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    MemoryStats,
    ModelInfo,
    ParkResult,
    ProgressCallback,
    SlotResult,
    ThinkingFormat,
)
from ds4desk.remote.answer import Answer, Overrun, Sink
from ds4desk.remote.config import NOT_AVAILABLE, REMOTE_DEVICE, RemoteConfig, base_url
from ds4desk.remote.http import Abort, error_message, get_json, open_request, parse_json_bytes
from ds4desk.remote.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MODELS_PATH,
    RemoteModel,
    chunk_parts,
    models_of,
    request_body,
    uses_chat,
)
from ds4desk.remote.sse import SseReader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Command:
    kind: str  # "load" | "generate" | "models"
    payload: Any
    future: Future[Any]
    sink: Sink | None = None


def remote_model_info(model: RemoteModel, base: str) -> ModelInfo:
    """What the window shows of a served model: its name and where it is; sizes are the server's."""
    return ModelInfo(
        name=model.id,
        family="remote",
        architecture="OpenAI-compatible server",
        path=base,
        device=REMOTE_DEVICE,
        dtype="",
        parameters=0,
        weight_bytes=0,
        context=model.context,
        tokenizer="the server's",
        has_chat_template=True,
        # The server's chat format is unknown here: the window offers no Think switch.
        thinking=ThinkingFormat(),
    )


class RemoteEngine:
    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self._base: str | None = None
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._running: int | None = None
        self._abort: Abort | None = None  # the running command's connection, for Stop
        self._serving: str | None = None
        self._info: ModelInfo | None = None
        self._models: list[RemoteModel] = []
        self._thread = threading.Thread(target=self._serve, name="ds4desk-remote", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    @property
    def models(self) -> list[RemoteModel]:
        """What the server listed at the last connect."""
        return list(self._models)

    @property
    def parked(self) -> bool:
        return False

    @property
    def busy(self) -> bool:
        return self._serving is not None or not self._commands.empty()

    @property
    def memory_stats(self) -> MemoryStats | None:
        return None

    def submit_load(
        self, request: LoadRequest, on_progress: ProgressCallback | None = None
    ) -> Future[LoadResult]:
        """Connect: list the server's models and choose `request.path` (a model name), else the
        configured one, else the first listed. Nothing is loaded here; the server has it."""
        return self._submit(_Command("load", request, Future()))

    def submit_models(self) -> Future[list[RemoteModel]]:
        """GET /v1/models; the future raises EngineFailure when the server cannot be asked."""
        return self._submit(_Command("models", None, Future()))

    def cancel_load(self) -> None:
        """A connect in progress stops (its connection is closed)."""
        with self._lock:
            abort = self._abort if self._serving in ("load", "models") else None
        if abort is not None:
            abort.abort()

    def resident_bytes(self) -> tuple[str, int]:
        return "", 0  # nothing of it lives in this process

    def submit_generate(self, request: GenerateRequest, sink: Sink | None = None) -> Future[GenerateResult]:
        """`sink(token, text)` is called on this engine's thread with each piece of text; the token
        is answer.REMOTE_TOKEN (the server does not say which ids), None for text of no token."""
        return self._submit(_Command("generate", request, Future(), sink))

    def submit_park(self, selector: str = "", *, cancel_running: bool | None = None) -> Future[ParkResult]:
        return _done(ParkResult(selector, parked=False, error=_not_available("park")))

    def submit_unpark(self, selector: str = "") -> Future[ParkResult]:
        return _done(ParkResult(selector, parked=False, error=_not_available("unpark")))

    def submit_slots(self, op: str, slot: int | None = None, path: Path | None = None) -> Future[SlotResult]:
        return _done(SlotResult(slot=slot, error=_not_available("snapshot slots")))

    def submit_memory(self) -> Future[MemoryStats]:
        future: Future[MemoryStats] = Future()
        future.set_exception(EngineFailure(ErrorCode.BAD_REQUEST, f"memory readings are {NOT_AVAILABLE}"))
        return future

    def idle_park_deadline(self) -> float | None:
        return None

    def cancel(self, request_id: int) -> None:
        """Stop: a waiting request never starts; the running one's connection is closed, which the
        server takes as a cancel, and the answer ends with what arrived."""
        with self._lock:
            self._cancelled.add(request_id)
            abort = self._abort if self._running == request_id else None
        if abort is not None:
            abort.abort()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            abort = self._abort
        if abort is not None:
            abort.abort()
        self._commands.put(None)
        self._thread.join(timeout)

    # Blocking forms, for the command line.

    def load(
        self, request: LoadRequest | None = None, on_progress: ProgressCallback | None = None
    ) -> LoadResult:
        return self.submit_load(request or LoadRequest()).result()

    def generate(self, request: GenerateRequest, sink: Sink | None = None) -> GenerateResult:
        return self.submit_generate(request, sink).result()

    def list_models(self) -> list[RemoteModel]:
        return self.submit_models().result()

    def park(self, selector: str = "", *, cancel_running: bool | None = None) -> ParkResult:
        return self.submit_park(selector).result()

    def unpark(self, selector: str = "") -> ParkResult:
        return self.submit_unpark(selector).result()

    def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        return self.submit_slots(op, slot, path).result()

    def _submit(self, command: _Command) -> Future[Any]:
        if not self._thread.is_alive():
            raise RuntimeError("the remote engine's thread has stopped")
        self._commands.put(command)
        return command.future

    # ---- the engine's thread -------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            command = self._commands.get()
            if command is None:
                return
            if not command.future.set_running_or_notify_cancel():
                continue
            self._serving = command.kind
            try:
                if command.kind == "load":
                    command.future.set_result(self._load(command.payload))
                elif command.kind == "models":
                    command.future.set_result(self._list_models())
                else:
                    command.future.set_result(self._generate(command.payload, command.sink))
            except EngineFailure as failure:  # the server could not be asked: the caller says why
                command.future.set_exception(failure)
            except BaseException as exc:  # a bug of ours: still one answer, and the thread goes on
                log.exception("remote %s failed", command.kind)
                command.future.set_exception(exc)
            finally:
                self._serving = None

    def _api_base(self) -> str:
        if self._base is None:
            self._base = base_url(self.config.url)
        return self._base

    def _list_models(self) -> list[RemoteModel]:
        abort = Abort()
        with self._lock:
            outer, self._abort = self._abort, abort  # inside a generate: Stop closes this one first
        try:
            self._models = models_of(get_json(self.config, self._api_base(), MODELS_PATH, abort=abort))
            return list(self._models)
        finally:
            with self._lock:
                self._abort = outer
            if abort.aborted and outer is not None:
                outer.abort(abort.reason or "cancel")

    def _load(self, request: LoadRequest) -> LoadResult:
        started = time.monotonic()
        try:
            self._info = self._choose(request.path or self.config.model)
        except EngineFailure as failure:
            return LoadResult(
                info=self._info, error=_load_error(failure.error), seconds=time.monotonic() - started
            )
        return LoadResult(info=self._info, seconds=time.monotonic() - started)

    def _choose(self, wanted: str | None) -> ModelInfo:
        models = self._list_models()
        if not models:
            raise EngineFailure(ErrorCode.MODEL_NOT_LOADED, f"{self._api_base()} lists no model")
        if wanted is None:
            return remote_model_info(models[0], self._api_base())
        for model in models:
            if model.id == wanted:
                return remote_model_info(model, self._api_base())
        names = ", ".join(m.id for m in models[:8])
        raise EngineFailure(
            ErrorCode.BAD_REQUEST,
            f"the server has no model named {wanted!r} (it has: {names}); "
            "a local model opens once disconnected from the server",
        )

    def _generate(self, request: GenerateRequest, sink: Sink | None) -> GenerateResult:
        abort = Abort()
        answer = Answer(request, sink)
        with self._lock:
            self._running = request.request_id
            self._abort = abort
            cancelled_early = request.request_id in self._cancelled
        error: EngineError | None = None
        overrun = False
        deadline = None
        try:
            if cancelled_early:
                raise EngineFailure(ErrorCode.CANCELLED, "cancelled before it started")
            if self._info is None:
                self._info = self._choose(self.config.model)
            if self.config.answer_timeout_s is not None:
                deadline = threading.Timer(
                    self.config.answer_timeout_s, abort.abort, kwargs={"reason": "deadline"}
                )
                deadline.daemon = True
                deadline.start()
            answer.start()
            self._stream(request, answer, abort)
        except Overrun:
            overrun = True
            log.warning("the server sent past max_tokens %d: cut there", request.max_new_tokens)
        except EngineFailure as failure:
            error = failure.error
        except Exception as exc:  # a bug of ours, or a failure no branch above foresaw
            log.exception("remote generate failed")
            error = EngineError(ErrorCode.DECODE_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            if deadline is not None:
                deadline.cancel()
            with self._lock:
                self._cancelled.discard(request.request_id)
                self._running = None
                self._abort = None
        answer.end()
        stopped = abort.reason == "cancel"
        if abort.reason == "deadline":
            limit = self.config.answer_timeout_s
            error = EngineError(ErrorCode.DECODE_FAILED, f"the answer took longer than {limit:g} s; closed")
        elif stopped and error is not None and error.code != ErrorCode.CANCELLED:
            error = None  # the read that failed was our own Stop closing the connection
        return answer.result(request.request_id, error, stopped, overrun)

    def _stream(self, request: GenerateRequest, answer: Answer, abort: Abort) -> None:
        chat = uses_chat(request)
        body = request_body(request, self._info.name if self._info else "", self.config.stop, stream=True)
        path = CHAT_PATH if chat else COMPLETIONS_PATH
        opened = open_request(
            self.config, self._api_base(), "POST", path, body, accept="text/event-stream", abort=abort
        )
        where = f"{opened.url}"
        try:
            if opened.content_type == "application/json":
                # A server that does not stream answers whole: one piece, then the end.
                raw = opened.response.read(self.config.max_body_bytes + 1)
                if len(raw) > self.config.max_body_bytes:
                    raise EngineFailure(ErrorCode.DECODE_FAILED, f"{where}: answer larger than the limit")
                answer.add(chunk_parts(parse_json_bytes(raw, where), chat))
                return
            self._read_events(opened.response, answer, chat, where)
        except TimeoutError:
            raise EngineFailure(
                ErrorCode.DECODE_FAILED,
                f"{where}: nothing from the server for {self.config.read_timeout_s:g} s; closed",
            ) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if abort.aborted:
                raise EngineFailure(ErrorCode.DECODE_FAILED, "closed") from None
            raise EngineFailure(
                ErrorCode.DECODE_FAILED, f"{where}: the connection broke mid-answer ({type(exc).__name__})"
            ) from None
        finally:
            opened.close()

    def _read_events(
        self, response: http.client.HTTPResponse, answer: Answer, chat: bool, where: str
    ) -> None:
        max_lines = 8 * answer.max_events  # comments and empty lines around each event
        reader = SseReader(response.readline, self.config.max_line_bytes, max_lines)
        for event in reader.events():
            data = event.data.strip()
            if data == "[DONE]":
                return
            if event.event == "error":
                raise EngineFailure(ErrorCode.DECODE_FAILED, f"the server reported an error: {_said(data)}")
            if not data:
                continue
            try:
                parsed = json.loads(data)
            except (ValueError, RecursionError):
                raise EngineFailure(
                    ErrorCode.DECODE_FAILED, f"{where}: the server sent an event that is not JSON"
                ) from None
            answer.add(chunk_parts(parsed, chat))
        if answer.finish is None:
            raise EngineFailure(
                ErrorCode.DECODE_FAILED, f"{where}: the server closed the connection mid-answer"
            )


def _said(data: str) -> str:
    return error_message(data.encode())[0] or "no message"


def _not_available(what: str) -> EngineError:
    return EngineError(ErrorCode.BAD_REQUEST, f"{what}: {NOT_AVAILABLE}")


def _load_error(error: EngineError) -> EngineError:
    return EngineError(
        ErrorCode.LOAD_FAILED if error.code != ErrorCode.BAD_REQUEST else error.code, error.detail
    )


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future
