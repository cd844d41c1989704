"""The one-token CPU step of a layer whose projections are all GGUF-packed, as one C call.

On the CPU, a small model's decode step spends as long in the dozen torch calls around its packed
GEMVs (norms, RoPE, the cache write, attention, residual adds, the activation) as in the GEMVs:
each call's dispatch costs microseconds and the tensors are a few hundred floats.
`gguf_cpu.FusedLayer` runs the whole layer in C instead. This module turns a layer's projections
into the kernel's terms and keeps the made layer with the layer's plan until its cache changes.

Families' EagerDecodeSteps call `cached_layer` with a function that builds their LayerSpec; where
the kernels do not run a layer (a float weight, another dtype or device, no extension) it returns
None and the torch steps run as before. DS4DESK_CPU_FUSED_DECODE=0 turns the path off (for
comparisons); `enabled` is what the steps read.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Protocol

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
