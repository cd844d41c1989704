"""The load sequence: plan once on one meta model, then fill that same model from the files.

`plan_load` builds the model on the meta device (no memory) exactly once and decides everything a
load needs before a byte is read or the current model is let go: whether FP8 / FP4 weights stay
packed, every expected tensor checked against the checkpoint's headers, the memory the weights and
the cache take, and the layer split over several devices. `fill` then gives the planned model real
storage and copies each tensor straight from the mmapped file into its parameter: the model never
exists twice. The engine thread, the window's preview (`preflight`) and `ds4desk check` all plan
through here, so they agree on what a load takes.
"""

from __future__ import annotations

import math
import mmap
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ds4desk.engine.api import EngineFailure, ErrorCode, LoadRequest
from ds4desk.engine.devices import free_memory_bytes, resolve_device, resolve_dtype
from ds4desk.engine.formats import gguf_packed_bytes, gguf_type
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.kernels.quant.gguf_quantize import quantize
from ds4desk.engine.loading.gguf_source import packed_types, rope_row_order
from ds4desk.engine.loading.quantized import ShardReader, copy_packed_into, copy_tensor_into
from ds4desk.engine.loading.source import ModelSource, TensorEntry
from ds4desk.engine.models.base import CausalLM, load_failure
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear, parameter_count
from ds4desk.engine.models.registry import ARCHITECTURES, build_model, family_for
from ds4desk.engine.split import ShardPlan, check_devices, plan_for


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    family: str
    parameters: int
    weight_bytes: int


@dataclass(slots=True)
class MemoryNeed:
    """What a model takes on one device, before it is loaded."""

    parameters: int
    weight_bytes: int
    cache_bytes: int
    context: int  # the asked-for context, clamped to the model's maximum

    @property
    def needed(self) -> int:
        return self.weight_bytes + self.cache_bytes


@dataclass(slots=True)
class LoadPlan:
    """Everything decided before the load takes memory; `fill` carries it out."""

    source: ModelSource
    family: str
    model: CausalLM  # on the meta device, already placed when split
    device: torch.device  # the first shard's device (every layer's, unsplit)
    dtype: torch.dtype
    quantized: bool  # FP8 / FP4 weights stay packed (see keeps_quantized)
    requantized: dict[str, int]  # float weights quantized while loading (`weights` q8 / q4): name -> type
    memory: MemoryNeed
    split: ShardPlan | None
    needs: dict[str, int]  # bytes each device takes (str(device) -> bytes)
    by_file: dict[Path, list[str]]  # the tensors to read from each file

    @property
    def context(self) -> int:
        return self.memory.context

    @property
    def devices_text(self) -> str:
        """Where the model runs, as ModelInfo shows it: "cuda:0", or "cuda:0,cuda:1" for a split."""
        return str(self.device) if self.split is None else ",".join(self.split.devices)


# None: keep a DeepSeek-V4 checkpoint's FP8 / FP4 weights packed where keeps_quantized finds it pays;
# True / False force it (tests run the packed path on the CPU, whose kernels dequantize on the fly).
KEEP_QUANTIZED: bool | None = None


# ---- where: the request's device words as torch objects -------------------------------------------


def resolve_placement(request: LoadRequest) -> tuple[torch.device, torch.dtype, tuple[str, ...] | None]:
    """(first device, dtype, the resolved devices of a layer split or None) for a load request;
    BAD_REQUEST for a split device that does not exist, LOAD_FAILED for an unknown device or dtype."""
    split_devices = _split_devices(request)
    device = resolve_device(request.device) if split_devices is None else torch.device(split_devices[0])
    return device, resolve_dtype(request.dtype, device), split_devices


def _split_devices(request: LoadRequest) -> tuple[str, ...] | None:
    if request.devices is None:
        if request.layer_split is not None:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "a layer split needs the devices it splits over")
        return None
    words = tuple(word.strip().lower() for word in request.devices)
    check_devices(words)
    resolved = []
    for word in words:
        try:
            resolved.append(str(resolve_device(word)))
        except EngineFailure as failure:
            raise EngineFailure(ErrorCode.BAD_REQUEST, failure.error.detail) from None
    return tuple(resolved)


# ---- the plan -------------------------------------------------------------------------------------


