"""What a path on disk turned out to be, before any weight is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """One tensor of a safetensors or GGUF file, as its (validated) header describes it."""

    file: Path
    dtype: str  # safetensors spelling: "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    # Byte offsets, already checked against the file size: into a safetensors file's data section,
    # or absolute in a GGUF file.
    begin: int
    end: int
    # Official DeepSeek checkpoints name tensors differently and store them quantized; such an
    # entry is keyed by the name the model expects and says how to get there from the file:
    key: str | None = None  # the tensor's name inside `file` when it differs from the model's name
    # "plain" | "fp8_block128" | "fp4_block32" | "gguf"; for quantized entries `shape` is the
    # LOGICAL (dequantized) shape and `dtype` the stored one, so shape checks work unchanged.
    encoding: str = "plain"
    scale: TensorEntry | None = None  # the block-scale tensor of a quantized entry
    # Non-empty when the logical tensor is several stored ones laid end to end in row-major order
    # (per-expert matrices stacked into one [E, ...] tensor); `file` etc. then repeat parts[0].
    parts: tuple[TensorEntry, ...] = ()
    # GGUF entries (loading/gguf_source.py): the GGML type id (`dtype` holds its name), the heads
    # whose q/k rows are stored in rope's pair order, and what to add to a stored norm weight.
    gguf_type: int = -1
    rope_heads: int = 0
    shift: float = 0.0
    # A GGUF entry that is some columns of a stored matrix, read as floats (llama.cpp stores
    # DeepSeek-V4's MTP e_proj and h_proj side by side as one eh_proj): (its first column, the
    # stored row length); `shape` is the slice's, `begin`/`end` the whole matrix's.
    columns: tuple[int, int] | None = None


@dataclass(slots=True, frozen=True)
class TokenizerSpec:
    """A tokenizer built in memory (from a GGUF file's metadata) with what a folder's
    tokenizer_config.json and generation_config.json would say about it."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> text
    add_bos_token: bool
    stop_ids: tuple[int, ...]
    notes: tuple[str, ...] = ()  # what the user may want to know (an unknown pre-tokenizer)


@dataclass(slots=True, frozen=True)
class NameLayout:
    """How a checkpoint spells its tensor names, for families whose files come in several spellings
    (DeepSeek-V4): what the user would call the layout, and how it names each of the model's tensors."""

    name: str
    stored_name: Callable[[str], str]  # the model's name of a tensor -> this layout's


@dataclass(slots=True)
class ModelSource:
    """A loadable model: a Hugging Face style folder, or a GGUF file read in place."""

    folder: Path  # the folder, or the one the GGUF file is in
    origin: Path  # what the user pointed at: the folder itself, or the .gguf file
    config: dict
    architecture: str  # config["architectures"][0]
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    tokenizer_file: Path | None = None
    chat_template: str | None = None
    tokenizer: TokenizerSpec | None = None  # a GGUF's; a folder's is tokenizer_file
    layout: NameLayout | None = None  # the name layout recognised, where the family has several

    def missing_tensor(self, name: str) -> str:
        """The message for a tensor the model needs and the checkpoint lacks: in the recognised
        layout's own spelling, which is what the user can look for in the files."""
        if self.layout is None:
            return f"checkpoint has no tensor '{name}'"
        stored = self.layout.stored_name(name)
        ours = "" if stored == name else f" (the model's {name})"
        return f"{self.layout.name} checkpoint has no tensor '{stored}'{ours}"

    @property
    def is_gguf(self) -> bool:
        return self.origin != self.folder
