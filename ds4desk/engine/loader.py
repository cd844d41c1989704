"""Loading a model from a ModelSource onto a device.

The module is built on the meta device (no memory), every expected tensor is checked against the
checkpoint's header before a byte is read, then the parameters get real storage and each tensor
is copied straight from the mmapped file into its parameter: the model never exists twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.quantized import ShardReader, copy_packed_into, copy_tensor_into
from ds4desk.engine.loading.source import ModelSource, TensorEntry
from ds4desk.engine.models.base import CausalLM, load_failure
from ds4desk.engine.models.registry import ARCHITECTURES, build_model, family_for
from ds4desk.engine.split import ShardPlan


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    family: str
    parameters: int
    weight_bytes: int


# None: keep a DeepSeek-V4 checkpoint's FP8 / FP4 weights packed where keeps_quantized finds it pays;
# True / False force it (tests run the packed path on the CPU, whose kernels dequantize on the fly).
KEEP_QUANTIZED: bool | None = None


def keeps_quantized(source: ModelSource, devices: list[torch.device]) -> bool:
    """Whether `source`'s FP8 linears and packed FP4 experts stay as stored on `devices`: on NVIDIA
    GPUs from Hopper on, where FP8 matrix units run prefill and a decode step reads a quarter of
    bf16's expert bytes (and where full-size Flash only fits that way). Elsewhere they are
    dequantized at load. Only a checkpoint whose every weight the quantized model keeps packed is
    stored packed qualifies (an `--expert-dtype fp8` conversion does not)."""
    if ARCHITECTURES.get(source.architecture, ("", ""))[0] != "deepseek_v4":
        return False
    model = build_model(source.architecture, source.config, torch.bfloat16, True)
    for name, meta in model.named_parameters():
        if _is_scale(name, meta):
            continue
        want = {torch.float8_e4m3fn: "fp8_block128", torch.uint8: "fp4_block32"}.get(meta.dtype)
        entry = source.tensors.get(name)
        if want is not None and (entry is None or entry.encoding != want):
            return False
    if KEEP_QUANTIZED is not None:
        return KEEP_QUANTIZED
    return all(
        d.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(d) >= (9, 0)
        for d in devices
    )


def _is_scale(name: str, meta: torch.Tensor) -> bool:
    """A quantized weight's scale: loaded with its weight, not a checkpoint tensor of its own."""
    return name.endswith("weight_scale_inv") or (meta.dtype == torch.uint8 and name.endswith("_scale"))


def _scale_of(name: str, params: dict[str, nn.Parameter]) -> nn.Parameter:
    if params[name].dtype == torch.float8_e4m3fn:
        return params[name.removesuffix("weight") + "weight_scale_inv"]
    return params[name + "_scale"]


# safetensors dtypes that are plain floating point; anything else needs a dequantising path.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT_DTYPES = {"I64", "I32", "I16", "U8", "I8"}
_PACKED = (torch.float8_e4m3fn, torch.uint8)  # parameters a quantized model keeps as stored


def check_tensors(
    source: ModelSource, dtype: torch.dtype = torch.float32, quantized: bool = False
) -> tuple[CausalLM, dict[Path, list[str]]]:
    """Build `source`'s model on the meta device (`quantized`: keeping FP8 / FP4 weights packed, see
    keeps_quantized) and check every tensor it needs against the headers (name, shape, dtype) before
    any memory is taken. Returns the meta model and, per file, the names to read from it."""
    model = build_model(source.architecture, source.config, dtype, quantized)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, meta in model.named_parameters():
        if _is_scale(name, meta):
            continue
        entry = source.tensors.get(name)
        if entry is None:
            raise load_failure(f"checkpoint has no tensor '{name}'")
        packed = meta.dtype == torch.uint8  # FP4 pairs: the logical rows are twice as long
        logical = (*meta.shape[:-1], 2 * meta.shape[-1]) if packed else tuple(meta.shape)
        if tuple(entry.shape) != logical:
            raise load_failure(f"tensor {name} has shape {list(entry.shape)}, config says {list(logical)}")
        # Quantized (or multi-part) entries are decoded by loading.quantized, which checks them.
        stored_ok = entry.encoding != "plain" or entry.parts or entry.dtype in _FLOAT_DTYPES
        if packed:
            stored_ok = entry.encoding == "fp4_block32"
        elif meta.dtype == torch.float8_e4m3fn:
            stored_ok = entry.encoding == "fp8_block128"
        elif not meta.is_floating_point():  # an integer table (DeepSeek-V4's tid2eid)
            stored_ok = entry.encoding == "plain" and entry.dtype in _INT_DTYPES
        if not stored_ok:
            raise load_failure(
                f"tensor {name} has dtype {entry.dtype}; this family loads {sorted(_FLOAT_DTYPES)}"
            )
        by_file[Path(entry.file)].append(name)
    return model, by_file


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
    split: ShardPlan | None = None,
    quantized: bool = False,
) -> LoadedModel:
    """Build the model for `source` and fill it from its safetensors files on `device` in `dtype`
    (or, with `split`, each layer on its shard's device; see ds4desk.engine.split).
    `progress(done, total)` runs after each tensor; an exception it raises stops the load there."""
    family = family_for(source.architecture)
    model, by_file = check_tensors(source, dtype, quantized)
    total = sum(len(names) for names in by_file.values())
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if split is not None:
        model.place(split)
    try:
        model.materialize(device)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for file, names in by_file.items():
                _copy_from_file(file, names, params, source.tensors, tick)
        model.finish_loading()
    except torch.OutOfMemoryError as exc:
        where = device if split is None else ", ".join(split.devices)
        raise EngineFailure(ErrorCode.OUT_OF_MEMORY, f"loading the weights onto {where}: {exc}") from exc

    left = [name for name, t in _tensors(model) if t.is_meta]
    if left:
        raise load_failure(f"internal: tensors left on the meta device after loading: {', '.join(left[:5])}")

    unique = {id(p): p for _, p in model.named_parameters()}.values()
    return LoadedModel(
        model=model,
        family=family,
        parameters=sum(p.numel() for p in unique),
        weight_bytes=sum(p.numel() * p.element_size() for p in unique),
    )


def _copy_from_file(
    file: Path,
    names: list[str],
    params: dict[str, nn.Parameter],
    tensors: dict[str, TensorEntry] | None = None,
    after_each: Callable[[], None] | None = None,
) -> None:
    tensors = tensors or {}
    try:
        # safe_open mmaps the file: get_tensor reads one tensor, which copy_ converts to the
        # parameter's device and dtype; only one tensor is ever held twice.
        with safe_open(str(file), framework="pt", device="cpu") as handle, ShardReader() as reader:
            for name in names:
                entry = tensors.get(name)
                target = params[name]
                if entry is not None and entry.encoding != "plain" and target.dtype in _PACKED:
                    copy_packed_into(reader, name, entry, target, _scale_of(name, params))
                elif entry is not None and (
                    entry.key is not None or entry.parts or entry.encoding != "plain"
                ):
                    # Renamed, quantized or split (official DeepSeek layout): decoded one tensor at a time.
                    copy_tensor_into(reader, name, entry, params[name])
                else:
                    params[name].copy_(handle.get_tensor(name))
                if after_each is not None:
                    after_each()
    except (torch.OutOfMemoryError, EngineFailure):
        raise
    except (OSError, RuntimeError, ValueError, TypeError) as exc:
        raise load_failure(f"reading {file.name}: {exc}") from exc
    except Exception as exc:  # safetensors raises its own SafetensorError type
        raise load_failure(f"reading {file.name}: {type(exc).__name__}: {exc}") from exc


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]