def plan_load(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    context: int,
    split_devices: Sequence[str] | None = None,
    layer_split: Sequence[int] | None = None,
    free_of: Callable[[str], int] | None = None,
    weights: str = "as-stored",
) -> LoadPlan:
    """The plan for loading `source` on `device` in `dtype` with a `context`-token cache, or split
    over `split_devices` (`layer_split` layers each, else planned from `free_of(device)`, the free
    bytes of a device). `weights` "q8" / "q4" quantizes a float checkpoint's 2-D weights to GGUF
    block types while loading (see requantize_types). Builds the meta model once (twice only where
    the quantized build turns out not to match the checkpoint) and checks every tensor's name, shape
    and dtype: LOAD_FAILED, BAD_REQUEST (a split that does not fit the model) or OUT_OF_MEMORY (no
    split fits) otherwise."""
    family = family_for(source.architecture)
    devices = [device] if split_devices is None else [torch.device(d) for d in split_devices]
    requantized = requantize_types(source, weights)
    model, quantized = _build_for(source, dtype, devices, requantized)
    by_file = _check_against(model, source, requantized)
    memory = _memory_need(source, model, dtype, quantized, context)
    split = None
    needs = {str(device): memory.needed}
    if split_devices is not None:
        free = free_of or (lambda name: free_memory_bytes(torch.device(name)))
        split, needs = plan_for(split_devices, layer_split, model, memory.context, free)
        model.place(split)
    return LoadPlan(
        source, family, model, device, dtype, quantized, requantized, memory, split, needs, by_file
    )


def clamp_context(config: dict[str, Any], context: int) -> int:
    # Vision-language checkpoints (Qwen3.5's published ones) keep the text model's limit inside.
    text = config.get("text_config")
    inner = text.get("max_position_embeddings") if isinstance(text, dict) else None
    limit = config.get("max_position_embeddings") or inner
    return min(context, limit) if type(limit) is int and limit > 0 else context


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _memory_need(
    source: ModelSource, model: CausalLM, dtype: torch.dtype, quantized: bool, context: int
) -> MemoryNeed:
    """The weights in `dtype` (packed: as the packed parameters take them) and the cache for `context`."""
    parameters = sum(math.prod(entry.shape) for entry in source.tensors.values())
    weight_bytes = parameters * dtype_bytes(dtype)
    if quantized or source.is_gguf or model_has_packed(model):
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    context = clamp_context(source.config, context)
    return MemoryNeed(parameters, weight_bytes, model.cache_bytes_for(context), context)


def requantize_types(source: ModelSource, weights: str) -> dict[str, int]:
    """The float weights `weights` ("q8" / "q4") asks to quantize while loading: name -> GGML type.
    Every 2-D float weight of the dense families whose rows are whole blocks: q8 puts all of them in
    Q8_0; q4 puts the linears in Q4_K (256-value blocks) and keeps the embedding and head in Q8_0,
    where 4 bits cost the most quality. A GGUF stays as stored, and DeepSeek-V4 keeps its own
    FP8 / FP4 packing. "as-stored": nothing."""
    if weights == "as-stored" or source.is_gguf or family_for(source.architecture) == "deepseek_v4":
        return {}
    wanted: dict[str, int] = {}
    for name, entry in source.tensors.items():
        if len(entry.shape) != 2 or entry.encoding != "plain" or entry.dtype not in _FLOAT_DTYPES:
            continue
        kind = Q4_K if weights == "q4" and not name.endswith(_KEEP_8_BIT) else Q8_0
        if entry.shape[1] % gguf_type(kind).block_values == 0:
            wanted[name] = kind
        elif entry.shape[1] % gguf_type(Q8_0).block_values == 0:
            wanted[name] = Q8_0
    return wanted


def model_has_packed(model: CausalLM) -> bool:
    return any(isinstance(m, (PackedLinear, PackedEmbedding)) for m in model.modules())


def _build_for(
    source: ModelSource, dtype: torch.dtype, devices: list[torch.device], requantized: dict[str, int]
) -> tuple[CausalLM, bool]:
    """The meta model and whether it keeps the checkpoint's FP8 / FP4 weights packed. A GGUF's
    quantized weights always stay in their block types; `requantized` weights get theirs."""
    if source.is_gguf or requantized:
        packed = packed_types(source) if source.is_gguf else requantized
        return build_model(source.architecture, source.config, dtype, packed=packed), False
    if _packing_pays(source, devices):
        packed = build_model(source.architecture, source.config, dtype, True)
        if _stored_packed(packed, source):
            return packed, True
    return build_model(source.architecture, source.config, dtype, False), False


