"""Torch-free checks of block-quantized tensor entries (shapes, dtypes, scales), so detection and
`ds4desk check` can reject a bad official DeepSeek checkpoint without importing torch.
See quantized.py for what the encodings mean."""

from __future__ import annotations

import math

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.formats import ENCODINGS, FP4_BLOCK, FP4_DTYPES, FP8_BLOCK, SCALE_DTYPES
from ds4desk.engine.loading.source import TensorEntry


def _fail(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def expected_scale_shape(encoding: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale shape a quantized weight of LOGICAL `shape` must come with."""
    rows, cols = shape
    if encoding == "fp8_block128":
        return (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    return (rows, math.ceil(cols / FP4_BLOCK))


def check_quantized(name: str, entry: TensorEntry) -> None:
    """LOAD_FAILED unless `entry` (the tensor the model calls `name`) is a consistent quantized pair."""
    where = f"tensor {name} ({entry.file.name}: {entry.key or name})"
    if entry.encoding not in ENCODINGS:
        raise _fail(f"{where}: unknown encoding {entry.encoding!r}")
    if entry.encoding == "plain":
        return
    scale = entry.scale
    if scale is None:
        raise _fail(f"{where} is {entry.encoding} but has no .scale tensor")
    if len(entry.shape) != 2:
        raise _fail(f"{where}: a block-quantized weight must be a matrix, got shape {list(entry.shape)}")
    if entry.encoding == "fp8_block128" and entry.dtype != "F8_E4M3":
        raise _fail(f"{where} has a block scale but dtype {entry.dtype}; FP8 weights are F8_E4M3")
    if entry.encoding == "fp4_block32":
        if entry.dtype not in FP4_DTYPES:
            raise _fail(f"{where} has dtype {entry.dtype}; packed FP4 experts are stored as I8")
        if entry.shape[1] % 2:
            raise _fail(f"{where}: packed FP4 needs an even row length, got {list(entry.shape)}")
    if scale.dtype not in SCALE_DTYPES:
        raise _fail(f"{where}: its scale {scale.key} has dtype {scale.dtype}, expected F8_E8M0")
    want = expected_scale_shape(entry.encoding, entry.shape)
    if tuple(scale.shape) != want:
        raise _fail(
            f"{where}: its scale {scale.key} has shape {list(scale.shape)}, but a {entry.encoding} "
            f"weight of shape {list(entry.shape)} needs {list(want)}"
        )


def stored_bytes(entry: TensorEntry) -> int:
    """Bytes the tensor takes on disk: every part, with its scales (columns of a stored matrix:
    their share of its bytes)."""
    if entry.parts:
        return sum(stored_bytes(part) for part in entry.parts)
    if entry.columns is not None:
        return (entry.end - entry.begin) * entry.shape[-1] // entry.columns[1]
    scale = entry.scale.end - entry.scale.begin if entry.scale is not None else 0
    return entry.end - entry.begin + scale
