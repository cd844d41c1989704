"""The engine thread: one thread owns the model and every torch call; commands arrive on a queue.

Callers on any thread submit commands and get concurrent futures back. Nothing is raised across the
thread boundary: every failure becomes an EngineError inside the result.
"""

from __future__ import annotations

import gc
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds4desk.engine.api import (
    PARK_SELECTORS,
    EngineError,
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    ModelInfo,
    ParkResult,
    SlotResult,
)

if TYPE_CHECKING:
    from ds4desk.engine.runtime import Runtime
    from ds4desk.engine.snapshots import SnapshotStore
    from ds4desk.engine.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

# Called on the engine thread for every generated token with the text it completed (may be "");
# token None carries text held back until the end (an unfinished UTF-8 sequence, say).
DeltaSink = Callable[[int | None, str], None]


@dataclass(slots=True)
class _Command:
    kind: str  # "load" | "generate" | "park" | "unpark"
    payload: Any
    future: Future[Any]
    sink: DeltaSink | None = None


@dataclass(slots=True)
class _Loaded:
    runtime: Runtime
    tokenizer: ChatTokenizer
    info: ModelInfo
    request: LoadRequest
    snapshots: SnapshotStore


@dataclass(slots=True)
class _Parked:
    request: LoadRequest
    info: ModelInfo
    snapshots: SnapshotStore  # host memory: they outlive the park