def keeps_quantized(source: ModelSource, devices: list[torch.device]) -> bool:
    """Whether `source`'s FP8 linears and packed FP4 experts stay as stored on `devices`: on NVIDIA
    GPUs from Hopper on, where FP8 matrix units run prefill and a decode step reads a quarter of
    bf16's expert bytes (and where full-size Flash only fits that way). Elsewhere they are
    dequantized at load. Only a checkpoint whose every weight the quantized model keeps packed is
    stored packed qualifies (an `--expert-dtype fp8` conversion does not)."""
    if not _packing_pays(source, devices):
        return False
    return _stored_packed(build_model(source.architecture, source.config, torch.bfloat16, True), source)


def _packing_pays(source: ModelSource, devices: list[torch.device]) -> bool:
    """The family can keep weights packed and the devices (or KEEP_QUANTIZED) want it."""
    if ARCHITECTURES.get(source.architecture, ("", ""))[0] != "deepseek_v4":
        return False
    if KEEP_QUANTIZED is not None:
        return KEEP_QUANTIZED
    return all(_runs_fp8(d) for d in devices)


def _runs_fp8(device: torch.device) -> bool:
    # is_available first: `ds4desk check --devices cuda:0,cuda:1` plans on machines without a GPU.
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def _stored_packed(model: CausalLM, source: ModelSource) -> bool:
    """Every parameter the quantized `model` keeps packed is stored packed in the checkpoint."""
    for name, meta in model.named_parameters():
        if _is_scale(name, meta):
            continue
        want = {torch.float8_e4m3fn: "fp8_block128", torch.uint8: "fp4_block32"}.get(meta.dtype)
        entry = source.tensors.get(name)
        if want is not None and (entry is None or entry.encoding != want):
            return False
    return True


def _is_scale(name: str, meta: torch.Tensor) -> bool:
    """A quantized weight's scale: loaded with its weight, not a checkpoint tensor of its own."""
    return name.endswith("weight_scale_inv") or (meta.dtype == torch.uint8 and name.endswith("_scale"))


def _scale_of(name: str, params: dict[str, nn.Parameter]) -> nn.Parameter:
    if params[name].dtype == torch.float8_e4m3fn:
        return params[name.removesuffix("weight") + "weight_scale_inv"]
    return params[name + "_scale"]


Q8_0, Q4_K = 8, 12  # GGML type ids of the block types `weights` q8 / q4 quantize to
_KEEP_8_BIT = ("embed_tokens.weight", "lm_head.weight")

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
    packed = packed_types(source) if source.is_gguf else None
    model = build_model(source.architecture, source.config, dtype, quantized, packed)
    return model, _check_against(model, source)


def _check_against(
    model: CausalLM, source: ModelSource, requantized: Mapping[str, int] | None = None
) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, meta in model.named_parameters():
        if _is_scale(name, meta):
            continue
        entry = source.tensors.get(name)
        if entry is None:
            raise load_failure(source.missing_tensor(name))
        if requantized and name in requantized:  # chosen from these very entries: float, 2-D
            by_file[Path(entry.file)].append(name)
            continue
        if entry.encoding == "gguf":
            _check_gguf(name, meta, entry)
            by_file[Path(entry.file)].append(name)
            continue
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
    return by_file


def _check_gguf(name: str, meta: torch.Tensor, entry: TensorEntry) -> None:
    """A GGUF tensor for `meta`: its GGUF blocks as they are (a packed parameter), or any stored type
    read as floats (dequantized while copying)."""
    if meta.dtype == torch.uint8:
        expected = (
            *entry.shape[:-1],
            gguf_packed_bytes(entry.gguf_type, entry.shape) // max(1, math.prod(entry.shape[:-1])),
        )
        if tuple(meta.shape) != expected:
            raise load_failure(
                f"tensor {name} is {entry.dtype} {list(entry.shape)}, which does not fit the model"
            )
    elif tuple(meta.shape) != tuple(entry.shape):
        raise load_failure(f"tensor {name} has shape {list(entry.shape)}, config says {list(meta.shape)}")
    elif meta.is_floating_point() == (entry.dtype == "I32"):  # I32: DeepSeek-V4's hash-routing tables
        raise load_failure(f"tensor {name}: the model wants {meta.dtype}, the file holds {entry.dtype}")


# ---- the fill -------------------------------------------------------------------------------------


