"""The one-token CPU step of a layer whose projections are all GGUF-packed, as one C call.

On the CPU, a small model's decode step spends as long in the dozen torch calls around its packed
GEMVs (norms, RoPE, the cache write, attention, residual adds, the activation) as in the GEMVs:
each call's dispatch costs microseconds and the tensors are a few hundred floats.
`gguf_cpu.FusedLayer` runs the whole layer in C instead. This module turns a layer's projections
into the kernel's terms and keeps the made layer with the layer's plan until its cache changes.

Families' EagerDecodeSteps hand each layer to a `FusedShard`, with a function that builds the
layer's LayerSpec; where the kernels do not run a layer (a float weight, another dtype or device, no
extension) the torch steps run it as before. DS4DESK_CPU_FUSED_DECODE=0 turns the path off (for
comparisons); `enabled` is what the steps read.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.engine.models.packed import Projection

enabled = os.environ.get("DS4DESK_CPU_FUSED_DECODE", "1") != "0"


class _Unfit:
    """A layer the kernels do not run, remembered for the cache it was tried with (weakly)."""

    __slots__ = ("_cache",)

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._cache = weakref.ref(kv_cache)

    def reads(
        self, kv_cache: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> bool:
        return self._cache() is kv_cache


class _HasSlot(Protocol):
    kv_cache: torch.Tensor | None
    cpu_layer: object | None  # what cached_layer keeps there


def cached_layer(
    plan: _HasSlot, cos: torch.Tensor, sin: torch.Tensor, make: Callable[[], gguf_cpu.LayerSpec | None]
) -> gguf_cpu.FusedLayer | None:
    """The plan's fused layer for its current cache and tables (made by `make` the first time, and
    again after the cache was reallocated), or None where the kernels do not run it."""
    slot = plan.cpu_layer
    if isinstance(slot, (gguf_cpu.FusedLayer, _Unfit)) and slot.reads(plan.kv_cache, cos, sin):
        return slot if isinstance(slot, gguf_cpu.FusedLayer) else None
    assert plan.kv_cache is not None
    spec = make() if gguf_cpu.available() else None
    fused = gguf_cpu.fused_layer(spec) if spec is not None else None
    plan.cpu_layer = fused if fused is not None else _Unfit(plan.kv_cache)
    return fused


class FusedShard:
    """A step's layers of one shard on the fused path, for one token or a few (up to
    gguf_cpu.MAX_TOKENS: a verify step of speculative decoding, a short prompt). The shard's first
    layer runs every layer in one C call (the threads wake once a step, not once a layer) and the
    later layers' calls return x; where some layer is unfit, each fit layer runs alone and the others
    on torch."""

    def __init__(
        self, plans: Sequence[_HasSlot], fused_for: Callable[[Any], gguf_cpu.FusedLayer | None], pos: int
    ) -> None:
        self.plans, self.fused_for, self.pos = plans, fused_for, pos
        self.threads = torch.get_num_threads()
        self.residual: torch.Tensor | None = None  # the fused path's own copy of x, updated in place
        self.ran_shard = False

    def layer(self, x: torch.Tensor, plan: _HasSlot, torch_layer: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.ran_shard:
            return x
        if plan is self.plans[0]:
            layers = [self.fused_for(p) for p in self.plans]
            if all(layer is not None for layer in layers):
                x = self.residual = x.contiguous().clone()  # never update the caller's tensor
                gguf_cpu.decode_layers(layers, x, self.pos, self.threads)  # type: ignore[arg-type]
                self.ran_shard = True
                return x
        fused = self.fused_for(plan)
        if fused is None:
            return torch_layer()
        if x is not self.residual:
            x = self.residual = x.contiguous().clone()
        fused(x, self.pos, self.threads)
        return x


def packed_projection(projection: Projection) -> gguf_cpu.FusedProjection | None:
    """The projection's packed parts and bias in the kernel's terms; None for a float weight."""
    parts = projection.parts or (projection,)
    if any(p.packed is None or p.parts for p in parts):
        return None
    packed = tuple(gguf_cpu.PackedPart(p.packed, p.type_id, p.cols) for p in parts)  # type: ignore[arg-type]
    biases = [p.bias for p in parts]
    if projection.parts:
        if all(b is None for b in biases):
            bias = None
        else:  # one bias for the side-by-side output: zeros where a part has none
            bias = torch.cat(
                [
                    b if b is not None else torch.zeros(p.rows, dtype=torch.float32)
                    for p, b in zip(parts, biases, strict=True)
                ]
            )
    else:
        bias = projection.bias
    return gguf_cpu.FusedProjection(packed, bias)


def packed_projections(*projections: Projection) -> list[gguf_cpu.FusedProjection] | None:
    """Every projection's packed form, or None if any one is not packed."""
    out = [packed_projection(p) for p in projections]
    return None if any(p is None for p in out) else out  # type: ignore[return-value]
