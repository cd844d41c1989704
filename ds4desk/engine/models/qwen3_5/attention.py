"""Qwen3.5's full-attention layer: its parameters and its forward.

Unlike a plain dense layer, q_proj yields two halves per head, the query and a gate: the
attention output is multiplied by sigmoid(gate) before o_proj. Query and key heads are RMS-normed
(weights centred on 0) and RoPE turns only the first `rotary_dim` dimensions of each head.

Keys and values go into a preallocated cache, a row per position; attention is masked by
position, so rows past the current one are never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.models.base import CenteredNorm, later_chunk_mask
from ds4desk.engine.models.packed import Projection, linear, projection_of
from ds4desk.engine.models.qwen3_5.config import Qwen35Config
from ds4desk.engine.models.qwen3_5.ops import rotate_leading, scaled_rms_norm


class GatedAttention(nn.Module):
    """The parameters, named as the checkpoint names them (`...self_attn.*`)."""

    def __init__(self, cfg: Qwen35Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        q, kv, hidden, bias = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.hidden_size,
            cfg.attention_bias,
        )
        self.q_proj = linear(hidden, 2 * q, bias, dtype, f"{prefix}.q_proj", packed)  # query + gate
        self.k_proj = linear(hidden, kv, bias, dtype, f"{prefix}.k_proj", packed)
        self.v_proj = linear(hidden, kv, bias, dtype, f"{prefix}.v_proj", packed)
        self.o_proj = linear(q, hidden, bias, dtype, f"{prefix}.o_proj", packed)
        self.q_norm = CenteredNorm(cfg.head_dim, dtype)
        self.k_norm = CenteredNorm(cfg.head_dim, dtype)


@dataclass(slots=True)
class AttentionPlan:
    q: Projection  # [T, heads * 2 * head_dim]: per head, the query then its gate
    k: Projection
    v: Projection
    o: Projection
    q_scale: torch.Tensor  # the head norms' float32 1 + w
    k_scale: torch.Tensor
    kv_cache: torch.Tensor | None = None  # [2, kv heads, context, head_dim], set by allocate_cache


def plan_of(module: GatedAttention) -> AttentionPlan:
    return AttentionPlan(
        q=projection_of(module.q_proj),
        k=projection_of(module.k_proj),
        v=projection_of(module.v_proj),
        o=projection_of(module.o_proj),
        q_scale=1.0 + module.q_norm.weight.float(),
        k_scale=1.0 + module.k_norm.weight.float(),
    )


@dataclass(slots=True)
class Positions:
    """Where a forward's tokens sit: their rope rows, which cache rows they write, and the mask
    of the keys each may read. Built once per forward and shared by every attention layer."""

    cos: torch.Tensor  # [T, rotary_dim]
    sin: torch.Tensor
    rows: torch.Tensor  # int64 [T]: the positions written
    keys: int  # the cache rows attention reads: 0..keys-1
    visible: torch.Tensor  # bool [T, keys]: key j is at or before the query's position


def positions_for(
    cos: torch.Tensor, sin: torch.Tensor, key_positions: torch.Tensor, rows: torch.Tensor, keys: int
) -> Positions:
    """`rows` may be a device tensor (the graphable step's position): nothing here syncs."""
    visible = key_positions[:keys][None, :] <= rows[:, None]
    return Positions(cos.index_select(0, rows), sin.index_select(0, rows), rows, keys, visible)


def forward(
    cfg: Qwen35Config,
    plan: AttentionPlan,
    x: torch.Tensor,
    residual: torch.Tensor,
    at: Positions,
    fused: bool = False,
) -> torch.Tensor:
    """Gated attention over normed hidden states x [T, hidden]: writes their keys and values into
    the cache rows `at.rows` and attends over rows 0..at.keys-1. Returns residual [T, hidden] plus
    the output projection.

    `fused`: a prefill chunk of consecutive positions ending at at.keys - 1 (never the graphable
    step) through SDPA laid out for the GPU's fused kernels (kv heads repeated, a causal flag or
    bias instead of a mask): the scores never exist as one tensor."""
    assert plan.kv_cache is not None
    count, heads, kv_heads, dim = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    query_gate = plan.q(x).view(count, heads, 2 * dim)
    query, gate = query_gate[..., :dim], query_gate[..., dim:].reshape(count, heads * dim)
    # Each head's query is a row [D] of the query-and-gate rows, 2D apart: normed as rows in place.
    query = scaled_rms_norm(query_gate.view(count * heads, 2 * dim)[:, :dim], plan.q_scale, cfg.rms_norm_eps)
    query = query.view(count, heads, dim).transpose(0, 1)  # [H, T, D]
    key = scaled_rms_norm(plan.k(x).view(count * kv_heads, dim), plan.k_scale, cfg.rms_norm_eps)
    key = key.view(count, kv_heads, dim)
    value = plan.v(x).view(count, kv_heads, dim).transpose(0, 1)
    query = rotate_leading(query, at.cos, at.sin)
    key = rotate_leading(key.transpose(0, 1), at.cos, at.sin)
    plan.kv_cache[0].index_copy_(1, at.rows, key)
    plan.kv_cache[1].index_copy_(1, at.rows, value)
    keys = plan.kv_cache[0, :, : at.keys]  # [KV, S, D]
    values = plan.kv_cache[1, :, : at.keys]
    group = heads // kv_heads
    if fused:
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        start = at.keys - count
        # From position 0 the causal flag lets the kernel skip the blocks above the diagonal; a later
        # chunk's queries sit at the end of the keys (the bias aligns the diagonal there).
        causal = later_chunk_mask(count, at.keys, query.device) if start else None
        attended = F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=causal, is_causal=causal is None, scale=dim**-0.5
        )[0]
        out = attended.transpose(0, 1).reshape(count, heads * dim)
    else:
        # Grouped heads: query head h reads kv head h // group; [KV, group * T, D] against [KV, S, D].
        grouped = query.reshape(kv_heads, group * count, dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)) * dim**-0.5
        scores = scores.view(kv_heads, group, count, at.keys).masked_fill(~at.visible, float("-inf"))
        weights = (
            torch.softmax(scores.float(), dim=-1).to(values.dtype).view(kv_heads, group * count, at.keys)
        )
        out = torch.bmm(weights, values).view(heads, count, dim).transpose(0, 1).reshape(count, heads * dim)
    return plan.o.add_into(residual, out * torch.sigmoid(gate))