def fill(plan: LoadPlan, progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Give the planned model real storage and copy the checkpoint into it: the loaded model.
    `progress(done, total)` runs after each tensor; an exception it raises stops the load there."""
    return _fill(plan.source, plan.model, plan.by_file, plan.device, plan.split, progress, plan.requantized)


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
    split: ShardPlan | None = None,
    quantized: bool = False,
) -> LoadedModel:
    """`source` on `device` in `dtype` (or, with `split`, each layer on its shard's device), packed
    only when `quantized` says so: no planning, for tests and benchmarks that choose for themselves."""
    model, by_file = check_tensors(source, dtype, quantized)
    if split is not None:
        model.place(split)
    return _fill(source, model, by_file, device, split, progress)


def _fill(
    source: ModelSource,
    model: CausalLM,
    by_file: dict[Path, list[str]],
    device: torch.device,
    split: ShardPlan | None,
    progress: Callable[[int, int], None] | None,
    requantized: Mapping[str, int] | None = None,
) -> LoadedModel:
    family = family_for(source.architecture)
    total = sum(len(names) for names in by_file.values())
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    try:
        model.materialize(device)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for file, names in by_file.items():
                _copy_from_file(file, names, params, source.tensors, tick, requantized)
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
        parameters=parameter_count(model),
        weight_bytes=sum(p.numel() * p.element_size() for p in unique),
    )


def _copy_from_file(
    file: Path,
    names: list[str],
    params: dict[str, nn.Parameter],
    tensors: dict[str, TensorEntry] | None = None,
    after_each: Callable[[], None] | None = None,
    requantized: Mapping[str, int] | None = None,
) -> None:
    tensors = tensors or {}
    requantized = requantized or {}
    if names and tensors.get(names[0]) is not None and tensors[names[0]].encoding == "gguf":
        _copy_from_gguf(file, names, params, tensors, after_each)
        return
    try:
        # safe_open mmaps the file: get_tensor reads one tensor, which copy_ converts to the
        # parameter's device and dtype; only one tensor is ever held twice.
        with safe_open(str(file), framework="pt", device="cpu") as handle, ShardReader() as reader:
            for name in names:
                entry = tensors.get(name)
                target = params[name]
                if name in requantized:
                    # Quantized where it goes: the float weight crosses the bus once, then only blocks.
                    weight = handle.get_tensor(name).to(target.device)
                    target.copy_(quantize(weight, requantized[name]))
                    del weight
                elif entry is not None and entry.encoding != "plain" and target.dtype in _PACKED:
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


def _copy_from_gguf(
    file: Path,
    names: list[str],
    params: dict[str, nn.Parameter],
    tensors: dict[str, TensorEntry],
    after_each: Callable[[], None] | None,
) -> None:
    """Copy GGUF tensors from the memory-mapped file: packed parameters take the blocks as stored
    (rows reordered where rope needs it), float ones the values. A private copy-on-write map gives
    torch writable memory without copying anything."""
    try:
        with file.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            if len(mapped) < max(tensors[name].end for name in names):
                raise load_failure(f"{file.name} is shorter than its header says: it changed or was cut")
            data = torch.frombuffer(mapped, dtype=torch.uint8)
            for name in names:
                entry = tensors[name]
                target = params[name]
                raw = data[entry.begin : entry.end]
                if target.dtype == torch.uint8:
                    if entry.columns is not None:  # blocks run along the whole stored row
                        raise load_failure(f"tensor {name} is part of a stored matrix; it cannot stay packed")
                    stored = raw.view(target.shape)
                else:
                    stored = gguf_entry_values(raw, entry)
                    if entry.shift:  # (1 + w) -> w in float32, before the one rounding to the dtype
                        stored = stored.float() + entry.shift
                    stored = stored.to(target.dtype)
                if entry.rope_heads:
                    order = torch.from_numpy(rope_row_order(entry.shape[0], entry.rope_heads))
                    stored = stored.index_select(0, order)
                target.copy_(stored)
                del stored, raw
                if after_each is not None:
                    after_each()
            del data
    except (torch.OutOfMemoryError, EngineFailure):
        raise
    except (OSError, RuntimeError, ValueError) as exc:
        raise load_failure(f"reading {file.name}: {exc}") from exc


def gguf_entry_values(raw: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """A GGUF tensor's values in its logical shape: plain types as stored, block types dequantized."""
    plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32}
    plain_dtype = plain.get(entry.dtype)
    shape = entry.shape if entry.columns is None else (entry.shape[0], entry.columns[1])
    if plain_dtype is not None:
        values = raw.view(plain_dtype).view(shape)
    else:
        values = gguf.dequantize(raw, entry.gguf_type, shape)
    if entry.columns is None:
        return values
    first = entry.columns[0]
    return values[:, first : first + entry.shape[1]]


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]
