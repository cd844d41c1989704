"""One backend for the window that is either the local engine or a server, switched in place.

The window hands its backend to many parts (model loader, park row, slot panel, speed dock);
swapping each of their references on Connect would be fragile. They keep this one object, which
answers for whichever side is current. A request goes on to the side it started on: Stop during a
switch still reaches it. Opening a local model (File > Open, a dropped file, Open recent) leaves
the server: the local side takes over again.

No Qt and no torch: `make_client` (app.py passes EngineClient) wraps a connected RemoteEngine.
The backends are typed Any: ds4desk.ui.backend.ChatBackend is the protocol both sides meet, but
this package stays below the UI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds4desk.engine.api import (
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
)
from ds4desk.remote.engine import RemoteEngine

log = logging.getLogger(__name__)


class SwitchingBackend:
    def __init__(self, local: Any, make_client: Callable[[RemoteEngine], Any]) -> None:
        self.local = local
        self._make_client = make_client
        self._remote: Any = None
        self._remote_engine: RemoteEngine | None = None
        self._sides: dict[int, Any] = {}  # request id -> the side answering it

    # ---- switching --------------------------------------------------------------------------------

    @property
    def current(self) -> Any:
        return self._remote if self._remote is not None else self.local

    @property
    def remote(self) -> bool:
        """Answers come from a server: park, slots and the memory readout are greyed out."""
        return self._remote is not None

    def use_remote(self, engine: RemoteEngine) -> None:
        """`engine` is connected (ConnectDialog.take_engine()); a previous server is let go."""
        previous = self._remote_engine
        self._remote_engine = engine
        self._remote = self._make_client(engine)
        if previous is not None and previous is not engine:
            self._close_later(previous)

    def use_local(self) -> None:
        """Back to the local engine (and its model, if one is loaded)."""
        engine, self._remote, self._remote_engine = self._remote_engine, None, None
        if engine is not None:
            self._close_later(engine)

    @staticmethod
    def _close_later(engine: RemoteEngine) -> None:
        # Not waited for: an answer still streaming from it is stopped (its result still arrives,
        # with what was written), then its thread ends on its own.
        engine.close(timeout=0.0)

    # ---- ChatBackend ------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo | None:
        return self.current.model_info

    @property
    def parked(self) -> bool:
        return bool(self.current.parked)

    async def load(
        self, request: LoadRequest, on_progress: Callable[[int, int, str], None] | None = None
    ) -> LoadResult:
        if self.remote:
            self.use_local()  # a local model means leaving the server
        return await self.local.load(request, on_progress)

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        side = self.current
        self._sides[request.request_id] = side
        try:
            return await side.generate(request, on_delta)
        finally:
            self._sides.pop(request.request_id, None)

    def cancel(self, request_id: int) -> None:
        self._sides.get(request_id, self.current).cancel(request_id)

    async def park(self, selector: str = "", **kwargs: Any) -> ParkResult:
        return await self.current.park(selector, **kwargs)

    async def unpark(self, selector: str = "") -> ParkResult:
        return await self.current.unpark(selector)

    async def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        return await self.current.slots(op, slot, path)

    async def memory(self) -> MemoryStats:
        """The local engine's reading even while a server answers: that memory is still this
        machine's (a parked or unloaded model reads as such)."""
        return await self.local.memory()

    async def preview(self, request: LoadRequest) -> ModelPreview:
        return await self.local.preview(request)  # header reads of a local file

    def cancel_load(self) -> None:
        self.local.cancel_load()

    def idle_park_deadline(self) -> float | None:
        if self.remote:
            return None
        deadline = getattr(self.local, "idle_park_deadline", None)
        return deadline() if callable(deadline) else None

    def close(self) -> None:
        self.use_local()
        close = getattr(self.local, "close", None)
        if callable(close):
            close()
