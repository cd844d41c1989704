"""What the window needs from the engine: the real EngineClient and the tests' fake both fit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class ChatBackend(Protocol):
    @property
    def model_info(self) -> ModelInfo | None:
        """The chosen model; it stays set while the model is parked."""
        ...

    @property
    def parked(self) -> bool:
        """True while the model's weights are freed; the next answer reloads them."""
        ...

    async def load(
        self, request: LoadRequest, on_progress: Callable[[int, int, str], None] | None = None
    ) -> LoadResult:
        """Never raises: failures come back in LoadResult.error. `on_progress(done, total, unit)`
        is called on the loop thread, batched; total 0 while the amount is not known yet."""
        ...

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        """Never raises; `on_delta` is called on the loop thread with batches of text."""
        ...

    def cancel(self, request_id: int) -> None: ...

    async def park(self, selector: str) -> ParkResult:
        """Free the selected model's memory ("all", "target" or "draft"); failures come back in
        ParkResult.error. `bytes` is what was freed."""
        ...

    async def unpark(self, selector: str) -> ParkResult:
        """Load the parked weights back; `bytes` is what was taken."""
        ...

    # ---- snapshot slots and memory (slot panel, park row, live speed dock) -----------------------

    async def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        """op: "list", "free", "pin", "unpin", "save" (slot to path) or "load" (path into a slot);
        failures come back in SlotResult.error, and `slots` lists them all afterwards."""
        ...

    async def memory(self) -> MemoryStats:
        """The device memory now (or the engine's latest reading while it is busy)."""
        ...

    # ---- opening models (drag and drop, File > Open, recent models) ---------------------------------

    async def preview(self, request: LoadRequest) -> ModelPreview:
        """What loading request.path would take, from its headers (nothing allocated), off the loop
        thread. Never raises: a file that is no model comes back in ModelPreview.error."""
        ...

    def cancel_load(self) -> None:
        """The running load stops at its next tensor with `cancelled`; the previous model stays."""
        ...
