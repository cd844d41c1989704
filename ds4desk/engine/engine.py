"""The engine thread: one thread owns the model and every torch call; commands arrive on a queue.

Callers on any thread submit commands and get concurrent futures back. Nothing is raised across the
thread boundary: every failure becomes an EngineError inside the result.
"""

from __future__ import annotations

import collections
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
    CPU_PREFILL_MODES,
    WARM_UP_UNIT,
    WEIGHT_MODES,
    EngineError,
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    MemoryStats,
    ModelInfo,
    ParkResult,
    ProgressCallback,
    SlotResult,
    ThinkingBudget,
)
from ds4desk.engine.load_steps import (
    dtype_name,
    fill_and_start,
    fingerprint,
    model_bytes,
    model_name,
    plan_draft,
    probe_thinking,
    release_frames,
    start_draft,
    state_check,
)
from ds4desk.engine.parking import Loaded, Parked, Parking
from ds4desk.engine.prompting import prompt_ids, token_logprob

if TYPE_CHECKING:
    from ds4desk.engine.runtime import Scored

log = logging.getLogger(__name__)

# Called on the engine thread for every generated token with the text it completed (may be "");
# token None carries text held back until the end (an unfinished UTF-8 sequence, say).
# sink(token, text) or, with GenerateRequest.top_logprobs, sink(token, text, TokenLogprob).
DeltaSink = Callable[..., None]


@dataclass(slots=True)
class _Command:
    kind: str  # "load" | "generate" | "park" | "unpark" | "slots" | "memory"
    payload: Any
    future: Future[Any]
    sink: DeltaSink | None = None


