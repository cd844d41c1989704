"""Preflight: what a dropped path is and whether it fits, from its headers alone.

Nothing here allocates weights: safetensors and GGUF headers give the names and shapes, and the
load plan (`loader.plan_load`, the engine's own) builds the model on the meta device to size the
weights and the KV cache, so the preview and the load agree on what fits. `check_model` is what
`ds4desk check PATH` prints. Safe to call from any thread.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.api import EngineError, EngineFailure, ErrorCode, ModelPreview
from ds4desk.engine.devices import free_memory_bytes, resolve_device, resolve_dtype
from ds4desk.engine.formats import GGUF_TYPES
from ds4desk.engine.loader import MemoryNeed, gguf_entry_values, plan_load
from ds4desk.engine.loading import detect
from ds4desk.engine.loading.quant_checks import stored_bytes
from ds4desk.engine.loading.source import ModelSource, TensorEntry
from ds4desk.engine.models.base import load_failure
from ds4desk.engine.models.registry import ARCHITECTURES, family_for
from ds4desk.engine.tokenizer import ChatTokenizer

GB = 1e9
GGUF_TYPE_NAMES = frozenset(t.name for t in GGUF_TYPES.values()) - {"F32", "F16", "BF16"}


def _need_for(
    path: Path, device: torch.device, dtype: torch.dtype, context: int, weights: str
) -> tuple[ModelSource, MemoryNeed]:
    """The source at `path` and what it takes there: the engine's own load plan on the meta device."""
    source = detect.read_source(path)
    if source.tokenizer_file is None and source.tokenizer is None:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"no tokenizer.json in {source.folder}: ds4desk needs a fast-tokenizer file next to the weights",
        )
    return source, plan_load(source, device, dtype, context, weights=weights).memory


def stored_types(source: ModelSource) -> dict[str, int]:
    """Stored type (safetensors dtype, FP8/FP4 encoding or GGML type) -> the bytes it takes in the
    files, largest first: what the model card and `check` show."""
    sizes: Counter[str] = Counter()
    for entry in source.tensors.values():
        sizes[_type_name(entry)] += stored_bytes(entry)
    return dict(sizes.most_common())


def _type_name(entry: TensorEntry) -> str:
    return {"fp4_block32": "FP4", "fp8_block128": "FP8"}.get(entry.encoding, entry.dtype)


def preview_model(
    path: str | Path,
    device: str = "auto",
    dtype: str | None = None,
    context: int = 4096,
    *,
    weights: str = "as-stored",
    resident: tuple[str, int] = ("", 0),
    free_bytes: int | None = None,
) -> ModelPreview:
    """What loading `path` would take, for the window's model card. Never raises: a truncated,
    foreign or corrupt file comes back as `error` with a clear message.
    `resident`: (device, bytes) the current model takes, given back if it is unloaded.
    `free_bytes`: the free memory to plan against (None: ask the device)."""
    shown = str(path)
    try:
        target = Path(path).expanduser()
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        if context < 2:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "context must be at least 2")
        source, need = _need_for(target, torch_device, torch_dtype, context, weights)
    except EngineFailure as failure:
        return ModelPreview(shown, error=failure.error, message=failure.error.detail)
    except (MemoryError, RecursionError) as exc:
        error = EngineError(ErrorCode.LOAD_FAILED, f"{target.name} could not be read ({type(exc).__name__})")
        return ModelPreview(shown, error=error, message=error.detail)
    except Exception as exc:  # a reader bug must still not take the caller down with it
        error = EngineError(ErrorCode.LOAD_FAILED, f"{Path(shown).name}: {type(exc).__name__}: {exc}")
        return ModelPreview(shown, error=error, message=error.detail)

    if free_bytes is None:
        try:
            free_bytes = free_memory_bytes(torch_device)
        except Exception:  # a driver that cannot say: plan without it
            free_bytes = None
    preview = ModelPreview(
        shown,
        family=ARCHITECTURES.get(source.architecture, ("", ""))[0],
        architecture=source.architecture,
        stored_types=tuple(stored_types(source).items()),
        parameters=need.parameters,
        weight_bytes=need.weight_bytes,
        cache_bytes=need.cache_bytes,
        free_bytes=free_bytes,
        device=str(torch_device),
        dtype=str(torch_dtype).removeprefix("torch."),
        context=need.context,
    )
    reclaimable = resident[1] if resident[0] == preview.device else 0
    preview.fits = free_bytes is None or need.needed <= free_bytes + reclaimable
    preview.needs_unload = free_bytes is not None and preview.fits and need.needed > free_bytes
    preview.message = _message(preview, reclaimable)
    return preview


def _message(p: ModelPreview, reclaimable: int) -> str:
    sizes = (
        f"{_count(p.parameters)} parameters ({p.architecture}), needs {_gb(p.needed_bytes)} "
        f"({_gb(p.weight_bytes)} weights {_weights_as(p)} + {_gb(p.cache_bytes)} cache "
        f"for {p.context} tokens)"
    )
    if p.free_bytes is None:
        return f"{sizes}; free memory on {p.device} is unknown"
    if not p.fits:
        free = p.free_bytes + reclaimable
        ways = "choose a smaller context, another device or park the current model"
        if not reclaimable:
            ways = "choose a smaller context, another device or a smaller model"
        return f"needs {_gb(p.needed_bytes)}, {_gb(free)} free on {p.device}: {ways}"
    if p.needs_unload:
        return f"{sizes}; fits only after unloading the current model, which stops answering meanwhile"
    return f"{sizes}; {_gb(p.free_bytes)} free on {p.device}"


