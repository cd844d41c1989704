"""Splitting a model's layers into contiguous shards, one per device, run as a pipeline.

A `ShardPlan` is placement data only: shard s owns layers bounds[s][0]..bounds[s][1]-1 (their
weights and caches) on devices[s]; the embedding lives with the first shard, the final norm and
the head with the last. The models read the plan in `place`; everything else (prefill, decode,
snapshots) runs the same ops in the same order, so a split never changes a logit.

The plan is either explicit (`--devices cuda:0,cuda:1 --layer-split 22,21`, checked by
`explicit_plan`) or automatic (`plan_split`, from each device's free memory).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ds4desk.engine.api import EngineFailure, ErrorCode

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _bad(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.BAD_REQUEST, detail)


@dataclass(slots=True, frozen=True)
class ShardPlan:
    devices: tuple[str, ...]  # one per shard, as torch spells them ("cpu", "cuda:1")
    layers: tuple[int, ...]  # how many consecutive layers each shard owns

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    @property
    def first(self) -> str:
        return self.devices[0]

    @property
    def last(self) -> str:
        return self.devices[-1]

    @property
    def multi_device(self) -> bool:
        """Shards on more than one device (several shards may share one, as the CPU tests do)."""
        return len(set(self.devices)) > 1

    def bounds(self) -> list[tuple[int, int]]:
        """(first layer, one past the last layer) of every shard."""
        out = []
        start = 0
        for count in self.layers:
            out.append((start, start + count))
            start += count
        return out

    def layer_devices(self) -> list[str]:
        """The device of every layer, in order."""
        return [device for device, count in zip(self.devices, self.layers, strict=True) for _ in range(count)]

    def device_of(self, name: str) -> str:
        """Where the parameter `name` (a state-dict name) lives: a layer's with its shard, the
        embedding with the first shard, anything after the layers (norm, head) with the last."""
        found = _LAYER.search(name)
        if found is not None:
            return self.layer_devices()[int(found[1])]
        return self.first if "embed_tokens" in name else self.last

    def describe(self) -> str:
        return ", ".join(f"{d}: {n} layers" for d, n in zip(self.devices, self.layers, strict=True))


def check_placement(plan: ShardPlan, num_layers: int, parameters: Iterable[Any]) -> None:
    """A model's place(plan): the plan must cover its layers, and come before any weight is real."""
    if plan.num_layers != num_layers:
        raise _bad(f"the layer split covers {plan.num_layers} layers; the model has {num_layers}")
    if any(not p.is_meta for p in parameters):
        raise RuntimeError("place() must come before materialize()")


def host_block(model: Any, device: Any, split: ShardPlan | None) -> Any:
    """One block of host memory (host_memory.HostBlock) sized for every parameter still on the meta
    device that goes to the CPU: `materialize_parameters` and the fused groups take from it."""
    from ds4desk.engine.host_memory import HostBlock

    return HostBlock(
        (param.shape, param.dtype)
        for where, _, _, param in _meta_parameters(model, device, split)
        if where.type == "cpu"
    )


def materialize_parameters(model: Any, device: Any, split: ShardPlan | None, block: Any = None) -> None:
    """Give every parameter still on the meta device real (uninitialised) storage, keeping its dtype:
    on `device`, or on the device the split puts it. The CPU's share comes from one block of host
    memory on huge pages (`block`, else a new one)."""
    import torch
    from torch import nn

    pending = list(_meta_parameters(model, device, split))
    if block is None:
        block = host_block(model, device, split)
    for where, module, name, param in pending:
        if where.type == "cpu":
            real = block.take(param.shape, param.dtype)
        else:
            real = torch.empty(param.shape, device=where, dtype=param.dtype)
        module._parameters[name] = nn.Parameter(real, requires_grad=False)


def _meta_parameters(model: Any, device: Any, split: ShardPlan | None) -> Iterable[tuple[Any, Any, str, Any]]:
    """(device, module, name, parameter) of each parameter still on the meta device."""
    import torch

    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                where = torch.device(device if split is None else split.device_of(f"{prefix}.{name}"))
                yield where, module, name, param


def single(device: str, num_layers: int) -> ShardPlan:
    return ShardPlan((device,), (num_layers,))


def parse_devices(text: str) -> tuple[str, ...]:
    """'cuda:0, cuda:1' -> ('cuda:0', 'cuda:1'); BAD_REQUEST for a word that is no device."""
    devices = tuple(word.strip().lower() for word in text.split(","))
    check_devices(devices)
    return devices


def parse_layer_split(text: str) -> tuple[int, ...]:
    """'22,21' -> (22, 21); BAD_REQUEST for anything but positive integers."""
    counts = []
    for word in text.split(","):
        word = word.strip()
        if not word.isdigit() or int(word) < 1:
            raise _bad(f"layer split '{text}' must list positive layer counts, like 22,21")
        counts.append(int(word))
    return tuple(counts)


def check_devices(devices: Sequence[str]) -> None:
    if not devices:
        raise _bad("a layer split needs at least one device")
    for device in devices:
        if not _DEVICE.match(device):
            raise _bad(f"'{device}' is not a device for a layer split: use cpu, cuda or cuda:N")


