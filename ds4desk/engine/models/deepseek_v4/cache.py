"""DeepSeek-V4's cache: plain tensors allocated once for the context, and what they take.

Per layer a W-slot raw ring (position p in slot p mod W), and for CSA / HCA layers the compressed
rows (one per `rate` positions), the indexer's rows (CSA) and the compressors' carried state: the
open window's projections, so a window can close in a later call than the one that opened it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4desk.engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

# Rope kind ("main": sliding layers, "compress": CSA / HCA layers) -> its (cos, sin) tables
# [context, rotated dims / 2], float32, built with the cache.
RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class CompressorState:
    """What a compressor carries between calls (float32, as the reference pools)."""

    kv: torch.Tensor  # [rate, width]: the open window's projections, row = position mod rate
    gate: torch.Tensor  # [rate, width]: their gates, position bias included
    prev_kv: torch.Tensor | None  # CSA: [rate, dim], the last closed window's first-half kv
    prev_gate: torch.Tensor | None  # CSA: its first-half gates (bias included)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kv, self.gate, self.prev_kv, self.prev_gate) if t is not None]


@dataclass(slots=True)
class LayerState:
    """One layer's part of the cache (the optional parts only in CSA / HCA layers)."""

    ring: torch.Tensor  # [window, head_dim]: raw K=V rows, position p in row p mod window
    entries: torch.Tensor | None  # [context // rate, head_dim]: compressed rows (CSA / HCA)
    compressor: CompressorState | None
    index_entries: torch.Tensor | None  # [context // rate, index_head_dim]: indexer keys (CSA)
    indexer: CompressorState | None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.ring]
        for part in (self.entries, self.index_entries):
            if part is not None:
                out.append(part)
        for state in (self.compressor, self.indexer):
            if state is not None:
                out.extend(state.tensors())
        return out


@dataclass(slots=True)
class V4Cache:
    """Every tensor a continuation needs, plus `length`: the positions 0..length-1 it holds."""

    layers: list[LayerState]
    length: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _compressor_state(
    rate: int, width: int, dim: int, overlap: bool, device: torch.device
) -> CompressorState:
    def zeros(cols: int) -> torch.Tensor:
        return torch.zeros((rate, cols), device=device, dtype=torch.float32)

    return CompressorState(
        kv=zeros(width),
        gate=zeros(width),
        prev_kv=zeros(dim) if overlap else None,
        prev_gate=zeros(dim) if overlap else None,
    )


def new_layer_state(
    cfg: DeepseekV4Config, layer_type: str, context: int, dtype: torch.dtype, device: torch.device
) -> LayerState:
    """One layer's state for `context` positions on its shard's `device`, zeroed, so no stale NaN
    can ever meet a zero softmax weight."""
    ring = torch.zeros((cfg.sliding_window, cfg.head_dim), device=device, dtype=dtype)
    state = LayerState(ring, None, None, None, None)
    if layer_type != SLIDING:
        rate = cfg.rate(layer_type)
        overlap = layer_type == CSA
        rows = context // rate
        width = (2 if overlap else 1) * cfg.head_dim
        state.entries = torch.zeros((rows, cfg.head_dim), device=device, dtype=dtype)
        state.compressor = _compressor_state(rate, width, cfg.head_dim, overlap, device)
        if overlap:
            state.index_entries = torch.zeros((rows, cfg.index_head_dim), device=device, dtype=dtype)
            state.indexer = _compressor_state(rate, 2 * cfg.index_head_dim, cfg.index_head_dim, True, device)
    return state


def layer_cache_bytes(cfg: DeepseekV4Config, dtype: torch.dtype, context: int) -> list[int]:
    """What new_layer_state takes per layer for `context` positions (the ring and the rows; the
    compressed and indexer rows grow with the context, the ring does not)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = []
    for layer_type in cfg.layer_types:
        total = cfg.sliding_window * cfg.head_dim * itemsize
        if layer_type != SLIDING:
            rows = context // cfg.rate(layer_type)
            total += rows * cfg.head_dim * itemsize
            if layer_type == CSA:
                total += rows * cfg.index_head_dim * itemsize
        out.append(total)
    return out