def _weights_as(p: ModelPreview) -> str:
    """How the weights are held: GGUF block types stay as stored, everything else in p.dtype."""
    gguf = [(name, n) for name, n in p.stored_types if name in GGUF_TYPE_NAMES]
    if not gguf:
        return f"in {p.dtype}"
    return "as stored: " + ", ".join(f"{name} {_gb(n)}" for name, n in gguf)


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# ---- ds4desk check ---------------------------------------------------------------------------------


def context_length(config: dict[str, Any]) -> int | None:
    text = config.get("text_config")  # a vision-language checkpoint's text model
    for where in (config, text if isinstance(text, dict) else {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = where.get(key)
            if type(value) is int and value > 0:
                return value
    return None


@dataclass(slots=True)
class ModelReport:
    """What `ds4desk check PATH` prints."""

    path: Path  # what the user pointed at
    folder: Path  # the HF folder (in the cache for a GGUF)
    family: str
    architecture: str
    parameters: int
    dtype: str  # the dtype most parameters are stored in
    weight_bytes: int
    tensor_count: int
    tokenizer: str
    has_chat_template: bool
    context_length: int | None
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> parameters stored in it
    stored: dict[str, int] = field(default_factory=dict)  # stored type -> bytes (stored_types)
    memory: MemoryNeed | None = None  # what loading takes on `device`
    device: str = ""

    def describe(self) -> str:
        source = str(self.path)
        stored = ", ".join(f"{name} {_size(n)}" for name, n in self.stored.items())
        dtypes = ", ".join(f"{d} {_count(n)}" for d, n in sorted(self.dtypes.items(), key=lambda kv: -kv[1]))
        lines = [
            f"model:         {source}",
            f"architecture:  {self.architecture} ({self.family} family)",
            f"parameters:    {_count(self.parameters)} in {self.tensor_count} tensors",
            f"weights:       {self.dtype}, {_size(self.weight_bytes)}"
            + (f" ({dtypes})" if len(self.dtypes) > 1 else ""),
            f"stored:        {stored}",
            f"tokenizer:     {self.tokenizer}",
            f"chat template: {'yes' if self.has_chat_template else 'no'}",
            f"context:       {self.context_length if self.context_length else 'unknown'} tokens",
        ]
        if self.memory is not None:
            need = self.memory
            lines.append(
                f"memory:        {_size(need.needed)} on {self.device}: {_size(need.weight_bytes)} weights"
                f" + {_size(need.cache_bytes)} cache for {need.context} tokens"
            )
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _check_hash_tables(source: ModelSource) -> None:
    """The one check that needs values, not headers: the small hash-routing tables."""
    from ds4desk.engine.loading.quantized import ShardReader, read_tensor
    from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
    from ds4desk.engine.models.deepseek_v4.modules import check_hash_table

    experts = DeepseekV4Config.from_hf(source.config).num_experts
    with ShardReader() as reader:
        for name, entry in source.tensors.items():
            if not name.endswith("mlp.gate.tid2eid"):
                continue
            if entry.encoding == "gguf":  # a GGUF's I32 table, read from its byte range
                with entry.file.open("rb") as handle:
                    handle.seek(entry.begin)
                    data = bytearray(handle.read(entry.end - entry.begin))
                if len(data) != entry.end - entry.begin:
                    raise load_failure(f"{entry.file.name} is shorter than its header says")
                table = gguf_entry_values(torch.frombuffer(data, dtype=torch.uint8), entry)
            else:
                table = read_tensor(reader, name, entry)
            check_hash_table(name, table, experts)


def check_model(
    path: Path, device: str = "auto", dtype: str | None = None, context: int = 4096
) -> ModelReport:
    """`ds4desk check PATH`: read `path` fully (tokenizer, template, every tensor's name and shape
    against the architecture, DeepSeek-V4's hash-routing tables) without loading any weights, and
    what loading it on `device` takes (the engine's load plan)."""
    source = detect.read_source(path)
    torch_device = resolve_device(device)
    memory = plan_load(source, torch_device, resolve_dtype(dtype, torch_device), context).memory
    if family_for(source.architecture) == "deepseek_v4":
        _check_hash_tables(source)
    per_dtype: Counter[str] = Counter()
    weight_bytes = 0
    for entry in source.tensors.values():
        per_dtype["FP4" if entry.encoding == "fp4_block32" else entry.dtype] += math.prod(entry.shape)
        weight_bytes += stored_bytes(entry)  # quantized: with scales and every part
    if source.tokenizer_file is None and source.tokenizer is None:
        tokenizer = "none (no tokenizer.json)"
    else:
        tokenizer = ChatTokenizer.from_source(source).describe()
    return ModelReport(
        path=source.origin,
        folder=source.folder,
        family=family_for(source.architecture),
        architecture=source.architecture,
        parameters=sum(per_dtype.values()),
        dtype=per_dtype.most_common(1)[0][0],
        weight_bytes=weight_bytes,
        tensor_count=len(source.tensors),
        tokenizer=tokenizer,
        has_chat_template=source.chat_template is not None,
        context_length=context_length(source.config),
        dtypes=dict(per_dtype),
        stored=stored_types(source),
        memory=memory,
        device=str(torch_device),
    )
