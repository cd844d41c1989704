"""The dense decoder family: Llama (and SmolLM2), Mistral, Qwen2, Qwen3.

One implementation covers all four; they differ only in a few switches that `DenseConfig.from_hf`
(config.py) reads from the checkpoint's config.json.

Parameter names equal Hugging Face's state-dict names, so a checkpoint loads by name. After
`materialize`, the q/k/v weights of a layer are views into one fused [q+k+v, hidden] tensor and
gate/up into one [2*ffn, hidden] tensor: the decode step then runs 2 matmuls instead of 5, with
no second copy of any weight. Keep that in mind: `Module.to()` or `load_state_dict(assign=True)`
would break the sharing; the loader copies into the existing parameters instead.

This module holds the model: its modules, loading, placement and cache. The layer's forward is in
layer.py, written once: each call picks the backend its path runs the layer's steps on (prefill,
eager one-token decode, the graphable step in torch, or the graphable step on the fused kernels).

Shapes inside `forward` drop the batch dimension (batch is always 1): activations are [T, hidden].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds4desk.engine.host_memory import HostBlock
from ds4desk.engine.kernels.dense import decode_attention as fused_decode
from ds4desk.engine.kernels.dense import gemv as kernels
from ds4desk.engine.models import base  # base.hand_over looked up per call: one place to spy on
from ds4desk.engine.models.base import CausalLM, LogitsMode, load_failure
from ds4desk.engine.models.llama.config import DenseConfig
from ds4desk.engine.models.llama.layer import (
    DecodeBuffers,
    EagerDecodeSteps,
    GraphDecodeSteps,
    KernelDecodeSteps,
    LayerPlan,
    LayerSteps,
    PrefillSteps,
    Shard,
    attention_out_input,
    decode_buffers,
    fused_kernels_fit,
    norm_project,
    rms_norm,
    silu_pair_input,
)
from ds4desk.engine.models.llama.verify import VerifySteps
from ds4desk.engine.models.packed import (
    Fused,
    embedding,
    fuse_group,
    group_projection,
    hold_device_rows,
    linear,
    projection_of,
)
from ds4desk.engine.models.packed import embed as packed_embed
from ds4desk.engine.models.row_buckets import FEW_ROWS, buckets, prefill_rows
from ds4desk.engine.split import host_block, materialize_parameters

# On a GPU a prefill chunk of more than FEW_ROWS tokens runs padded up to its row bucket
# (models/row_buckets.py), and the load's warm-up runs each bucket once (prefill_row_buckets). The
# padding repeats the last token at the positions after the chunk; a cache row per position, masked
# by position, is not read before decode writes it again.
PAD_PREFILL_ROWS = True  # False: chunks run at their own row count (bench/first_answer.py compares)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        q, kv, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
        self.q_proj = linear(hidden, q, cfg.qkv_bias, dtype, f"{prefix}.q_proj", packed)
        self.k_proj = linear(hidden, kv, cfg.qkv_bias, dtype, f"{prefix}.k_proj", packed)
        self.v_proj = linear(hidden, kv, cfg.qkv_bias, dtype, f"{prefix}.v_proj", packed)
        self.o_proj = linear(q, hidden, cfg.o_bias, dtype, f"{prefix}.o_proj", packed)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        h, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = linear(h, f, b, dtype, f"{prefix}.gate_proj", packed)
        self.up_proj = linear(h, f, b, dtype, f"{prefix}.up_proj", packed)
        self.down_proj = linear(f, h, b, dtype, f"{prefix}.down_proj", packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype, f"{prefix}.self_attn", packed)
        self.mlp = MLP(cfg, dtype, f"{prefix}.mlp", packed)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # Set by _fuse: "qkv" / "gate_up" -> the tensors their parameters are views of.
        self.fused: dict[str, Fused] | None = None


class Backbone(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype, packed: Mapping[str, int]) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, dtype, "model.embed_tokens", packed)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, f"model.layers.{i}", packed) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DenseModel(CausalLM):
    """The CausalLM of the dense family, with a preallocated KV cache (base.py has the call order)."""

    config: DenseConfig

    # Prefill attention through flash-style kernels (heads laid out for them) instead of the
    # kv-head-major layout that is fastest on the CPU. Set per device by finish_loading.
    fused_attention = False
    # RMSNorm as one F.rms_norm call, weight included: exact in float32; in bf16 on a GPU it is one
    # fused kernel instead of four (and rounds once instead of twice, a hair more precise than the
    # reference's cast-then-scale). Set by finish_loading.
    one_pass_norm = True
    # How decode_graphable attends: "triton" (a split-K kernel pair, kernels/dense/decode_attention.py,
    # where it can run: NVIDIA CUDA with Triton; elsewhere the "matmul" math), "matmul" (baddbmm +
    # softmax + bmm) or "sdpa" (one fused call).
    decode_attention = "triton"

    def __init__(
        self, config: DenseConfig, dtype: torch.dtype = torch.float32, packed: Mapping[str, int] | None = None
    ) -> None:
        super().__init__(config, dtype)
        packed = packed or {}
        self.model = Backbone(config, dtype, packed)
        if not config.tie_word_embeddings:  # else None (base): the embedding is the head
            self.lm_head = linear(config.hidden_size, config.vocab_size, False, dtype, "lm_head", packed)
        self._inv_freq: torch.Tensor | None = None
        self._plans: list[LayerPlan] = []
        self._shards: list[Shard] = []
        self._cache: torch.Tensor | None = None  # the first shard's (every layer's, unsplit)

    # --- loading -----------------------------------------------------------------------------

    def materialize(self, device: torch.device) -> None:
        """Give every parameter real (uninitialised) storage on `device` (or where the split puts
        it), fusing q/k/v and gate/up."""
        split = self._split
        layer_devices = [device] * self.config.num_layers
        if split is not None:
            layer_devices = [torch.device(d) for d in split.layer_devices()]
        block = host_block(self, device, split)
        for layer, where in zip(self.model.layers, layer_devices, strict=True):
            _fuse(layer, where, empty=True, block=block)
        materialize_parameters(self, device, split, block)

    def finish_loading(self) -> None:
        """After the weights are in: derive rope frequencies and the per-layer plans."""
        cfg = self.config
        device = self.device
        self._inv_freq = cfg.rope.inverse_frequencies(cfg.head_dim, device)
        self.fused_attention = device.type == "cuda"
        self.one_pass_norm = self.dtype == torch.float32 or device.type == "cuda"
        hold_device_rows(self)
        self._plans = [self._plan(index, layer) for index, layer in enumerate(self.model.layers)]
        bounds = self._split.bounds() if self._split is not None else [(0, cfg.num_layers)]
        self._shards = [
            Shard(self._plans[start].ln1.device, self._plans[start:stop], index == 0)
            for index, (start, stop) in enumerate(bounds)
        ]
        self.copy_tied_head()
        if self._context:
            self.allocate_cache(self._context)

    def _plan(self, index: int, layer: DecoderLayer) -> LayerPlan:
        cfg = self.config
        attn, mlp = layer.self_attn, layer.mlp
        if layer.fused is None:  # built without materialize
            _fuse(layer, layer.input_layernorm.weight.device, empty=False)
        fused = layer.fused
        assert fused is not None
        qk_norm = None
        if cfg.qk_norm:
            # One [H + KV, D] weight lets a single multiply scale the query and key heads together.
            qk_norm = torch.cat(
                [
                    attn.q_norm.weight.expand(cfg.num_heads, -1),
                    attn.k_norm.weight.expand(cfg.num_kv_heads, -1),
                ]
            )
        return LayerPlan(
            ln1=layer.input_layernorm.weight,
            qkv=group_projection([attn.q_proj, attn.k_proj, attn.v_proj], fused.get("qkv")),
            qk_norm=qk_norm,
            o=projection_of(attn.o_proj),
            ln2=layer.post_attention_layernorm.weight,
            gate_up=group_projection([mlp.gate_proj, mlp.up_proj], fused.get("gate_up")),
            down=projection_of(mlp.down_proj),
            window=cfg.sliding_windows[index] if cfg.sliding_windows else None,
        )

    # --- cache -------------------------------------------------------------------------------

    def allocate_cache(self, context: int) -> None:
        """Allocate the KV cache and rope tables for `context` positions (replacing any old cache)."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        if self._inv_freq is None:
            raise RuntimeError("allocate_cache before finish_loading")
        cfg = self.config
        self.free_cache()
        device = self.device
        # One block for every layer's keys and values (per shard): a single allocation, zeroed so
        # that no stale NaN can ever meet a mask.
        for shard in self._shards:
            shard.cache = torch.zeros(
                (len(shard.plans), 2, cfg.num_kv_heads, context, cfg.head_dim),
                device=shard.device,
                dtype=self.dtype,
            )
            for i, plan in enumerate(shard.plans):
                plan.kv_cache = shard.cache[i]
                plan.keys = shard.cache[i, 0].unsqueeze(0)
                plan.values = shard.cache[i, 1].unsqueeze(0)
                plan.down_input = silu_pair_input(plan)
                plan.o_input = attention_out_input(plan)
        self._cache = self._shards[0].cache
        positions = torch.arange(context, device=device, dtype=torch.float32)
        angles = torch.outer(positions, self._inv_freq)  # [context, D/2], float32 like the reference
        half = cfg.head_dim // 2
        cos = angles.cos()
        sin = angles.sin()
        # rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: folding the sign into the table turns
        # rotate_half's slice+neg+cat into one gather (index_select, the cheapest of the options).
        tables = (
            torch.cat([cos, cos], dim=-1).to(self.dtype),
            torch.cat([-sin, sin], dim=-1).to(self.dtype),
            torch.arange(cfg.head_dim, device=device).roll(half),
            torch.arange(context, device=device),
        )
        self._context = context
        # Another device's shards get copies of the first device's tables (computed once, so every
        # shard rotates by bit-identical angles) and their own decode buffers.
        per_device: dict[torch.device, tuple[tuple[torch.Tensor, ...], DecodeBuffers]] = {
            device: (tables, decode_buffers(cfg, device, self.dtype))
        }
        for shard in self._shards:
            if shard.device not in per_device:
                copies = tuple(t.to(shard.device, copy=True) for t in tables)
                per_device[shard.device] = (copies, decode_buffers(cfg, shard.device, self.dtype))
            copied_tables, shard.decode = per_device[shard.device]
            shard.cos, shard.sin, shard.half_swap, shard.key_positions = copied_tables

    def free_cache(self) -> None:
        self._cache = None
        for plan in self._plans:
            plan.kv_cache = plan.keys = plan.values = plan.down_input = plan.o_input = None
        for shard in self._shards:
            shard.cache = shard.cos = shard.sin = shard.half_swap = shard.key_positions = None
            shard.decode = None
        self._context = 0

    def cache_bytes(self) -> int:
        return sum(s.cache.numel() * s.cache.element_size() for s in self._shards if s.cache is not None)

    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """Every layer's keys and values for `context` positions (a split plan places each)."""
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return [2 * cfg.num_kv_heads * context * cfg.head_dim * itemsize] * cfg.num_layers

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """Everything positions 0..length-1 left behind, as host tensors (a snapshot's payload)."""
        assert self._cache is not None
        if len(self._shards) == 1:
            return {"kv": self._cache[:, :, :, :length].to("cpu", copy=True)}
        # Every shard's part, in layer order: the same payload as the unsplit model's.
        parts = [shard.cache[:, :, :, :length].to("cpu") for shard in self._shards if shard.cache is not None]
        return {"kv": torch.cat(parts)}

    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state: attention never reads past `length`, so nothing else to reset."""
        assert self._cache is not None
        if len(self._shards) == 1:
            self._cache[:, :, :, :length].copy_(state["kv"])
            return
        start = 0
        for shard in self._shards:
            assert shard.cache is not None
            stop = start + shard.cache.shape[0]
            shard.cache[:, :, :, :length].copy_(state["kv"][start:stop])  # onto the shard's device
            start = stop

    # --- speculative decoding (speculative/rollback.py) ---------------------------------------

    # A row per position and attention masked by position (sliding windows included): the rows a
    # rejected draft wrote are never read before the next write replaces them.
    supports_speculation = True

    def max_verify_tokens(self) -> int | None:
        return None

    def verify_checkpoint(self, start_pos: int, count: int) -> None:
        return None

    def verify_rollback(self, saved: None, start_pos: int, kept: int) -> None:
        return None

    # --- running -----------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, writing their keys/values into the
        cache. Returns float32 logits: [V] for "last", [T, V] for "all", None for "none"."""
        if not self._context:
            raise RuntimeError("forward before allocate_cache")
        count = input_ids.shape[0]
        self.check_positions(start_pos, count)
        cfg, exact = self.config, self.one_pass_norm
        embed = self.model.embed_tokens
        input_ids = _on(input_ids, embed.weight)
        rows = self._padded_rows(start_pos, count)
        if rows > count:  # the padding repeats the last token, at positions after the chunk's
            input_ids = torch.cat([input_ids, input_ids[-1:].expand(rows - count)])
        x = packed_embed(embed, input_ids)  # [rows, hidden]
        for shard in self._shards:
            if not shard.first:
                x = base.hand_over(x, shard.device)
            steps: LayerSteps
            if count == 1:
                steps = EagerDecodeSteps(cfg, exact, shard, start_pos)
            else:
                steps = PrefillSteps(cfg, exact, self.fused_attention, shard, start_pos, rows)
            for plan in shard.plans:
                x = steps.layer(x, plan)
        if logits == "none":
            return None
        x = x[count - 1 : count] if logits == "last" else x[:count]
        x = rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps, exact)
        return self.logits_from(x, logits, input_ids)

    def _padded_rows(self, start_pos: int, count: int) -> int:
        """The rows a prefill chunk of `count` tokens at start_pos runs as: on a GPU, its bucket
        (prefill_rows) where the context has room for it after start_pos, else `count`."""
        if count <= FEW_ROWS or not self._pads_rows():
            return count
        rows = prefill_rows(count)
        return rows if start_pos + rows <= self._context else count

    def _pads_rows(self) -> bool:
        return PAD_PREFILL_ROWS and self._shards[0].device.type == "cuda"

    def prefill_row_buckets(self, chunk: int) -> list[int]:
        if not self._pads_rows():
            return []
        return buckets(min(chunk, self._context), self._context)

    def decode_devices(self) -> list[torch.device]:
        return [shard.device for shard in self._shards]

    def verify_graphable(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor | None:
        """See CausalLM.verify_graphable: one shard only (a split verifies eagerly)."""
        if len(self._shards) != 1:
            return None
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        return self._tokens_graphable(tokens, pos, span, None)

    def prefill_graphable(
        self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, span: int
    ) -> torch.Tensor | None:
        """See CausalLM.prefill_graphable: the verify step's layers, the head on the last real row."""
        if len(self._shards) != 1:
            return None
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        return self._tokens_graphable(tokens, pos, span, count - 1)[0]

    def _tokens_graphable(
        self, tokens: torch.Tensor, pos: torch.Tensor, span: int, row: torch.Tensor | None
    ) -> torch.Tensor:
        """T tokens at device positions pos.. on one shard; logits [T, V], or [1, V] of `row`."""
        cfg, shard = self.config, self._shards[0]
        x = packed_embed(self.model.embed_tokens, tokens)  # [T, hidden]
        kernel = self.decode_attention == "triton" and fused_decode.enabled(shard.device)
        steps = VerifySteps(cfg, self.one_pass_norm, shard, pos, span, tokens.shape[0], kernel)
        for plan in shard.plans:
            x = steps.layer(x, plan)
        if row is not None:
            x = x.index_select(0, row)
        x = rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps, self.one_pass_norm)
        return self.logits_from(x, "all", x)

    def decode_shard(
        self, index: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `index`'s part of decode_graphable: the first shard takes (token, pos), every later
        one the previous one's (hidden, pos); the last returns (logits,), the others (hidden, pos)."""
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        cfg = self.config
        shard = self._shards[index]
        if index == 0:
            token, here = inputs
            x = packed_embed(self.model.embed_tokens, token)  # [1, hidden]
        else:
            x, here = inputs
        fused = self.decode_attention == "triton" and fused_decode.enabled(shard.device)
        on_kernels = fused and self._kernels_fit(shard)
        steps: LayerSteps
        if on_kernels:
            if index:
                x = x.clone()  # the residual is updated in place: never in the graph's input buffer
            steps = KernelDecodeSteps(cfg, shard, here, span)
        else:
            attention = "triton" if fused else "sdpa" if self.decode_attention == "sdpa" else "matmul"
            steps = GraphDecodeSteps(cfg, self.one_pass_norm, attention, shard, here, span)
        for plan in shard.plans:
            x = steps.layer(x, plan)
        if index + 1 < len(self._shards):
            return x, here
        if on_kernels:
            head = self.head_projection()
            logits = torch.empty((1, head.rows), device=x.device, dtype=torch.float32)
            return (norm_project(x, self.model.norm.weight, head, cfg.rms_norm_eps, logits)[0],)
        x = rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps, self.one_pass_norm)
        return (self.logits_from(x, "last", x),)

    def _kernels_fit(self, shard: Shard) -> bool:
        """Whether the shard's graphed step can run on the fused kernels (KernelDecodeSteps)."""
        if not kernels.enabled(shard.device) or not kernels.fits_heads(self.config.head_dim):
            return False
        projections = [self.head_projection()] if shard is self._shards[-1] else []
        for plan in shard.plans:
            projections += [plan.qkv, plan.o, plan.gate_up, plan.down]
        return all(fused_kernels_fit(p, self.dtype) for p in projections)


def _on(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ids` where `weight` is: the caller's device may be another shard's."""
    return ids if ids.device == weight.device else ids.to(weight.device)


def _fuse(layer: DecoderLayer, device: torch.device, empty: bool, block: HostBlock | None = None) -> None:
    """Fuse the layer's q/k/v and gate/up groups (models/packed.fuse_group) into `layer.fused`, a plain
    dict, so the fused tensors never show up in state_dict."""
    attn, mlp = layer.self_attn, layer.mlp
    layer.fused = {}
    groups = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "gate_up": [mlp.gate_proj, mlp.up_proj]}
    for key, parts in groups.items():
        fused = fuse_group(parts, device, empty, block)
        if fused is not None:
            layer.fused[key] = fused


def build(
    config: dict[str, Any],
    family: str,
    dtype: torch.dtype,
    quantized: bool = False,
    packed: Mapping[str, int] | None = None,
) -> DenseModel:
    """The registry's entry point: `family`'s model for a config.json dict, with the `packed`
    weights kept in their GGUF block types (models/packed.py)."""
    if quantized:
        raise load_failure(f"the {family} family does not keep FP8 / FP4 weights packed")
    return DenseModel(DenseConfig.from_hf(config, family), dtype, packed)
