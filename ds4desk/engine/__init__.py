"""The engine's public face. No torch at import time: torch loads inside the engine thread."""

from ds4desk.engine.api import (
    EngineError,
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateStats,
    LoadRequest,
    LoadResult,
    ModelInfo,
    ParkResult,
    SamplingParams,
    SaveSnapshot,
    SlotResult,
    TextDelta,
    ThinkingBudget,
)
from ds4desk.engine.client import EngineClient
from ds4desk.engine.engine import Engine

__all__ = [
    "Engine",
    "EngineClient",
    "EngineError",
    "EngineFailure",
    "ErrorCode",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "GenerateStats",
    "LoadRequest",
    "LoadResult",
    "ModelInfo",
    "ParkResult",
    "SamplingParams",
    "SaveSnapshot",
    "SlotResult",
    "TextDelta",
    "ThinkingBudget",
]