class Engine:
    """`unpark_on_generate`: a request to a parked model reloads it first (else `model_parked`).
    `park_cancels_running`: a park stops the answer being written instead of waiting for it.
    `idle_park_after_s`: park the model after that long without a command (None: never)."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        unpark_on_generate: bool = True,
        park_cancels_running: bool = False,
        idle_park_after_s: float | None = None,
        snapshot_slots: int = 16,
        snapshot_budget_bytes: int = 4 * 2**30,
    ) -> None:
        self._cache_dir = cache_dir
        self._snapshot_slots = snapshot_slots
        self._snapshot_budget_bytes = snapshot_budget_bytes
        self._unpark_on_generate = unpark_on_generate
        self._park_cancels_running = park_cancels_running
        self._idle_park_after_s = idle_park_after_s
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._cancelled: set[int] = set()
        self._running: int | None = None  # the request id being generated
        self._lock = threading.Lock()
        self._loaded: _Loaded | None = None
        self._parked: _Parked | None = None
        self._thread = threading.Thread(target=self._serve, name="ds4desk-engine", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo | None:
        """The chosen model, loaded or parked."""
        loaded, parked = self._loaded, self._parked
        return loaded.info if loaded else parked.info if parked else None

    @property
    def parked(self) -> bool:
        return self._parked is not None

    def submit_load(self, request: LoadRequest) -> Future[LoadResult]:
        return self._submit(_Command("load", request, Future()))

    def submit_generate(
        self, request: GenerateRequest, sink: DeltaSink | None = None
    ) -> Future[GenerateResult]:
        return self._submit(_Command("generate", request, Future(), sink))

    def submit_park(self, selector: str = "", *, cancel_running: bool | None = None) -> Future[ParkResult]:
        """Park frees weights and caches on the device. It runs after the commands queued before it,
        so it waits for a running generation, unless `cancel_running` (default: the engine's
        park_cancels_running) stops that one first."""
        if self._park_cancels_running if cancel_running is None else cancel_running:
            with self._lock:
                if self._running is not None:
                    self._cancelled.add(self._running)
        return self._submit(_Command("park", selector, Future()))

    def submit_unpark(self, selector: str = "") -> Future[ParkResult]:
        return self._submit(_Command("unpark", selector, Future()))

    def submit_slots(self, op: str, slot: int | None = None, path: Path | None = None) -> Future[SlotResult]:
        """Snapshot slots: op is "list", "free", "pin", "unpin", "save" (slot to path) or "load"
        (path into slot, or a free one)."""
        return self._submit(_Command("slots", (op, slot, path), Future()))

    def load(self, request: LoadRequest) -> LoadResult:
        return self.submit_load(request).result()

    def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        return self.submit_slots(op, slot, path).result()

    def park(self, selector: str = "", *, cancel_running: bool | None = None) -> ParkResult:
        return self.submit_park(selector, cancel_running=cancel_running).result()

    def unpark(self, selector: str = "") -> ParkResult:
        return self.submit_unpark(selector).result()

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

    def _next_command(self) -> _Command | None:
        while True:
            try:
                return self._commands.get(timeout=self._idle_park_after_s)
            except queue.Empty:  # idle for idle_park_after_s
                if self._loaded is not None:
                    log.info("parking after %.0f s idle", self._idle_park_after_s)
                    self._park("all")

    def _serve(self) -> None:
        handlers: dict[str, Callable[[_Command], Any]] = {
            "load": lambda c: self._load(c.payload),
            "generate": lambda c: self._generate(c.payload, c.sink),
            "park": lambda c: self._park(c.payload),
            "unpark": lambda c: self._unpark(c.payload),
            "slots": lambda c: self._slots(*c.payload),
        }
        while (command := self._next_command()) is not None:
            if not command.future.set_running_or_notify_cancel():
                continue
            try:
                outcome = handlers[command.kind](command)
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
        from ds4desk.engine.models.registry import check_tensors, load_model
        from ds4desk.engine.runtime import Runtime
        from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore
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
        context = min(request.context, int(source.config.get("max_position_embeddings") or request.context))
        # Names and shapes against the architecture, on the meta device: this also sizes the cache.
        planned, _ = check_tensors(source, dtype)
        weight_count = sum(math.prod(entry.shape) for entry in source.tensors.values())
        needed = weight_count * torch.empty((), dtype=dtype).element_size() + planned.cache_bytes_for(context)
        previous = self._loaded
        # Refused before the current model is let go: a model that cannot fit costs nothing.
        reclaimable = 0
        if previous is not None and previous.runtime.device == device:
            reclaimable = previous.info.weight_bytes + previous.runtime.model.cache_bytes()
        what = f"{path.name} in {_dtype_name(dtype)} with a {context}-token cache"
        check_fits(needed, device, what, reclaimable)
        self._drop_model()
        try:
            loaded = load_model(source, device, dtype)
            runtime = Runtime(loaded.model, device, context=context, chunk=request.chunk)
        except BaseException:
            self._loaded = None
            gc.collect()
            if previous is not None and previous.request != request:
                log.warning("loading %s failed; reloading %s", path, previous.info.path)
                # Through the parked state, so the reload keeps its snapshots; if it fails too, the
                # previous model stays chosen, parked, and the next request tries again.
                self._parked = _Parked(previous.request, previous.info, previous.snapshots)
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
        parked = self._parked
        if parked is not None and parked.request == request:
            snapshots = parked.snapshots  # unparking: the same model, its snapshots still apply
        else:
            identity = ModelIdentity(_fingerprint(source), info.dtype, context)
            snapshots = SnapshotStore(identity, self._snapshot_slots, self._snapshot_budget_bytes)
        self._loaded = _Loaded(runtime, tokenizer, info, request, snapshots)
        self._parked = None  # a new model replaces a parked one too
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

    def _park(self, selector: str) -> ParkResult:
        if selector not in PARK_SELECTORS:
            error = EngineError(ErrorCode.BAD_REQUEST, f"park selector must be one of {PARK_SELECTORS}")
            return ParkResult(selector, self.parked, error=error)
        loaded = self._loaded
        if selector == "draft" or loaded is None:  # no draft model yet; nothing loaded to free
            return ParkResult(selector, self.parked)
        started = time.perf_counter()
        freed = loaded.info.weight_bytes + loaded.runtime.model.cache_bytes()
        device = loaded.runtime.device
        before = _allocated(device)
        self._parked = _Parked(loaded.request, loaded.info, loaded.snapshots)
        del loaded
        self._drop_model()
        if device.type == "cuda":  # the allocator's own count, when there is one
            freed = before - _allocated(device)
        return ParkResult(selector, True, bytes=freed, seconds=time.perf_counter() - started)

    def _unpark(self, selector: str) -> ParkResult:
        if selector not in PARK_SELECTORS:
            error = EngineError(ErrorCode.BAD_REQUEST, f"unpark selector must be one of {PARK_SELECTORS}")
            return ParkResult(selector, self.parked, error=error)
        parked = self._parked
        if selector == "draft" or parked is None:
            return ParkResult(selector, self.parked)
        loaded = self._load(parked.request)  # the same files, device, dtype and sizes
        if not loaded.ok:
            self._parked = parked  # still parked: a later unpark can try again
            return ParkResult(selector, True, seconds=loaded.seconds, error=loaded.error)
        assert self._loaded is not None
        taken = self._loaded.info.weight_bytes + self._loaded.runtime.model.cache_bytes()
        return ParkResult(selector, False, bytes=taken, seconds=loaded.seconds)

    def _slots(self, op: str, slot: int | None, path: Path | None) -> SlotResult:
        chosen = self._loaded or self._parked
        try:
            if chosen is None:
                raise EngineFailure(ErrorCode.MODEL_NOT_LOADED, "no model is loaded")
            store = chosen.snapshots
            if op in ("free", "pin", "unpin", "save") and slot is None:
                raise EngineFailure(ErrorCode.BAD_REQUEST, f"'{op}' needs a slot")
            if op in ("save", "load") and path is None:
                raise EngineFailure(ErrorCode.BAD_REQUEST, f"'{op}' needs a path")
            if op == "free":
                store.free(slot)  # type: ignore[arg-type]
            elif op in ("pin", "unpin"):
                store.pin(slot, op == "pin")  # type: ignore[arg-type]
            elif op == "save":
                store.save(slot, path)  # type: ignore[arg-type]
            elif op == "load":
                slot = store.load(path, slot).slot  # type: ignore[arg-type]
            elif op != "list":
                raise EngineFailure(ErrorCode.BAD_REQUEST, f"unknown slot command '{op}'")
        except EngineFailure as failure:
            return SlotResult(slot=slot, error=failure.error)
        return SlotResult([snap.describe() for snap in store.list()], slot)

    def _generate(self, request: GenerateRequest, sink: DeltaSink | None) -> GenerateResult:
        from ds4desk.engine.tokenizer import IncrementalDetokenizer

        result = GenerateResult(request_id=request.request_id)
        with self._lock:
            self._running = request.request_id
        try:
            if self._loaded is None and self._parked is not None:
                if not self._unpark_on_generate:
                    raise EngineFailure(ErrorCode.MODEL_PARKED, "the model is parked; unpark it first")
                unparked = self._unpark("target")
                if unparked.error is not None:
                    raise EngineFailure(unparked.error.code, f"unparking failed: {unparked.error.detail}")
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
                loaded.snapshots,
                request.use_snapshots,
                request.save_snapshot,
            )
            tail = detokenizer.flush()
            if tail and sink is not None:
                sink(None, tail)
            result.tokens = outcome.tokens
            result.logprobs = outcome.logprobs
            result.finish_reason = outcome.finish_reason
            result.stats = outcome.stats
            result.budget_forced_close = outcome.budget_forced_close
            result.snapshot_slot = outcome.snapshot_slot
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
                self._running = None
        return result


def _prompt_ids(request: GenerateRequest, tokenizer: ChatTokenizer) -> list[int]:
    given = [x is not None for x in (request.prompt_tokens, request.messages, request.raw_text)]
    if sum(given) != 1:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "give exactly one of prompt_tokens, messages or raw_text")
    if request.max_new_tokens < 1:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "max_new_tokens must be at least 1")
    if request.prompt_tokens is not None:
        ids = list(request.prompt_tokens)  # the runtime checks them against the model's vocabulary
    elif request.messages is not None:
        thinking = request.thinking or request.thinking_budget is not None
        # Both spellings: our DeepSeek-V4 encoder and Hugging Face templates (enable_thinking).
        ids = tokenizer.encode_chat(
            request.messages, variables={"thinking": thinking, "enable_thinking": thinking}
        )
    else:
        ids = tokenizer.encode(request.raw_text or "")
    if not ids:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
    return ids


def _fingerprint(source: Any) -> str:
    """Which weights a snapshot belongs to: the architecture, config and every tensor's header."""
    import hashlib
    import json

    tensors = sorted((name, e.dtype, e.shape, e.end - e.begin) for name, e in source.tensors.items())
    payload = json.dumps([source.architecture, source.config, tensors], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _allocated(device: Any) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _model_name(origin: Path) -> str:
    return origin.stem if origin.is_file() else origin.name
