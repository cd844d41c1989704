"""Typed reads of a GGUF file's `<arch>.<key>` metadata, shared by every architecture's mapping."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ds4desk.engine.api import EngineFailure, ErrorCode


def load_failed(path: Path, problem: str) -> EngineFailure:
    """LOAD_FAILED naming the file."""
    return EngineFailure(ErrorCode.LOAD_FAILED, f"cannot load {path.name}: {problem}")


class MetaReader:
    """Typed reads of `<arch>.<key>` metadata, failing with the file and key named."""

    def __init__(self, path: Path, meta: dict[str, object], arch: str) -> None:
        self.path, self.meta, self.arch = path, meta, arch

    def int_or(self, key: str, default: int | None) -> int:
        full = f"{self.arch}.{key}"
        value = self.meta.get(full, default)
        if type(value) is not int or value < 0:
            raise load_failed(
                self.path, f"metadata '{full}' is missing or not a non-negative integer (got {value!r})"
            )
        return value

    def float_or(self, key: str, default: float) -> float:
        full = f"{self.arch}.{key}"
        value = self.meta.get(full, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise load_failed(self.path, f"metadata '{full}' is not a number (got {value!r})")
        # GGUF stores these as float32: the shortest float32 spelling (1e-05, not 9.99999974e-06).
        return float(str(np.float32(value)))

    def get(self, key: str) -> object:
        return self.meta.get(f"{self.arch}.{key}")
