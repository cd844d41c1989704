"""What the window needs from the engine: the real EngineClient and the tests' fake both fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ds4desk.engine.api import (
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    LoadResult,
    ModelInfo,
    ParkResult,
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

    async def load(self, request: LoadRequest) -> LoadResult:
        """Never raises: failures come back in LoadResult.error."""
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
