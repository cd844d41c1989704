"""Where Qwen3.5's state lives: one shard's layers and their state blocks on its device.

Unsplit, one shard holds every layer. A layer split gives each shard the blocks of its own layers
on its own device (and its own copy of the rope tables, so every shard turns by identical
angles); snapshots join the shards' blocks in layer order, so the payload is the same either way.

Per shard, one zeroed block per kind:
- conv [linear layers, channels, kernel - 1]: each linear layer's last convolution inputs;
- recurrent [linear layers, heads, key_dim, value_dim], float32 whatever the model's dtype (the
  recurrent matrix is a long running sum);
- kv [full layers, 2, kv heads, context, head_dim]: each full layer's keys and values by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4desk.engine.models.packed import Projection
from ds4desk.engine.models.qwen3_5.attention import AttentionPlan, Positions, positions_for
from ds4desk.engine.models.qwen3_5.config import Qwen35Config
from ds4desk.engine.models.qwen3_5.linear_attention import LinearPlan
from ds4desk.engine.models.qwen3_5.moe import MoePlan

KINDS = ("kv", "conv", "recurrent")


@dataclass(slots=True)
class LayerPlan:
    """What one layer's forward reads, derived once the weights are in (model.finish_loading)."""

    mixer: LinearPlan | AttentionPlan
    # Both norms' float32 scales 1 + w (the stored weights are centred on 0), as the norm kernel and
    # the fused one-row GEMVs read them.
    input_scale: torch.Tensor
    post_scale: torch.Tensor
    # The dense MLP's projections, or the MoE block's plan: one or the other. gate_up: gate and up as
    # one product over their fused weight (None where they are not fused: packed weights).
    gate: Projection | None = None
    up: Projection | None = None
    down: Projection | None = None
    gate_up: Projection | None = None
    moe: MoePlan | None = None
    # For the graphable decode step on the fused one-row GEMV kernels (kernels/dense/gemv.py, see
    # model._layers): whether the mixer's (a linear layer's) and the dense MLP's projections are
    # float weights those kernels take.
    mixer_fits: bool = False
    mlp_fits: bool = False


@dataclass(slots=True)
class Tables:
    """The rope rows and key positions of one device."""

    cos: torch.Tensor  # [context, rotary_dim], the model's dtype
    sin: torch.Tensor
    key_positions: torch.Tensor  # int64 [context]

    def positions(self, rows: torch.Tensor, keys: int) -> Positions:
        return positions_for(self.cos, self.sin, self.key_positions, rows.to(self.cos.device), keys)


@dataclass(slots=True)
class Shard:
    device: torch.device
    plans: list[LayerPlan]
    first: bool
    blocks: dict[str, torch.Tensor] | None = None  # KINDS -> this shard's block (allocate)
    tables: Tables | None = None

    @property
    def linear_plans(self) -> list[LinearPlan]:
        return [p.mixer for p in self.plans if isinstance(p.mixer, LinearPlan)]

    @property
    def attention_plans(self) -> list[AttentionPlan]:
        return [p.mixer for p in self.plans if isinstance(p.mixer, AttentionPlan)]

    def allocate(self, cfg: Qwen35Config, context: int, dtype: torch.dtype, tables: Tables) -> None:
        """Zeroed blocks for this shard's layers, each layer's plan pointed at its slice."""
        linear, full = self.linear_plans, self.attention_plans
        self.blocks = {
            "kv": torch.zeros(
                (len(full), 2, cfg.num_kv_heads, context, cfg.head_dim), device=self.device, dtype=dtype
            ),
            "conv": torch.zeros(
                (len(linear), cfg.conv_channels, cfg.conv_kernel - 1), device=self.device, dtype=dtype
            ),
            "recurrent": torch.zeros(
                (len(linear), cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim),
                device=self.device,
                dtype=torch.float32,
            ),
        }
        for i, plan in enumerate(linear):
            plan.conv_state = self.blocks["conv"][i]
            plan.recurrent = self.blocks["recurrent"][i]
        for i, plan in enumerate(full):
            plan.kv_cache = self.blocks["kv"][i]
        self.tables = tables

    def free(self) -> None:
        for plan in self.linear_plans:
            plan.conv_state = plan.recurrent = None
        for plan in self.attention_plans:
            plan.kv_cache = None
        self.blocks = None
        self.tables = None

    def reset(self) -> None:
        """Position 0: no convolution inputs, empty recurrent matrices (KV rows past the length are
        never read, so they need nothing)."""
        assert self.blocks is not None
        self.blocks["conv"].zero_()
        self.blocks["recurrent"].zero_()

    def view(self, kind: str, length: int) -> torch.Tensor:
        """The part of block `kind` that holds positions 0..length-1 (the whole fixed-size ones)."""
        assert self.blocks is not None
        block = self.blocks[kind]
        return block[:, :, :, :length] if kind == "kv" else block

    def nbytes(self) -> int:
        blocks = self.blocks.values() if self.blocks is not None else ()
        return sum(b.numel() * b.element_size() for b in blocks)


def rope_tables(inv_freq: torch.Tensor, context: int, dtype: torch.dtype) -> Tables:
    """cos / sin [context, rotary_dim] as the reference makes them: float32 angles, then its dtype."""
    device = inv_freq.device
    angles = torch.outer(torch.arange(context, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return Tables(angles.cos().to(dtype), angles.sin().to(dtype), torch.arange(context, device=device))


def copied_to(tables: Tables, device: torch.device) -> Tables:
    if tables.cos.device == device:
        return tables
    return Tables(*(t.to(device, copy=True) for t in (tables.cos, tables.sin, tables.key_positions)))
