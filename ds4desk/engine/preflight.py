"""Preflight: what a dropped path is and whether it fits, from its headers alone.

Nothing here allocates weights: safetensors and GGUF headers give the names and shapes, and the
model is built on the meta device to size its KV cache. The engine's own load uses `memory_needed`
too, so the preview and the load agree on what fits. Safe to call from any thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.api import EngineError, EngineFailure, ErrorCode, ModelPreview
from ds4desk.engine.devices import free_memory_bytes, resolve_device, resolve_dtype
from ds4desk.engine.loader import check_tensors
from ds4desk.engine.loading import detect
from ds4desk.engine.loading.gguf_header import read_gguf_header
from ds4desk.engine.loading.gguf_import import _plan, imported_folder
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models.registry import ARCHITECTURES, build_model

GB = 1e9


@dataclass(slots=True)
class MemoryPlan:
    """What a model takes on a device, before it is loaded."""

    parameters: int
    weight_bytes: int
    cache_bytes: int
    context: int  # the asked-for context, clamped to the model's maximum

    @property
    def needed(self) -> int:
        return self.weight_bytes + self.cache_bytes


def clamp_context(config: dict[str, Any], context: int) -> int:
    return min(context, int(config.get("max_position_embeddings") or context))


def memory_needed(
    source: ModelSource, dtype: torch.dtype, context: int, quantized: bool = False
) -> MemoryPlan:
    """Checks every tensor's name and shape against the architecture (LOAD_FAILED otherwise) and sizes
    the weights in `dtype` (`quantized`: as the packed parameters take them) and the cache for
    `context`."""
    meta, _ = check_tensors(source, dtype, quantized)
    parameters = sum(math.prod(entry.shape) for entry in source.tensors.values())
    weight_bytes = parameters * _itemsize(dtype)
    if quantized:
        weight_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    context = clamp_context(source.config, context)
    return MemoryPlan(parameters, weight_bytes, meta.cache_bytes_for(context), context)


def _gguf_plan(
    path: Path, cache_dir: Path | None, dtype: torch.dtype, context: int
) -> tuple[str, MemoryPlan]:
    """A GGUF not imported yet: its header gives the config and every tensor (the import, which
    converts the weights, happens at load time). One imported before is read like a folder."""
    if cache_dir is not None:
        folder = imported_folder(path, cache_dir)
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            source = detect.inspect_folder(folder)
            return source.architecture, memory_needed(source, dtype, context)
    header = read_gguf_header(path)  # checks the whole header and every tensor's byte range
    config, plan = _plan(path, header)
    architecture = str(config["architectures"][0])  # type: ignore[index]
    meta = build_model(architecture, config, dtype)
    parameters = sum(math.prod(p.source.shape) for p in plan)
    context = clamp_context(config, context)
    return architecture, MemoryPlan(
        parameters, parameters * _itemsize(dtype), meta.cache_bytes_for(context), context
    )


def _plan_for(path: Path, cache_dir: Path | None, dtype: torch.dtype, context: int) -> tuple[str, MemoryPlan]:
    if path.is_file() and detect._is_gguf(path):
        return _gguf_plan(path, cache_dir, dtype, context)
    # Folders and files of a folder: detect never touches the cache for those.
    source = detect.inspect_model(path, cache_dir or Path("."))
    if source.tokenizer_file is None:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"no tokenizer.json in {source.folder}: ds4desk needs a fast-tokenizer file next to the weights",
        )
    return source.architecture, memory_needed(source, dtype, context)


def inspect_model(
    path: str | Path,
    device: str = "auto",
    dtype: str | None = None,
    context: int = 4096,
    *,
    cache_dir: Path | None = None,
    resident: tuple[str, int] = ("", 0),
    free_bytes: int | None = None,
) -> ModelPreview:
    """Never raises: a truncated, foreign or corrupt file comes back as `error` with a clear message.
    `resident`: (device, bytes) the current model takes, given back if it is unloaded.
    `free_bytes`: the free memory to plan against (None: ask the device)."""
    shown = str(path)
    try:
        target = Path(path).expanduser()
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        if context < 2:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "context must be at least 2")
        architecture, plan = _plan_for(target, cache_dir, torch_dtype, context)
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
        family=ARCHITECTURES.get(architecture, ("", ""))[0],
        architecture=architecture,
        parameters=plan.parameters,
        weight_bytes=plan.weight_bytes,
        cache_bytes=plan.cache_bytes,
        free_bytes=free_bytes,
        device=str(torch_device),
        dtype=str(torch_dtype).removeprefix("torch."),
        context=plan.context,
    )
    reclaimable = resident[1] if resident[0] == preview.device else 0
    preview.fits = free_bytes is None or plan.needed <= free_bytes + reclaimable
    preview.needs_unload = free_bytes is not None and preview.fits and plan.needed > free_bytes
    preview.message = _message(preview, reclaimable)
    return preview


def _message(p: ModelPreview, reclaimable: int) -> str:
    sizes = (
        f"{_count(p.parameters)} parameters ({p.architecture}), needs {_gb(p.needed_bytes)} "
        f"({_gb(p.weight_bytes)} weights in {p.dtype} + {_gb(p.cache_bytes)} cache for {p.context} tokens)"
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
