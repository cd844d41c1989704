"""What the window needs from the engine: the real EngineClient and the tests' fake both fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ds4desk.engine.api import GenerateRequest, GenerateResult, LoadRequest, LoadResult, ModelInfo, TextDelta


@runtime_checkable
class ChatBackend(Protocol):
    @property
    def model_info(self) -> ModelInfo | None: ...

    async def load(self, request: LoadRequest) -> LoadResult:
        """Never raises: failures come back in LoadResult.error."""
        ...

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        """Never raises; `on_delta` is called on the loop thread with batches of text."""
        ...

    def cancel(self, request_id: int) -> None: ...
