"""The engine thread: one thread owns the model and every torch call; commands arrive on a queue.

Callers on any thread submit commands and get concurrent futures back. Nothing is raised across the
thread boundary: every failure becomes an EngineError inside the result.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds4desk.engine.api import (
    EngineError,
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    ModelInfo,
)

if TYPE_CHECKING:
    from ds4desk.engine.runtime import Runtime
    from ds4desk.engine.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

# Called on the engine thread for every generated token with the text it completed (may be "");
# token None carries text held back until the end (an unfinished UTF-8 sequence, say).
DeltaSink = Callable[[int | None, str], None]


@dataclass(slots=True)
class _Command:
    kind: str  # "load" | "generate"
    payload: Any
    future: Future[Any]
    sink: DeltaSink | None = None


@dataclass(slots=True)
class _Loaded:
    runtime: Runtime
    tokenizer: ChatTokenizer
    info: ModelInfo
    request: LoadRequest


class Engine:
    def __init__(self, cache_dir: Path) -> None:
        self._cache_dir = cache_dir
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._loaded: _Loaded | None = None
        self._thread = threading.Thread(target=self._serve, name="ds4desk-engine", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo | None:
        loaded = self._loaded
        return loaded.info if loaded else None

    def submit_load(self, request: LoadRequest) -> Future[LoadResult]:
        return self._submit(_Command("load", request, Future()))

    def submit_generate(
        self, request: GenerateRequest, sink: DeltaSink | None = None
    ) -> Future[GenerateResult]:
        return self._submit(_Command("generate", request, Future(), sink))

    def load(self, request: LoadRequest) -> LoadResult:
        return self.submit_load(request).result()

    def generate(self, request: GenerateRequest, sink: DeltaSink | None = None) -> GenerateResult:
        return self.submit_generate(request, sink).result()

    def cancel(self, request_id: int) -> None:
        """Takes effect between prefill chunks and between decode steps, or before the request starts."""
        with self._lock:
            self._cancelled.add(request_id)

    def close(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    def _submit(self, command: _Command) -> Future[Any]:
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread has stopped")
        self._commands.put(command)
        return command.future

    def _is_cancelled(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._cancelled

    # ---- engine thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        while (command := self._commands.get()) is not None:
            if not command.future.set_running_or_notify_cancel():
                continue
            try:
                if command.kind == "load":
                    outcome: Any = self._load(command.payload)
                else:
                    outcome = self._generate(command.payload, command.sink)
            except BaseException as exc:  # a bug of ours: still never leave the caller waiting
                log.exception("engine command failed")
                command.future.set_exception(exc)
            else:
                command.future.set_result(outcome)
        self._drop_model()

    def _load(self, request: LoadRequest) -> LoadResult:
        started = time.perf_counter()
        try:
            info = self._load_model(request)
        except EngineFailure as failure:
            return LoadResult(error=failure.error, seconds=time.perf_counter() - started)
        except MemoryError as exc:
            error = EngineError(ErrorCode.OUT_OF_MEMORY, f"not enough memory to load the model ({exc})")
            return LoadResult(error=error, seconds=time.perf_counter() - started)
        except Exception as exc:
            log.exception("load failed")
            error = EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
            return LoadResult(error=error, seconds=time.perf_counter() - started)
        return LoadResult(info=info, seconds=time.perf_counter() - started)

    def _load_model(self, request: LoadRequest) -> ModelInfo:
        import torch

        from ds4desk.engine.devices import check_fits, resolve_device, resolve_dtype
        from ds4desk.engine.loading.default_model import default_model_path
        from ds4desk.engine.loading.detect import inspect_model
        from ds4desk.engine.models.registry import load_model
        from ds4desk.engine.runtime import Runtime
        from ds4desk.engine.tokenizer import ChatTokenizer

        if request.chunk < 1 or request.context < 2:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "chunk must be >= 1 and context >= 2")
        path = Path(request.path).expanduser() if request.path else default_model_path()
        # Everything that can be checked without touching the loaded model is checked first, so a
        # bad file dropped on the window leaves the current model in place.
        source = inspect_model(path, self._cache_dir)
        tokenizer = ChatTokenizer.from_folder(source.folder, source.chat_template)
        device = resolve_device(request.device)
        dtype = resolve_dtype(request.dtype, device)
        weight_count = sum(_numel(entry.shape) for entry in source.tensors.values())
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        previous = self._loaded
        self._drop_model()
        try:
            check_fits(weight_count * dtype_bytes, device, f"{path.name} in {_dtype_name(dtype)}")
            loaded = load_model(source, device, dtype)
            context = min(
                request.context, int(source.config.get("max_position_embeddings") or request.context)
            )
            runtime = Runtime(loaded.model, device, context=context, chunk=request.chunk)
        except BaseException:
            self._loaded = None
            gc.collect()
            if previous is not None and previous.request != request:
                log.warning("loading %s failed; reloading %s", path, previous.info.path)
                self._restore(previous.request)
            raise
        info = ModelInfo(
            name=_model_name(source.origin),
            family=loaded.family,
            architecture=source.architecture,
            path=str(source.origin),
            device=str(device),
            dtype=_dtype_name(dtype),
            parameters=loaded.parameters,
            weight_bytes=loaded.weight_bytes,
            context=context,
            tokenizer=tokenizer.describe(),
            has_chat_template=source.chat_template is not None,
        )
        self._loaded = _Loaded(runtime, tokenizer, info, request)
        return info

    def _restore(self, request: LoadRequest) -> None:
        try:
            self._load_model(request)
        except Exception:
            log.exception("could not reload the previous model")

    def _drop_model(self) -> None:
        if self._loaded is None:
            return
        device = self._loaded.runtime.device
        self._loaded = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _generate(self, request: GenerateRequest, sink: DeltaSink | None) -> GenerateResult:
        from ds4desk.engine.tokenizer import IncrementalDetokenizer

        result = GenerateResult(request_id=request.request_id)
        try:
            loaded = self._loaded
            if loaded is None:
                raise EngineFailure(ErrorCode.MODEL_NOT_LOADED, "no model is loaded")
            if self._is_cancelled(request.request_id):
                raise EngineFailure(ErrorCode.CANCELLED, "cancelled before it started")
            prompt = _prompt_ids(request, loaded.tokenizer)
            result.prompt_tokens = prompt
            stops = set(request.stop_tokens) if request.stop_tokens is not None else loaded.tokenizer.stop_ids
            detokenizer = IncrementalDetokenizer(loaded.tokenizer)

            def on_token(token: int) -> None:
                piece = detokenizer.push(token)
                if request.on_token is not None:
                    request.on_token(token)
                if sink is not None:
                    sink(token, piece)

            outcome = loaded.runtime.generate(
                prompt,
                request.sampling,
                request.max_new_tokens,
                stops,
                on_token,
                lambda: self._is_cancelled(request.request_id),
                request.thinking_budget,
            )
            tail = detokenizer.flush()
            if tail and sink is not None:
                sink(None, tail)
            result.tokens = outcome.tokens
            result.logprobs = outcome.logprobs
            result.finish_reason = outcome.finish_reason
            result.stats = outcome.stats
            result.budget_forced_close = outcome.budget_forced_close
            result.text = loaded.tokenizer.decode(outcome.tokens)
        except EngineFailure as failure:
            result.error = failure.error
            result.finish_reason = (
                FinishReason.CANCELLED if failure.error.code == ErrorCode.CANCELLED else FinishReason.ERROR
            )
        except Exception as exc:
            log.exception("generate failed")
            result.error = EngineError(ErrorCode.DECODE_FAILED, f"{type(exc).__name__}: {exc}")
            result.finish_reason = FinishReason.ERROR
        finally:
            with self._lock:
                self._cancelled.discard(request.request_id)
        return result


def _prompt_ids(request: GenerateRequest, tokenizer: ChatTokenizer) -> list[int]:
    given = [x is not None for x in (request.prompt_tokens, request.messages, request.raw_text)]
    if sum(given) != 1:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "give exactly one of prompt_tokens, messages or raw_text")
    if request.max_new_tokens < 1:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "max_new_tokens must be at least 1")
    if request.prompt_tokens is not None:
        ids = list(request.prompt_tokens)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"token ids out of range 0..{tokenizer.vocab_size - 1}: {bad[:5]}"
            )
    elif request.messages is not None:
        ids = tokenizer.encode_chat(request.messages)
    else:
        ids = tokenizer.encode(request.raw_text or "")
    if not ids:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
    return ids


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _model_name(origin: Path) -> str:
    return origin.stem if origin.is_file() else origin.name