class Engine(Parking):
    """`unpark_on_generate`: a request to a parked model reloads it first (else `model_parked`).
    `park_cancels_running`: a park stops the answer being written instead of waiting for it.
    `idle_park_after_s`: park the model after that long without a command (None: never)."""

    def __init__(
        self,
        *,
        unpark_on_generate: bool = True,
        park_cancels_running: bool = False,
        idle_park_after_s: float | None = None,
        snapshot_slots: int = 16,
        snapshot_budget_bytes: int = 4 * 2**30,
    ) -> None:
        self._snapshot_slots = snapshot_slots
        self._snapshot_budget_bytes = snapshot_budget_bytes
        self._unpark_on_generate = unpark_on_generate
        self._park_cancels_running = park_cancels_running
        self._idle_park_after_s = idle_park_after_s
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._cancelled: set[int] = set()
        self._running: int | None = None  # the request id being generated
        self._lock = threading.Lock()
        self._loaded: Loaded | None = None
        self._parked: Parked | None = None
        # Loads are numbered when submitted; cancel_load() cancels every one submitted so far.
        self._load_seq = 0
        self._load_cancel_upto = 0
        # Commands taken off the queue while a load was running, served after it in their order.
        self._deferred: collections.deque[_Command | None] = collections.deque()
        # The idle auto-park counts from the end of the last command (a memory reading is no use).
        self._idle_since = time.monotonic()
        self._serving: str | None = None  # the kind of command being served
        self._memory: MemoryStats | None = None  # the latest reading, refreshed by the engine thread
        self._memory_read_at = 0.0
        self._memory_device: Any = None  # the device of the last loaded model
        self._model_devices: list[
            Any
        ] = []  # the devices of the last loaded model (a layer split has several)
        # Set while a request unparks its model: that request is the warm-up (a warm-up first would
        # only add its own steps to the answer's wait).
        self._unparking_for_request = False
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

    def submit_load(
        self, request: LoadRequest, on_progress: ProgressCallback | None = None
    ) -> Future[LoadResult]:
        """`on_progress` is called on the engine thread after each tensor is in place."""
        with self._lock:
            self._load_seq += 1
            seq = self._load_seq
        return self._submit(_Command("load", (request, seq, on_progress), Future()))

    def cancel_load(self) -> None:
        """Every load submitted so far stops at its next tensor (or before it starts) with
        `cancelled`; the model that was loaded before stays (or is reloaded)."""
        with self._lock:
            self._load_cancel_upto = self._load_seq

    def _load_cancelled(self, seq: int | None) -> bool:
        with self._lock:
            return seq is not None and seq <= self._load_cancel_upto

    def resident_bytes(self) -> tuple[str, int]:
        """(device, bytes) that unloading the current model would give back; ("", 0) if none."""
        loaded = self._loaded
        if loaded is None:
            return "", 0
        return str(loaded.runtime.device), model_bytes(loaded.runtime, loaded.info)

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

    def submit_memory(self) -> Future[MemoryStats]:
        """A fresh reading, taken on the engine thread after the commands queued before it."""
        return self._submit(_Command("memory", None, Future()))

    @property
    def memory_stats(self) -> MemoryStats | None:
        """The latest reading without waiting: taken after every command and about twice a second
        while an answer streams (None until the engine thread first read it)."""
        return self._memory

    @property
    def busy(self) -> bool:
        """A command is running or waiting: a memory command would wait for it."""
        return self._serving not in (None, "memory") or not self._commands.empty()

    def idle_park_deadline(self) -> float | None:
        """time.monotonic() at which the idle auto-park strikes; None when it is off, nothing is
        loaded, or a command is running."""
        if self._idle_park_after_s is None or self._loaded is None or self._serving not in (None, "memory"):
            return None
        return self._idle_since + self._idle_park_after_s

    def load(self, request: LoadRequest, on_progress: ProgressCallback | None = None) -> LoadResult:
        return self.submit_load(request, on_progress).result()

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
        self.cancel_load()  # a load still running would hold the thread for its whole length
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
        if self._deferred:
            return self._deferred.popleft()
        while True:
            deadline = self.idle_park_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return self._commands.get(timeout=timeout)
            except queue.Empty:  # idle for idle_park_after_s
                if self._loaded is not None:
                    log.info("parking after %.0f s idle", self._idle_park_after_s)
                    self._park("all")
                    self._after_command("park")

    def _serve(self) -> None:
        handlers: dict[str, Callable[[_Command], Any]] = {
            "load": lambda c: self._load(*c.payload),
            "generate": lambda c: self._generate(c.payload, c.sink),
            "park": lambda c: self._park(c.payload),
            "unpark": lambda c: self._unpark(c.payload),
            "slots": lambda c: self._slots(*c.payload),
            "memory": lambda c: self._read_memory(),
        }
        while (command := self._next_command()) is not None:
            if not command.future.set_running_or_notify_cancel():
                continue
            self._serving = command.kind
            try:
                outcome = handlers[command.kind](command)
            except BaseException as exc:  # a bug of ours: still never leave the caller waiting
                log.exception("engine command failed")
                self._after_command(command.kind)
                command.future.set_exception(exc)
                continue
            self._after_command(command.kind)  # before the caller hears back: it may ask memory_stats
            if isinstance(outcome, ParkResult):
                outcome.memory = self._memory  # read after the action, with the auto-park deadline
            command.future.set_result(outcome)
        self._drop_model()

    def _after_command(self, kind: str) -> None:
        self._serving = None
        if kind != "memory":
            self._idle_since = time.monotonic()
            self._read_memory_quietly()

    def _load(
        self, request: LoadRequest, seq: int | None = None, on_progress: ProgressCallback | None = None
    ) -> LoadResult:
        started = time.perf_counter()
        result = LoadResult()
        try:
            result.info = self._load_model(request, seq, on_progress, result)
        except EngineFailure as failure:
            result.error = failure.error
        except MemoryError as exc:
            detail = f"not enough memory to load the model ({exc})"
            result.error = EngineError(ErrorCode.OUT_OF_MEMORY, detail)
        except Exception as exc:
            log.exception("load failed")
            result.error = EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
        result.seconds = time.perf_counter() - started
        return result

    def _load_model(
        self,
        request: LoadRequest,
        seq: int | None = None,
        on_progress: ProgressCallback | None = None,
        result: LoadResult | None = None,
    ) -> ModelInfo:
        import torch

        from ds4desk.engine.devices import check_fits, free_memory_bytes
        from ds4desk.engine.loader import plan_load, resolve_placement
        from ds4desk.engine.loading.default_model import default_model_path
        from ds4desk.engine.loading.detect import read_source
        from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore
        from ds4desk.engine.speculative.mode import check_mode
        from ds4desk.engine.tokenizer import ChatTokenizer
        from ds4desk.engine.warm_up import warm_up

        if self._load_cancelled(seq):
            raise EngineFailure(ErrorCode.CANCELLED, "the load was cancelled before it started")
        if request.chunk < 0 or request.context < 2:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "chunk must be >= 0 (0: automatic) and context >= 2")
        if request.weights not in WEIGHT_MODES:
            modes = ", ".join(WEIGHT_MODES)
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"weights must be one of {modes}, got {request.weights!r}"
            )
        if request.cpu_prefill not in CPU_PREFILL_MODES:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST,
                f"cpu_prefill must be one of {', '.join(CPU_PREFILL_MODES)}, got {request.cpu_prefill!r}",
            )
        check_mode(request.speculative)
        beside = self._load_draft_beside(request)
        if beside is not None:
            return beside
        if on_progress is not None:
            on_progress(0, 0, "tensors")  # planning: the amount is not known yet
        path = Path(request.path).expanduser() if request.path else default_model_path()
        # Everything that can be checked without touching the loaded model is checked first, so a
        # bad file dropped on the window leaves the current model in place.
        source = read_source(path)
        tokenizer = ChatTokenizer.from_source(source)
        device, dtype, split_devices = resolve_placement(request)
        plan = plan_load(
            source,
            device,
            dtype,
            request.context,
            split_devices,
            request.layer_split,
            weights=request.weights,
        )
        context = plan.context
        draft_plan = plan_draft(request, plan) if request.draft else None
        needs = dict(plan.needs)
        if draft_plan is not None:  # the draft sits on the first device, beside the target
            needs[str(device)] = needs.get(str(device), 0) + sum(draft_plan.needs.values())
        previous = self._loaded
        # Refused before the current model is let go: a model that cannot fit costs nothing. Every
        # device of a split is checked on its own.
        what = f"{path.name} in {dtype_name(dtype)} with a {context}-token cache"
        for name, needed in needs.items():
            reclaimable = 0
            if previous is not None and str(previous.runtime.device) == name:
                reclaimable = model_bytes(previous.runtime, previous.info)
            check_fits(needed, torch.device(name), what, reclaimable)
        # Both at once when memory allows: the current model keeps answering between the new one's
        # tensors, and a failed or cancelled load leaves it exactly as it was. Otherwise it goes first.
        keep = previous is not None and all(
            needed <= free_memory_bytes(torch.device(name)) for name, needed in needs.items()
        )
        fallback = None
        if previous is not None and not keep:
            fallback = Parked(previous.request, previous.info, previous.snapshots)
            if result is not None:
                result.dropped_previous = True
        del previous  # no reference of ours may keep a dropped model's memory alive
        if not keep:
            self._drop_model()

        def stop_if_cancelled() -> None:
            if self._load_cancelled(seq):
                raise EngineFailure(ErrorCode.CANCELLED, f"loading {path.name} was cancelled")

        def tick(done: int, total: int) -> None:
            stop_if_cancelled()
            if on_progress is not None:
                on_progress(done, total, "tensors")
            if keep:
                self._serve_during_load()

        def warm_up_tick(done: int, total: int) -> None:
            stop_if_cancelled()
            if on_progress is not None:
                on_progress(done, total, WARM_UP_UNIT)
            if keep:
                self._serve_during_load()

        warm = request.warm_up and not self._unparking_for_request
        failure: BaseException | None = None
        try:
            loaded, runtime = fill_and_start(plan, request, tick, stop_if_cancelled, defer_graphs=warm)
            # Learned from the state at position 0, before the warm-up's requests move the cache.
            layout, vocab = state_check(runtime.model, context)
            if draft_plan is not None:
                # Its tensors are not counted in the progress (the bar would start over).
                runtime.draft = start_draft(draft_plan, runtime, lambda _done, _total: stop_if_cancelled())
            if warm:
                # The last stage, with the model complete (its draft too): what the first request
                # would pay for is paid here, inside the load's time and its cancel.
                report = warm_up(
                    runtime, request.speculative, lambda: self._load_cancelled(seq), warm_up_tick
                )
                if result is not None:
                    result.warm_up_seconds = report.seconds
        except BaseException as exc:
            failure = exc
        if failure is not None:
            # The plan (and the traceback's frames) hold the half-built model: free it before
            # anything is reloaded.
            del plan
            release_frames(failure)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if fallback is not None:
                self._loaded = None
                # Through the parked state, so the reload keeps its snapshots; if it fails too, the
                # previous model stays chosen, parked, and the next request tries again.
                self._parked = fallback
                if fallback.request != request:
                    log.warning("loading %s failed; reloading %s", path, fallback.info.path)
                    self._restore(fallback.request)
            raise failure
        info = ModelInfo(
            name=model_name(source.origin),
            family=loaded.family,
            architecture=source.architecture,
            path=str(source.origin),
            device=plan.devices_text,
            dtype=dtype_name(dtype),
            parameters=loaded.parameters,
            weight_bytes=loaded.weight_bytes,
            context=context,
            tokenizer=tokenizer.describe(),
            has_chat_template=source.chat_template is not None,
            thinking=probe_thinking(tokenizer),
            draft=runtime.draft.path if runtime.draft is not None else "",
            draft_weight_bytes=runtime.draft.weight_bytes if runtime.draft is not None else 0,
            cpu_prefill=("bfloat16" if runtime.bf16_prefill else "float32") if device.type == "cpu" else "",
        )
        parked = self._parked
        if parked is not None and parked.request == request:
            snapshots = parked.snapshots  # unparking: the same model, its snapshots still apply
        else:
            identity = ModelIdentity(fingerprint(source), info.dtype, context, layout, vocab)
            snapshots = SnapshotStore(identity, self._snapshot_slots, self._snapshot_budget_bytes)
        if keep:
            # The old model goes only now that the new one is ready; the cuBLAS workspaces stay,
            # because the new model's graphs were captured with them.
            self._drop_model(clear_workspaces=False)
        self._loaded = Loaded(runtime, tokenizer, info, request, snapshots)
        self._parked = None  # a new model replaces a parked one too
        # A load leaves many objects behind for the cyclic collector: collect them now, inside the
        # load's time, rather than in the first request (a full collection there cost a Qwen3.5
        # 3,000-token prefill 16 ms of host time on an H100, docs/BENCHMARKS.md).
        gc.collect()
        return info

    def _serve_during_load(self) -> None:
        """Between tensors of a load that keeps the current model: answer the requests waiting for
        it. Anything else (and whatever comes after it) waits for the load, in its order."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None or command.kind != "generate" or self._deferred or self._loaded is None:
                self._deferred.append(command)
                continue
            if not command.future.set_running_or_notify_cancel():
                continue
            try:
                outcome = self._generate(command.payload, command.sink)
            except BaseException as exc:
                log.exception("engine command failed")
                command.future.set_exception(exc)
            else:
                command.future.set_result(outcome)

    def _restore(self, request: LoadRequest) -> None:
        try:
            self._load_model(request)
        except Exception:
            log.exception("could not reload the previous model")

    def _drop_model(self, clear_workspaces: bool = True) -> None:
        if self._loaded is None:
            return
        device = self._loaded.runtime.device
        self._loaded = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
            # cuBLAS keeps a workspace per stream it ran on (graph capture adds streams); they come
            # from the same allocator and would outlive the model.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces and clear is not None:
                torch.cuda.synchronize(device)
                clear()
                torch.cuda.empty_cache()

    def _slots(self, op: str, slot: int | None, path: Path | None) -> SlotResult:
        chosen = self._loaded or self._parked
        try:
            if chosen is None:
                raise EngineFailure(ErrorCode.MODEL_NOT_LOADED, "no model is loaded")
            store = chosen.snapshots
            if op in ("free", "pin", "unpin", "save") and slot is None:
                raise EngineFailure(ErrorCode.BAD_REQUEST, f"'{op}' needs a slot")
            if slot is not None and (not isinstance(slot, int) or isinstance(slot, bool)):
                raise EngineFailure(ErrorCode.BAD_REQUEST, f"a slot is a number, got {slot!r}")
            if path is not None and not isinstance(path, Path):
                raise EngineFailure(ErrorCode.BAD_REQUEST, f"a slot path is a file path, got {path!r}")
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
            return SlotResult(slot=slot if isinstance(slot, int) else None, error=failure.error)
        except OSError as exc:  # a disk that is full, read-only or gone: the user's to fix
            error = EngineError(ErrorCode.BAD_REQUEST, f"{op} failed: {exc.strerror or exc}")
            return SlotResult(slot=slot if isinstance(slot, int) else None, error=error)
        except Exception as exc:  # a bug of ours: still one answer, and the engine goes on
            log.error("slot command %s failed: %s: %s", op, type(exc).__name__, exc)
            error = EngineError(ErrorCode.BAD_REQUEST, f"{op} failed: {type(exc).__name__}: {exc}")
            return SlotResult(slot=slot if isinstance(slot, int) else None, error=error)
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
                self._unparking_for_request = True
                try:
                    unparked = self._unpark("target")
                finally:
                    self._unparking_for_request = False
                if unparked.error is not None:
                    raise EngineFailure(unparked.error.code, f"unparking failed: {unparked.error.detail}")
            loaded = self._loaded
            if loaded is None:
                raise EngineFailure(ErrorCode.MODEL_NOT_LOADED, "no model is loaded")
            if self._is_cancelled(request.request_id):
                raise EngineFailure(ErrorCode.CANCELLED, "cancelled before it started")
            prompt = prompt_ids(request, loaded.tokenizer)
            result.prompt_tokens = prompt
            stops = set(request.stop_tokens) if request.stop_tokens is not None else loaded.tokenizer.stop_ids
            detokenizer = IncrementalDetokenizer(loaded.tokenizer)
            scored: list[Scored] = []  # filled by the runtime with request.top_logprobs

            def on_token(token: int) -> None:
                piece = detokenizer.push(token)
                if time.monotonic() - self._memory_read_at > 0.5:  # the memory chart moves while it streams
                    self._read_memory_quietly()
                if request.on_token is not None:
                    request.on_token(token)
                entry = token_logprob(loaded.tokenizer, token, scored[-1]) if scored else None
                if entry is not None:
                    result.token_logprobs.append(entry)
                if sink is not None:
                    sink(token, piece) if entry is None else sink(token, piece, entry)

            budget = request.thinking_budget
            if budget is not None and not budget.close_tokens:
                budget = ThinkingBudget(budget.max_tokens, loaded.tokenizer.encode("</think>"))
            outcome = loaded.runtime.generate(
                prompt,
                request.sampling,
                request.max_new_tokens,
                stops,
                on_token,
                lambda: self._is_cancelled(request.request_id),
                budget,
                loaded.snapshots,
                request.use_snapshots,
                request.save_snapshot,
                request.speculative or loaded.request.speculative,
                request.top_logprobs,
                scored if request.top_logprobs is not None else None,
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
            save = request.save_snapshot
            if outcome.snapshot_slot is not None and save is not None and save.tag is not None:
                loaded.snapshots.tag(outcome.snapshot_slot, save.tag)
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
