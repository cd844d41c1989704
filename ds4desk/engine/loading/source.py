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
    # Official DeepSeek checkpoints name tensors differently and store them quantized; such an
    # entry is keyed by the name the model expects and says how to get there from the file:
    key: str | None = None  # the tensor's name inside `file` when it differs from the model's name
    # "plain" | "fp8_block128" | "fp4_block32"; for quantized entries `shape` is the LOGICAL
    # (dequantized) shape and `dtype` the stored one, so shape checks work unchanged.
    encoding: str = "plain"
    scale: TensorEntry | None = None  # the block-scale tensor of a quantized entry
    # Non-empty when the logical tensor is several stored ones laid end to end in row-major order
    # (per-expert matrices stacked into one [E, ...] tensor); `file` etc. then repeat parts[0].
    parts: tuple[TensorEntry, ...] = ()


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
