"""Qwen3.5 MoE's sparse block: the router, the routed experts and the gated shared expert.

Per token, the router's softmax over all experts (in float32) picks the top `experts_per_token`;
their probabilities are renormalised to sum to 1 and rounded to the model's dtype, and each picked
expert's SwiGLU output is weighed by its share. One shared SwiGLU expert runs for every token,
scaled by sigmoid of a one-column projection, and is added to the routed sum.

A checkpoint stores the experts one of two ways (config.STACKED_EXPERTS_KEY says which), and the
parameters are named after it, so either loads by name:
- one 2-D weight per expert and projection (`mlp.experts.<e>.gate_proj.weight`, ...), what
  transformers' save_pretrained writes. `fuse_experts` then lays a layer's experts side by side in
  two tensors before the weights are read (the parameters become views of them, no second copy);
- stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), as transformers holds them in
  memory: already side by side.
Either way gate/up is [E, 2I, hidden] (per expert the gate rows, then the up rows) and down
[E, hidden, I], which lets the graphable decode step pick its experts' weights by index on the
device, with no host sync (what a CUDA graph can keep): on the GEMV kernels, which read only the
picked experts' rows, or else by gathering their weights. Experts kept in GGUF blocks (`--weights
q8 / q4`) stay apart; they decode through the host, so such a model captures no graphs.

Everything else (prefill chunks, eager decode) groups the (token, slot) pairs by expert, reads the
group sizes once on the host and runs one GEMM pair per expert that was picked: nothing ever
computes an expert for a token that did not choose it, and nothing copies an expert's weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.kernels.dense import gemv as decode_kernels
from ds4desk.engine.models.packed import (
    Fused,
    Projection,
    fuse_group,
    group_projection,
    linear,
    projection_of,
)
from ds4desk.engine.models.qwen3_5.config import Qwen35Config


class SwiGLU(nn.Module):
    """One expert's (or the shared expert's) weights, named as the checkpoint names them."""

    def __init__(
        self, hidden: int, width: int, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]
    ) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, width, False, dtype, f"{prefix}.gate_proj", packed)
        self.up_proj = linear(hidden, width, False, dtype, f"{prefix}.up_proj", packed)
        self.down_proj = linear(width, hidden, False, dtype, f"{prefix}.down_proj", packed)


class StackedExperts(nn.Module):
    """`...mlp.experts` of a checkpoint that stores them stacked: gate_up_proj, down_proj."""

    def __init__(self, experts: int, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty((experts, 2 * width, hidden), dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty((experts, hidden, width), dtype=dtype), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """`...mlp.*` of a MoE layer: gate (the router), experts (experts.<e>.* or stacked),
    shared_expert and shared_expert_gate."""

    def __init__(self, cfg: Qwen35Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.gate = linear(hidden, cfg.num_experts, False, dtype, f"{prefix}.gate", packed)
        self.experts: StackedExperts | nn.ModuleList
        if cfg.stacked_experts:
            self.experts = StackedExperts(cfg.num_experts, hidden, cfg.moe_intermediate_size, dtype)
        else:
            self.experts = nn.ModuleList(
                SwiGLU(hidden, cfg.moe_intermediate_size, dtype, f"{prefix}.experts.{e}", packed)
                for e in range(cfg.num_experts)
            )
        self.shared_expert = SwiGLU(
            hidden, cfg.shared_expert_intermediate_size, dtype, f"{prefix}.shared_expert", packed
        )
        self.shared_expert_gate = linear(hidden, 1, False, dtype, f"{prefix}.shared_expert_gate", packed)
        # Set by fuse_experts: {"gate_up": ..., "down": ...}, a plain dict so the fused tensors never
        # show up in state_dict.
        self.fused: dict[str, Fused] = {}


def fuse_experts(block: SparseMoeBlock, device: torch.device) -> None:
    """Before the weights are read: every expert's gate, up (and, apart, down) weights as consecutive
    rows of one fresh tensor on `device`, the parameters views of it. Only float weights: packed
    GGUF experts (or experts of mixed block types) stay apart and decode through the host. Stacked
    experts are side by side already."""
    if isinstance(block.experts, StackedExperts):
        return
    experts = list(block.experts)
    if any(not isinstance(e.gate_proj, nn.Linear) for e in experts):  # type: ignore[union-attr]
        return
    gate_up = [p for e in experts for p in (e.gate_proj, e.up_proj)]  # type: ignore[union-attr]
    down = [e.down_proj for e in experts]  # type: ignore[union-attr]
    fused_gate_up, fused_down = fuse_group(gate_up, device), fuse_group(down, device)
    if fused_gate_up is not None and fused_down is not None:
        block.fused = {"gate_up": fused_gate_up, "down": fused_down}


@dataclass(slots=True)
class MoePlan:
    """What a MoE layer's forward reads, derived once the weights are in."""

    router: Projection  # [T, E]
    gate_up: list[Projection]  # per expert: [T, 2I], the gate then the up projection
    down: list[Projection]  # per expert: [T, hidden]
    shared_gate_up: Projection
    shared_down: Projection
    shared_scale: Projection  # [T, 1], before the sigmoid
    top_k: int
    # The experts side by side (stacked_of), float only: [E, 2I, hidden] and [E, hidden, I].
    stacked_gate_up: torch.Tensor | None = None
    stacked_down: torch.Tensor | None = None


