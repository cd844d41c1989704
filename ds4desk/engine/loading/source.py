"""What a path on disk turned out to be, before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its (validated) header describes it."""

    file: Path
    dtype: str  # safetensors spelling: "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    begin: int  # byte offsets into the file's data section, already checked against the file size
    end: int


@dataclass(slots=True)
class ModelSource:
    """A loadable Hugging Face style folder (a GGUF has been imported into one in the cache)."""

    folder: Path
    origin: Path  # what the user pointed at: the folder itself, or the .gguf it came from
    config: dict
    architecture: str  # config["architectures"][0]
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    tokenizer_file: Path | None = None
    chat_template: str | None = None