def explicit_plan(devices: Sequence[str], counts: Sequence[int], num_layers: int) -> ShardPlan:
    """Check a user's split of `num_layers` layers over `devices` (BAD_REQUEST says what is wrong)."""
    devices = tuple(devices)
    check_devices(devices)
    if len(counts) != len(devices):
        raise _bad(
            f"the layer split lists {len(counts)} counts for {len(devices)} devices: give one per device"
        )
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise _bad(f"every shard needs at least one layer; the layer split has {count!r}")
    if sum(counts) != num_layers:
        raise _bad(
            f"the layer split {','.join(map(str, counts))} covers {sum(counts)} layers; "
            f"the model has {num_layers}"
        )
    return ShardPlan(devices, tuple(counts))


def plan_split(
    layer_bytes: Sequence[int],
    fixed_first: int,
    fixed_last: int,
    free_per_device: Sequence[int],
) -> tuple[int, ...]:
    """Layers per device for a contiguous split that fits: `layer_bytes[i]` is what layer i takes
    (weights and cache), `fixed_first` what the first device holds besides its layers (the
    embedding), `fixed_last` the last one's (norm and head). Among the splits that fit it picks the
    one whose fullest device is least full (relative to its free memory): on equal devices, the
    one most even in bytes. BAD_REQUEST when there are more devices than layers, OUT_OF_MEMORY when
    no split fits."""
    layers, devices = len(layer_bytes), len(free_per_device)
    if devices < 1:
        raise _bad("a layer split needs at least one device")
    if layers < devices:
        raise _bad(f"{devices} devices need at least {devices} layers; the model has {layers}")
    if any(b < 0 for b in layer_bytes) or fixed_first < 0 or fixed_last < 0:
        raise ValueError("byte counts must not be negative")
    prefix = [0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)

    def load(shard: int, start: int, stop: int) -> float:
        total = prefix[stop] - prefix[start]
        total += fixed_first if shard == 0 else 0
        total += fixed_last if shard == devices - 1 else 0
        free = free_per_device[shard]
        return total / free if free > 0 else float("inf")

    # best[s][i]: (the least fullest-device load, the cut) of putting layers 0..i-1 on devices 0..s.
    inf = float("inf")
    best = [[(inf, 0)] * (layers + 1) for _ in range(devices)]
    for stop in range(1, layers - devices + 2):
        best[0][stop] = (load(0, 0, stop), 0)
    for shard in range(1, devices):
        for stop in range(shard + 1, layers - (devices - shard - 1) + 1):
            options = (
                (max(best[shard - 1][cut][0], load(shard, cut, stop)), cut) for cut in range(shard, stop)
            )
            best[shard][stop] = min(options)
    worst, _ = best[devices - 1][layers]
    if worst > 1.0:
        need = prefix[-1] + fixed_first + fixed_last
        raise EngineFailure(
            ErrorCode.OUT_OF_MEMORY,
            f"the model needs {need / 2**30:.1f} GiB; no split of its {layers} layers fits the free memory "
            f"of the {devices} devices ({', '.join(f'{f / 2**30:.1f}' for f in free_per_device)} GiB)",
        )
    counts = []
    stop = layers
    for shard in range(devices - 1, -1, -1):
        cut = best[shard][stop][1] if shard else 0
        counts.append(stop - cut)
        stop = cut
    return tuple(reversed(counts))


def layer_index(name: str) -> int | None:
    """The layer a parameter name belongs to, None for the embedding, norm and head."""
    found = _LAYER.search(name)
    return None if found is None else int(found[1])


class _SizedModel(Protocol):
    def named_parameters(self) -> Any: ...

    def layer_cache_bytes_for(self, context: int) -> list[int]: ...


def model_bytes(model: _SizedModel, context: int) -> tuple[list[int], int, int]:
    """What a (meta) model takes where a split puts it: per layer its weights plus its cache for
    `context`, then the first shard's extra (the embedding) and the last one's (norm and head; a
    tied head is copied there, so it counts again)."""
    layer_cache = model.layer_cache_bytes_for(context)
    layers = list(layer_cache)
    first = last = 0
    seen: set[int] = set()
    tied = None
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        index = layer_index(name)
        if index is not None:
            layers[index] += size
        elif "embed_tokens" in name:
            first += size
            tied = size
        else:
            last += size
    if tied is not None and not any("lm_head" in name for name, _ in model.named_parameters()):
        last += tied
    return layers, first, last


def needed_per_device(plan: ShardPlan, layers: Sequence[int], first: int, last: int) -> dict[str, int]:
    """Bytes each device of `plan` takes (shards sharing a device add up)."""
    needed: dict[str, int] = {}
    for shard, ((start, stop), device) in enumerate(zip(plan.bounds(), plan.devices, strict=True)):
        total = sum(layers[start:stop])
        total += first if shard == 0 else 0
        total += last if shard == len(plan.devices) - 1 else 0
        needed[device] = needed.get(device, 0) + total
    return needed


def plan_for(
    devices: Sequence[str],
    layer_split: Sequence[int] | None,
    model: _SizedModel,
    context: int,
    free_of: Callable[[str], int],
) -> tuple[ShardPlan, dict[str, int]]:
    """The plan for a load request: the explicit split checked, or one planned from `free_of`
    (free bytes per device; shards sharing a device share its memory). Returns it with the bytes
    each device will take."""
    layers, first, last = model_bytes(model, context)
    devices = tuple(devices)
    if layer_split is not None:
        plan = explicit_plan(devices, tuple(layer_split), len(layers))
    else:
        check_devices(devices)
        free = [free_of(d) // devices.count(d) for d in devices]
        plan = ShardPlan(devices, plan_split(layers, first, last, free))
    return plan, needed_per_device(plan, layers, first, last)
