"""The engine thread's memory jobs: what the model holds (the memory readout), park and unpark of
the model and of its draft, and a draft loaded beside the model. Engine inherits them; they run on
its thread like every command."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds4desk.engine.api import (
    PARK_SELECTORS,
    EngineError,
    EngineFailure,
    ErrorCode,
    LoadRequest,
    MemoryStats,
    ModelInfo,
    ParkResult,
)
from ds4desk.engine.load_steps import model_bytes, plan_draft, start_draft

if TYPE_CHECKING:
    from ds4desk.engine.runtime import Runtime
    from ds4desk.engine.snapshots import SnapshotStore
    from ds4desk.engine.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Loaded:
    runtime: Runtime
    tokenizer: ChatTokenizer
    info: ModelInfo
    request: LoadRequest
    snapshots: SnapshotStore


@dataclass(slots=True)
class Parked:
    request: LoadRequest
    info: ModelInfo
    snapshots: SnapshotStore  # host memory: they outlive the park


class Parking:
    """Engine's park, unpark and memory readings. The state they read, and `_load`, `_drop_model`
    and `idle_park_deadline`, are Engine's."""

    _loaded: Loaded | None
    _parked: Parked | None
    _memory: MemoryStats | None
    _memory_read_at: float
    _memory_device: Any
    _model_devices: list[Any]

    def _read_memory_quietly(self) -> MemoryStats | None:
        """A reading is a nicety: its failure must never fail the command around it."""
        try:
            return self._read_memory()
        except Exception:
            log.exception("reading the device memory failed")
            return None

    def _held_bytes(self) -> int:
        """What the engine holds for the model: the memory readout's figure; a park frees its drop."""
        from ds4desk.engine.memory import bytes_held

        loaded = self._loaded
        if loaded is None:
            return bytes_held(self._model_devices, 0)
        device, split = loaded.runtime.device, loaded.runtime.model.split
        self._model_devices = (
            [device] if split is None else sorted({type(device)(d) for d in split.devices}, key=str)
        )
        return bytes_held(self._model_devices, model_bytes(loaded.runtime, loaded.info))

    def _read_memory(self) -> MemoryStats:
        from ds4desk.engine.memory import read_memory

        if self._loaded is not None:
            self._memory_device = self._loaded.runtime.device
        deadline = self.idle_park_deadline()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._memory = read_memory(self._memory_device, left, held=self._held_bytes())
        self._memory_read_at = time.monotonic()
        return self._memory

    def _park(self, selector: str) -> ParkResult:
        if selector not in PARK_SELECTORS:
            error = EngineError(ErrorCode.BAD_REQUEST, f"park selector must be one of {PARK_SELECTORS}")
            return ParkResult(selector, self.parked, error=error)
        loaded = self._loaded
        if selector == "draft":
            return self._park_draft(selector)
        if loaded is None:  # nothing loaded to free
            return ParkResult(selector, self.parked)
        started = time.perf_counter()
        before = self._held_bytes()
        self._parked = Parked(loaded.request, loaded.info, loaded.snapshots)
        del loaded
        self._drop_model()
        freed = before - self._held_bytes()  # the readout's own quantity: its drop is what Park reports
        return ParkResult(selector, True, bytes=freed, seconds=time.perf_counter() - started)

    def _unpark(self, selector: str) -> ParkResult:
        if selector not in PARK_SELECTORS:
            error = EngineError(ErrorCode.BAD_REQUEST, f"unpark selector must be one of {PARK_SELECTORS}")
            return ParkResult(selector, self.parked, error=error)
        parked = self._parked
        if selector == "draft":
            return self._unpark_draft(selector)
        if parked is None:
            return ParkResult(selector, self.parked)
        before = self._held_bytes()
        loaded = self._load(parked.request)  # the same files, device, dtype and sizes
        if not loaded.ok:
            self._parked = parked  # still parked: a later unpark can try again
            return ParkResult(selector, True, seconds=loaded.seconds, error=loaded.error)
        taken = self._held_bytes() - before
        return ParkResult(selector, False, bytes=taken, seconds=loaded.seconds)

    def _park_draft(self, selector: str) -> ParkResult:
        """Free the draft model (weights and cache); the target keeps answering, without it. A
        target parked afterwards comes back with its draft (its LoadRequest names it)."""
        loaded = self._loaded
        if loaded is None or loaded.runtime.draft is None:  # no draft loaded: nothing to free
            return ParkResult(selector, self.parked)
        started = time.perf_counter()
        draft = loaded.runtime.draft
        device = loaded.runtime.device
        before = self._held_bytes()
        loaded.runtime.draft = None
        draft.close()
        del draft
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        freed = before - self._held_bytes()
        return ParkResult(selector, self.parked, bytes=freed, seconds=time.perf_counter() - started)

    def _unpark_draft(self, selector: str) -> ParkResult:
        """Load the draft the target's LoadRequest names again (nothing to do when it is loaded, or
        when the target itself is parked: its unpark brings the draft back)."""
        loaded = self._loaded
        if loaded is None or loaded.runtime.draft is not None or not loaded.request.draft:
            return ParkResult(selector, self.parked)
        started = time.perf_counter()
        before = self._held_bytes()
        try:
            draft_plan = plan_draft(loaded.request, None, loaded.runtime)
            loaded.runtime.draft = start_draft(draft_plan, loaded.runtime, None)
        except EngineFailure as failure:
            return ParkResult(
                selector, self.parked, seconds=time.perf_counter() - started, error=failure.error
            )
        except Exception as exc:
            log.exception("reloading the draft model failed")
            error = EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
            return ParkResult(selector, self.parked, seconds=time.perf_counter() - started, error=error)
        taken = self._held_bytes() - before
        return ParkResult(selector, self.parked, bytes=taken, seconds=time.perf_counter() - started)

    def _load_draft_beside(self, request: LoadRequest) -> ModelInfo | None:
        """A load that asks for the loaded model with another draft (File > Load draft model): only
        the draft is replaced; the model stays, with its graphs and its snapshots. None when the
        request differs from the loaded one in more than its draft (then it is a load like any)."""
        from ds4desk.engine.devices import check_fits

        loaded = self._loaded
        if (
            loaded is None
            or not request.draft
            or dataclasses.replace(request, draft=loaded.request.draft) != loaded.request
        ):
            return None
        runtime = loaded.runtime
        plan = plan_draft(request, None, runtime)  # a draft that cannot draft for it: refused here
        old = runtime.draft.bytes() if runtime.draft is not None else 0
        name = Path(request.draft).expanduser().name
        check_fits(sum(plan.needs.values()), runtime.device, f"{name} as the draft model", old)
        # The old draft goes first (its memory may be what the new one needs); should the new one
        # fail, the model answers on without a draft, and unpark("draft") brings the old one back.
        self._park_draft("draft")
        runtime.draft = start_draft(plan, runtime, None)
        loaded.request = request
        loaded.info = dataclasses.replace(
            loaded.info, draft=runtime.draft.path, draft_weight_bytes=runtime.draft.weight_bytes
        )
        return loaded.info