def stacked_of(block: SparseMoeBlock) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block's experts side by side, gate/up [E, 2I, hidden] and down [E, hidden, I]: stored
    so, or fused by fuse_experts; None for experts kept apart (packed)."""
    if isinstance(block.experts, StackedExperts):
        return block.experts.gate_up_proj, block.experts.down_proj
    gate_up, down = block.fused.get("gate_up"), block.fused.get("down")
    if gate_up is None or down is None:
        return None
    count, width = len(block.experts), block.experts[0].down_proj.in_features
    return gate_up[0].view(count, 2 * width, -1), down[0].view(count, -1, width)


def plan_of(block: SparseMoeBlock, top_k: int) -> MoePlan:
    stacked = stacked_of(block)
    if stacked is not None:
        gate_up = [Projection(weight_t=w.t()) for w in stacked[0]]
        down = [Projection(weight_t=w.t()) for w in stacked[1]]
    else:
        experts = list(block.experts)
        gate_up = [group_projection([e.gate_proj, e.up_proj], None) for e in experts]  # type: ignore[list-item]
        down = [projection_of(e.down_proj) for e in experts]  # type: ignore[arg-type]
    shared = block.shared_expert
    return MoePlan(
        router=projection_of(block.gate),
        gate_up=gate_up,
        down=down,
        shared_gate_up=group_projection([shared.gate_proj, shared.up_proj], None),
        shared_down=projection_of(shared.down_proj),
        shared_scale=projection_of(block.shared_expert_gate),
        top_k=top_k,
        stacked_gate_up=None if stacked is None else stacked[0],
        stacked_down=None if stacked is None else stacked[1],
    )


def route(plan: MoePlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The picked experts [T, k] and their weights [T, k] (renormalised, in x's dtype)."""
    probabilities = torch.softmax(plan.router(x).float(), dim=-1)
    top, chosen = probabilities.topk(plan.top_k, dim=-1)
    return chosen, (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def forward(plan: MoePlan, x: torch.Tensor, graphable: bool = False) -> torch.Tensor:
    """The block's output for normed hidden states x [T, hidden]: [T, hidden].

    `graphable`: one token with nothing read back to the host (the decode step a CUDA graph keeps);
    it needs the stacked experts (MoePlan.stacked_*)."""
    chosen, weights = route(plan, x)
    if graphable:
        routed = _picked_by_index(plan, x, chosen, weights)
    else:
        routed = _grouped_by_expert(plan, x, chosen, weights)
    shared = plan.shared_down(_swiglu(plan.shared_gate_up(x))) * torch.sigmoid(plan.shared_scale(x))
    return routed + shared


def _grouped_by_expert(
    plan: MoePlan, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The (token, slot) pairs sorted by expert, one host read of the group sizes, then a GEMM pair
    per expert that has tokens; each pair's weighted output is added back onto its token."""
    top_k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # pair indices, grouped by expert
    sizes = torch.bincount(flat, minlength=len(plan.gate_up)).tolist()
    tokens = order // top_k
    inputs = x.index_select(0, tokens)
    pair_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, size in enumerate(sizes):
        if not size:
            continue
        stop = start + size
        hidden = _swiglu(plan.gate_up[expert](inputs[start:stop]))
        out.index_add_(0, tokens[start:stop], plan.down[expert](hidden) * pair_weights[start:stop])
        start = stop
    return out


def _picked_by_index(
    plan: MoePlan, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """One token, the picked experts read by index on the device, then the weighted sum; no host
    sync. On the GEMV kernels only the picked experts' rows are read (the SwiGLU taken inside the
    down projection: an infinite limit clamps nothing); else their weights are gathered (k of E
    copied) for two batched matmuls."""
    gate_up_all, down_all = plan.stacked_gate_up, plan.stacked_down
    assert gate_up_all is not None and down_all is not None
    picked = chosen[0]  # [k]
    if decode_kernels.one_row(x, gate_up_all.flatten(0, 1)) and decode_kernels.fits(down_all.flatten(0, 1)):
        gate_up = x.new_empty((picked.numel(), gate_up_all.shape[1]))
        decode_kernels.experts_gemv(x, gate_up_all, picked, gate_up)
        ys = x.new_empty((picked.numel(), down_all.shape[1]))
        decode_kernels.experts_gemv(gate_up, down_all, picked, ys, math.inf)
        return (ys * weights[0].unsqueeze(1)).sum(dim=0, keepdim=True)
    hidden = _swiglu(torch.matmul(gate_up_all.index_select(0, picked), x.view(-1)))  # [k, I]
    ys = torch.bmm(down_all.index_select(0, picked), hidden.unsqueeze(2)).squeeze(2)  # [k, hidden]
    return (ys * weights[0].unsqueeze(1)).sum(dim=0, keepdim=True)
