"""What every architecture's GGUF mapping shares: typed reads of the file's `<arch>.<key>` metadata,
the tensors no model reads, and a tensor's type and entry."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.formats import GgufType, gguf_type
from ds4desk.engine.loading.gguf_header import GGUFTensor
from ds4desk.engine.loading.source import TensorEntry

# Tensors llama.cpp's converters store that the models here compute themselves (rope frequencies).
IGNORED_TENSORS = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")


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


def stored_type(path: Path, tensor: GGUFTensor) -> GgufType:
    """The tensor's block type; LOAD_FAILED naming the tensor for a type ds4desk does not read."""
    try:
        return gguf_type(int(tensor.qtype))
    except ValueError as exc:
        raise load_failed(path, f"tensor '{tensor.name}': {exc}") from None


def gguf_entry(
    path: Path,
    kind: GgufType,
    shape: tuple[int, ...],
    begin: int,
    nbytes: int,
    *,
    shift: float = 0.0,
    rope_heads: int = 0,
) -> TensorEntry:
    """Where a parameter's bytes are in the file, in their stored block type."""
    return TensorEntry(
        file=path,
        dtype=kind.name,
        shape=tuple(shape),
        begin=begin,
        end=begin + nbytes,
        encoding="gguf",
        gguf_type=kind.type_id,
        rope_heads=rope_heads,
        shift=shift,
    )


def special_token_ids(meta: dict) -> dict[str, int]:
    """bos_token_id / eos_token_id from the tokenizer metadata, where the file gives them as ints."""
    ids = {}
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if type(value) is int:
            ids[key] = value
    return ids
