"""Qwen3.5 text, dense and MoE (transformers' `qwen3_5`, `qwen3_5_moe`): the modules, loading, the
state and the forward.

Layers are Gated DeltaNet (linear_attention.py) or gated full attention (attention.py), as the
config's `layer_types` lists them; every layer then has the usual SwiGLU MLP (dense) or the sparse
block of routed experts plus a gated shared expert (MoE, moe.py), and both norms around it are
RMSNorms whose weights are stored centred on 0.

The state is not a KV cache that can be cut anywhere: a linear-attention layer keeps a convolution
window and a recurrent matrix that hold exactly the positions run so far. So the model tracks its
length on the host, every forward must continue at that length (or start over at 0), and
`export_state` can only take the current length; a snapshot is restored at exactly the length it
was taken at (the runtime restores whole snapshots, never a prefix of one).

A layer split (place, from base) gives each shard its layers' state on its own device (state.py);
the hidden state crosses between shards through base.hand_over, and snapshots join the shards'
blocks in layer order.

Parameter names equal transformers' state-dict names, so a checkpoint loads by name: `model.*` in a
text-only save (Qwen3_5ForCausalLM), `model.language_model.*` in the published vision-language
checkpoints (Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration, whose vision
tower is not loaded).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.kernels.dense import gemv as dense_gemv
from ds4desk.engine.kernels.dense.silu_mul import silu_mul
from ds4desk.engine.kernels.qwen3_5 import linear_decode
from ds4desk.engine.models import base  # base.hand_over looked up per call: one place to spy on
from ds4desk.engine.models.base import CausalLM, CenteredNorm, LogitsMode, load_failure
from ds4desk.engine.models.packed import (
    Fused,
    Projection,
    embed,
    embedding,
    fuse_group,
    group_projection,
    linear,
    projection_of,
)
from ds4desk.engine.models.qwen3_5 import attention, delta_rule, linear_attention, moe
from ds4desk.engine.models.qwen3_5.attention import AttentionPlan, GatedAttention, Positions
from ds4desk.engine.models.qwen3_5.config import LINEAR, Qwen35Config
from ds4desk.engine.models.qwen3_5.linear_attention import GatedDeltaNet, LinearPlan, Written
from ds4desk.engine.models.qwen3_5.moe import SparseMoeBlock, fuse_experts
from ds4desk.engine.models.qwen3_5.ops import scaled_rms_norm
from ds4desk.engine.models.qwen3_5.state import KINDS, LayerPlan, Shard, copied_to, rope_tables
from ds4desk.engine.models.row_buckets import buckets
from ds4desk.engine.split import host_block, materialize_parameters

# On a GPU a prefill product of more than a few rows runs on its rows padded to their bucket
# (models/row_buckets.py: cuBLAS's first call at a new row count costs milliseconds; the chunk
# itself cannot be padded, its linear layers' state would take the padding in), and the load's
# warm-up runs each bucket (Qwen35Model.prefill_row_buckets). False: at their own row count.
PAD_PRODUCT_ROWS = True


class MLP(nn.Module):
    def __init__(self, cfg: Qwen35Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(h, f, False, dtype, f"{prefix}.gate_proj", packed)
        self.up_proj = linear(h, f, False, dtype, f"{prefix}.up_proj", packed)
        self.down_proj = linear(f, h, False, dtype, f"{prefix}.down_proj", packed)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: Qwen35Config, index: int, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]
    ) -> None:
        super().__init__()
        if cfg.layer_types[index] == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype, f"{prefix}.linear_attn", packed)
        else:
            self.self_attn = GatedAttention(cfg, dtype, f"{prefix}.self_attn", packed)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, dtype, f"{prefix}.mlp", packed)
            if cfg.is_moe
            else MLP(cfg, dtype, f"{prefix}.mlp", packed)
        )
        self.input_layernorm = CenteredNorm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = CenteredNorm(cfg.hidden_size, dtype)
        # Set by materialize: "gate_up" -> the fused (weight, bias) a float MLP's gate and up view.
        self.fused: dict[str, Fused] = {}


class Backbone(nn.Module):
    def __init__(self, cfg: Qwen35Config, dtype: torch.dtype, packed: Mapping[str, int]) -> None:
        super().__init__()
        prefix = cfg.weight_prefix
        self.embed_tokens = embedding(
            cfg.vocab_size, cfg.hidden_size, dtype, f"{prefix}.embed_tokens", packed
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, f"{prefix}.layers.{i}", packed) for i in range(cfg.num_layers)
        )
        self.norm = CenteredNorm(cfg.hidden_size, dtype)


class VisionLanguageShell(nn.Module):
    """`model` of a vision-language checkpoint: only its language model is built (so its weights
    are named `model.language_model.*`); the base class finds the embedding and norm through it."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.language_model = backbone

    @property
    def embed_tokens(self) -> nn.Module:
        return self.language_model.embed_tokens

    @property
    def norm(self) -> CenteredNorm:
        return self.language_model.norm

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers


class Qwen35Model(CausalLM):
    """The CausalLM of Qwen3.5 text, dense or MoE (base.py has the call order)."""

    config: Qwen35Config

    # Prefill attention through SDPA laid out for fused GPU kernels (attention.forward's `fused`);
    # set per device by finish_loading. The CPU keeps the grouped matmuls (no repeated kv heads).
    fused_attention = False

    def __init__(
        self,
        config: Qwen35Config,
        dtype: torch.dtype = torch.float32,
        packed: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(config, dtype)
        packed = packed or {}
        backbone = Backbone(config, dtype, packed)
        self.model: Backbone | VisionLanguageShell = (
            backbone if config.weight_prefix == "model" else VisionLanguageShell(backbone)
        )
        if not config.tie_word_embeddings:  # else None (base): the embedding is the head
            self.lm_head = linear(config.hidden_size, config.vocab_size, False, dtype, "lm_head", packed)
        self._shards: list[Shard] = []
        self._head: Projection | None = None
        self._final_scale: torch.Tensor | None = None  # the final norm's 1 + w, float32
        self._inv_freq: torch.Tensor | None = None
        self._length = 0  # the positions the state holds
        # What each captured verify graph, by (tokens, span), feeds the linear layers, in their
        # order: a replay's records for the roll-back (verify_replayed).
        self._graph_written: dict[tuple[int, int], list[Written]] = {}

    # --- loading -----------------------------------------------------------------------------

    def materialize(self, device: torch.device) -> None:
        """Real (uninitialised) storage on `device`, or where the split puts each layer; a MoE
        layer's experts laid side by side first (moe.fuse_experts), a float MLP's gate and up as
        row ranges of one weight (a prefill runs them as one product)."""
        split = self._split
        layer_devices = [device] * self.config.num_layers
        if split is not None:
            layer_devices = [torch.device(d) for d in split.layer_devices()]
        for layer, where in zip(self.model.layers, layer_devices, strict=True):
            if isinstance(layer.mlp, SparseMoeBlock):
                fuse_experts(layer.mlp, where)
        block = host_block(self, device, split)  # sized for what is still to place
        for layer, where in zip(self.model.layers, layer_devices, strict=True):
            mlp = layer.mlp
            if isinstance(mlp, MLP) and type(mlp.gate_proj) is nn.Linear and type(mlp.up_proj) is nn.Linear:
                fused = fuse_group((mlp.gate_proj, mlp.up_proj), where, block=block)
                assert fused is not None  # float parts of one dtype always fuse
                layer.fused["gate_up"] = fused
        materialize_parameters(self, device, split, block)

    def finish_loading(self) -> None:
        """After the weights are in: the per-layer plans grouped by shard, the rope speeds and the head."""
        cfg = self.config
        plans = [self._plan(layer, cfg.experts_per_token) for layer in self.model.layers]
        # The graphable MoE step picks experts by index from the stacked float weights; packed
        # (GGUF) experts are picked on the host, which a CUDA graph cannot keep.
        self.supports_graphs = all(p.moe is None or p.moe.stacked_gate_up is not None for p in plans)
        bounds = self._split.bounds() if self._split is not None else [(0, cfg.num_layers)]
        self._shards = [
            Shard(plans[start].input_scale.device, plans[start:stop], index == 0)
            for index, (start, stop) in enumerate(bounds)
        ]
        self._inv_freq = cfg.rope.inverse_frequencies(cfg.rotary_dim, self.device)
        self.fused_attention = self.device.type == "cuda"
        pads = self._pads_rows()
        for plan in plans:
            for projection in _projections(plan):
                projection.pad_rows = pads
        self.copy_tied_head()
        self._head = self.head_projection()
        self._final_scale = 1.0 + self.model.norm.weight.float()
        if self._context:
            self.allocate_cache(self._context)

    def _pads_rows(self) -> bool:
        return PAD_PRODUCT_ROWS and self.device.type == "cuda"

    def prefill_row_buckets(self, chunk: int) -> list[int]:
        """The buckets its prefill products run at (PAD_PRODUCT_ROWS): a prompt of each, run once
        by the warm-up, meets every cuBLAS kernel a prompt of up to `chunk` tokens needs."""
        if not self._pads_rows():
            return []
        return buckets(min(chunk, self._context), self._context)

    @staticmethod
    def _plan(layer: DecoderLayer, top_k: int) -> LayerPlan:
        mixer: LinearPlan | AttentionPlan
        if hasattr(layer, "linear_attn"):
            mixer = linear_attention.plan_of(layer.linear_attn)
        else:
            mixer = attention.plan_of(layer.self_attn)
        plan = LayerPlan(
            mixer=mixer,
            input_scale=1.0 + layer.input_layernorm.weight.float(),
            post_scale=1.0 + layer.post_attention_layernorm.weight.float(),
        )
        if isinstance(layer.mlp, SparseMoeBlock):
            plan.moe = moe.plan_of(layer.mlp, top_k)
        else:
            plan.gate = projection_of(layer.mlp.gate_proj)
            plan.up = projection_of(layer.mlp.up_proj)
            plan.down = projection_of(layer.mlp.down_proj)
            fused = layer.fused.get("gate_up")
            if fused is not None:
                plan.gate_up = group_projection((layer.mlp.gate_proj, layer.mlp.up_proj), fused)
            plan.mlp_fits = all(
                p.weight_t is not None and dense_gemv.fits(p.weight_t.t())
                for p in (plan.gate, plan.up, plan.down)
            )
        plan.mixer_fits = isinstance(mixer, LinearPlan) and linear_attention.fits_one_row_kernels(mixer)
        return plan

    # --- the state ---------------------------------------------------------------------------

    def allocate_cache(self, context: int) -> None:
        """Allocate every layer's state for `context` positions (replacing any old one), zeroed,
        on each shard's device (state.py)."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        if self._inv_freq is None:
            raise RuntimeError("allocate_cache before finish_loading")
        self.free_cache()
        tables = rope_tables(self._inv_freq, context, self.dtype)
        for shard in self._shards:
            shard.allocate(self.config, context, self.dtype, copied_to(tables, shard.device))
        self._context = context
        self._length = 0

    def free_cache(self) -> None:
        for shard in self._shards:
            shard.free()
        self._context = 0
        self._length = 0

    def cache_bytes(self) -> int:
        return sum(shard.nbytes() for shard in self._shards)

    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """A linear layer's fixed-size state, a full layer's keys and values for `context` rows."""
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        linear_bytes = cfg.conv_channels * (cfg.conv_kernel - 1) * itemsize + (
            cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim * 4
        )
        full_bytes = 2 * cfg.num_kv_heads * context * cfg.head_dim * itemsize
        return [linear_bytes if kind == LINEAR else full_bytes for kind in cfg.layer_types]

    @property
    def length(self) -> int:
        """The positions the state holds: the next forward continues here (or starts over at 0)."""
        return self._length

    def set_length(self, length: int) -> None:
        self._length = length

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """The state after positions 0..length-1, as host tensors in layer order (a split joins its
        shards'): "kv" [full layers, 2, kv heads, length, head_dim], "conv" [linear layers,
        channels, kernel - 1] and "recurrent" [linear layers, heads, key_dim, value_dim] (float32).
        The recurrent layers hold only the current length, so `length` must be that (or 0: the
        empty state)."""
        if not self._context:
            raise RuntimeError("export_state before allocate_cache")
        if length not in (0, self._length):
            raise ValueError(
                f"Qwen3.5's state holds {self._length} positions and cannot be cut back to {length}"
            )
        state: dict[str, torch.Tensor] = {}
        for kind in self._kinds():
            parts = [shard.view(kind, length).to("cpu", copy=True) for shard in self._shards]
            joined = parts[0] if len(parts) == 1 else torch.cat(parts)
            state[kind] = joined.zero_() if length == 0 else joined
        return state

    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state, checked whole before anything is copied; afterwards the
        model continues at `length`."""
        if not self._context:
            raise RuntimeError("import_state before allocate_cache")
        if not 0 <= length <= self._context:
            raise ValueError(f"a state of {length} positions does not fit a context of {self._context}")
        for kind in self._kinds():
            views = [shard.view(kind, length) for shard in self._shards]
            shape = (sum(v.shape[0] for v in views), *views[0].shape[1:])
            got = state.get(kind)
            if got is None or tuple(got.shape) != shape:
                found = None if got is None else list(got.shape)
                raise ValueError(f"a '{kind}' state of shape {found} is not {length} positions of this model")
        for kind in self._kinds():
            start = 0
            for shard in self._shards:
                view = shard.view(kind, length)
                view.copy_(state[kind][start : start + view.shape[0]])  # onto the shard's device
                start += view.shape[0]
        self._length = length

    def _kinds(self) -> list[str]:
        """The state kinds this model has: "kv" with full layers, "conv" and "recurrent" with linear."""
        cfg = self.config
        return [k for k in KINDS if (cfg.full_layers if k == "kv" else cfg.linear_layers)]

    # --- speculation (speculative/rollback.py) --------------------------------------------------

    # A verify's rejected tail is undone without running the model again: the linear layers' state
    # is copied before the verify, and what the verify fed it is kept (LinearPlan.written); a
    # rejection restores the copy and runs the delta rule over the kept positions only. The full
    # layers' cache rows past the kept length are never read and are overwritten next.
    supports_speculation = True
    # The state only moves forward (forward continues at its length or restarts at 0), and a decode
    # graph's fused step records nothing for a roll-back: a draft of this family runs eagerly and
    # restarts from 0 rather than feed a position again (draft_model.py).
    rewinds = False

    def max_verify_tokens(self) -> int | None:
        return None

    def verify_checkpoint(self, start_pos: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Before positions start_pos.. are written (by one forward or several): every linear layer's
        window and recurrent matrix, copied; from here its forwards record what they feed it."""
        if start_pos != self._length:
            raise ValueError(f"a verify from position {start_pos} of a state holding {self._length}")
        saved = []
        for plan in self._linear_plans():
            assert plan.conv_state is not None and plan.recurrent is not None
            saved.append((plan.conv_state.clone(), plan.recurrent.clone()))
            plan.written = []
        return saved

    def verify_rollback(
        self, saved: list[tuple[torch.Tensor, torch.Tensor]], start_pos: int, kept: int
    ) -> None:
        """Only positions start_pos..start_pos+kept-1 of those written since the checkpoint stay: the
        state is rolled back to them exactly, and the model continues at start_pos + kept."""
        plans = self._linear_plans()
        written = self._length - start_pos
        try:
            if kept < written:
                for plan, (window, recurrent) in zip(plans, saved, strict=True):
                    linear_attention.roll_back(plan, window, recurrent, kept)
                self._length = start_pos + kept
        finally:
            for plan in plans:
                plan.written = None

    # Pieces of a whole delta-rule chunk: a follow-up's question is mostly one replay.
    prefill_piece_tokens = delta_rule.CHUNK

    def prefill_graphable(
        self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, span: int
    ) -> torch.Tensor | None:
        """See CausalLM.prefill_graphable: one shard, no MoE layer (their graphable path takes one
        token). The linear layers take only the first `count` tokens into their state (base.py's
        padding rule: the rest write nothing and decay nothing, and the convolution window ends at
        the last real token); from position 0 their state starts from zeros, as forward's does."""
        shard = self._graphable_shard(span)
        if shard is None:
            return None
        continues = pos != 0
        for plan in shard.linear_plans:
            assert plan.conv_state is not None and plan.recurrent is not None
            plan.conv_state.mul_(continues)
            plan.recurrent.mul_(continues)
        rows = pos + torch.arange(tokens.shape[0], device=pos.device)
        x = embed(self.model.embed_tokens, tokens)
        x = self._layers(shard, x, shard.tables.positions(rows, span), prefill=False, real=count)
        return self._logits(x.index_select(0, count - 1))[0]

    def verify_graphable(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor | None:
        """See CausalLM.verify_graphable: one shard, no MoE layer, as prefill_graphable. The linear
        layers record what they feed their state (LinearPlan.written) as forward does; under a
        graph's capture the records are kept by (tokens, span) for verify_replayed instead."""
        shard = self._graphable_shard(span)
        if shard is None:
            return None
        capturing = tokens.is_cuda and torch.cuda.is_current_stream_capturing()
        plans = shard.linear_plans
        kept = [plan.written for plan in plans]
        if capturing:  # the eager run before the capture recorded this verify already
            for plan in plans:
                plan.written = []
        rows = pos + torch.arange(tokens.shape[0], device=pos.device)
        x = embed(self.model.embed_tokens, tokens)
        try:
            x = self._layers(shard, x, shard.tables.positions(rows, span), prefill=False)
            if capturing:
                self._graph_written[(tokens.shape[0], span)] = [w for p in plans for w in p.written or []]
        finally:
            if capturing:
                for plan, written in zip(plans, kept, strict=True):
                    plan.written = written
        return self._logits(x)

    def verify_replayed(self, count: int, span: int) -> None:
        """After a replay of the verify graph of (count, span): what it fed each linear layer, for a
        roll-back, as an eager verify would have recorded it."""
        for plan, written in zip(self._linear_plans(), self._graph_written[(count, span)], strict=True):
            if plan.written is not None:
                plan.written.append(written)

    def _graphable_shard(self, span: int) -> Shard | None:
        """The one shard a graphable piece or verify runs on; None when split or with a MoE layer
        (their graphable path takes one token)."""
        if len(self._shards) != 1 or any(plan.moe is not None for plan in self._shards[0].plans):
            return None
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        assert self._shards[0].tables is not None
        return self._shards[0]

    def _linear_plans(self) -> list[LinearPlan]:
        return [plan for shard in self._shards for plan in shard.linear_plans]

    # --- running -----------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, continuing its state (start_pos 0
        starts over). Returns float32 logits: [V] for "last", [T, V] for "all", None for "none"."""
        if not self._context:
            raise RuntimeError("forward before allocate_cache")
        count = input_ids.shape[0]
        self.check_positions(start_pos, count)
        if start_pos == 0:
            for shard in self._shards:
                shard.reset()
            for plan in self._linear_plans():  # a verify left unsettled (an error) is void now
                plan.written = None
        elif start_pos != self._length:
            raise ValueError(
                f"Qwen3.5's state holds {self._length} positions; it cannot run from position {start_pos} "
                "(its linear-attention state only moves forward)"
            )
        rows = torch.arange(start_pos, start_pos + count, device=self.device)
        x = embed(self.model.embed_tokens, input_ids.to(self.device))
        for shard in self._shards:
            if not shard.first:
                x = base.hand_over(x, shard.device)
            assert shard.tables is not None
            x = self._layers(shard, x, shard.tables.positions(rows, start_pos + count), count > 1)
        self._length = start_pos + count
        if logits == "none":
            return None
        out = self._logits(x[-1:] if logits == "last" else x)
        if out.device != input_ids.device:
            out = out.to(input_ids.device)
        return out[0] if logits == "last" else out

    def decode_devices(self) -> list[torch.device]:
        return [shard.device for shard in self._shards]

    def decode_shard(
        self, index: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `index`'s part of the decode step: the first takes (token, pos), every later one
        the previous one's (hidden, pos); the last returns (logits,), the others (hidden, pos).
        Shapes depend on `span` only and nothing syncs with the host, so a CUDA graph can keep it;
        the state is updated in place. The caller tells the model its new length (set_length)."""
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        shard = self._shards[index]
        assert shard.tables is not None
        if index == 0:
            token, here = inputs
            x = embed(self.model.embed_tokens, token.view(1))
        else:
            x, here = inputs
        x = self._layers(shard, x, shard.tables.positions(here.view(1), span), prefill=False, graphable=True)
        if index + 1 < len(self._shards):
            return x, here
        assert self._head is not None
        head = self._head.weight_t
        if dense_gemv.enabled(x) and head is not None and dense_gemv.fits(head.t()) and x.dtype == head.dtype:
            # The final norm folded into the head's GEMV, float32 logits straight out of it.
            logits = x.new_empty((1, head.shape[1]), dtype=torch.float32)
            assert self._final_scale is not None
            scale = self._final_scale
            return (dense_gemv.norm_gemv(x, scale, head.t(), None, self.config.rms_norm_eps, logits)[0],)
        return (self._logits(x)[0],)

    def _layers(
        self,
        shard: Shard,
        x: torch.Tensor,
        at: Positions,
        prefill: bool,
        graphable: bool = False,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`graphable`: the decode step a CUDA graph keeps (decode_shard): nothing reads back to
        the host, so a MoE layer picks its experts by index on the device. `real`: only that many
        of x's rows (int64 [1] on the device) enter the linear layers' state (prefill_graphable)."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        fused = prefill and self.fused_attention
        # The graphable step on the GPU's one-row kernels: norms folded into the GEMVs that read them,
        # the residual added in place by the GEMVs that write it (so x must be this step's own tensor,
        # not a graph input a later shard was handed).
        kernels = graphable and x.shape[0] == 1 and dense_gemv.enabled(x)
        if kernels and not shard.first:
            x = x.clone()
        for plan in shard.plans:
            mixer = plan.mixer
            if (
                kernels
                and plan.mixer_fits
                and isinstance(mixer, LinearPlan)
                and mixer.written is None
                and linear_decode.enabled(x)
            ):
                x = linear_attention.decode_on_kernels(cfg, mixer, x, plan.input_scale, eps)
            elif isinstance(mixer, LinearPlan):
                normed = scaled_rms_norm(x, plan.input_scale, eps)
                x = linear_attention.forward(cfg, mixer, normed, x, real)
            else:
                x = attention.forward(cfg, mixer, scaled_rms_norm(x, plan.input_scale, eps), x, at, fused)
            if kernels and plan.mlp_fits:
                assert plan.gate is not None and plan.up is not None and plan.down is not None
                width = plan.gate.rows
                gate_up = x.new_empty((1, 2 * width))
                for part, columns in ((plan.gate, slice(0, width)), (plan.up, slice(width, 2 * width))):
                    assert part.weight_t is not None
                    dense_gemv.norm_gemv(
                        x, plan.post_scale, part.weight_t.t(), None, eps, gate_up[:, columns]
                    )
                assert plan.down.weight_t is not None  # silu(gate) * up is the GEMV's input
                x = dense_gemv.gemv_add_(x, gate_up, plan.down.weight_t.t(), None, silu=True)
                continue
            normed = scaled_rms_norm(x, plan.post_scale, eps)
            if plan.moe is not None:
                # Eager forwards (prefill and decode alike) group their tokens by expert with one
                # host read a layer; only the graphable step picks experts on the device.
                x = x + moe.forward(plan.moe, normed, graphable and plan.moe.stacked_gate_up is not None)
            elif plan.gate_up is not None:  # one product, SiLU · up as one kernel, the add in down's
                assert plan.down is not None
                x = plan.down.add_into(x, silu_mul(plan.gate_up(normed)))
            else:
                assert plan.gate is not None and plan.up is not None and plan.down is not None
                x = x + plan.down(F.silu(plan.gate(normed)) * plan.up(normed))
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head over hidden states [T, hidden] (on the last shard): float32 [T, V]."""
        assert self._head is not None
        assert self._final_scale is not None
        return self._head(scaled_rms_norm(x, self._final_scale, self.config.rms_norm_eps)).float()


def build(
    config: dict[str, Any],
    family: str,
    dtype: torch.dtype,
    quantized: bool = False,
    packed: Mapping[str, int] | None = None,
) -> Qwen35Model:
    """The registry's entry point: Qwen3.5 text, dense or MoE, for a config.json dict (text-only or
    the published vision-language one, whose text part is built)."""
    if quantized:
        raise load_failure(f"the {family} family does not keep FP8 / FP4 weights packed")
    return Qwen35Model(Qwen35Config.from_hf(config), dtype, packed)


def _projections(plan: LayerPlan) -> list[Projection]:
    """Every projection a layer's forward calls: its mixer's, then its MLP's or MoE block's."""
    mixer = plan.mixer
    if isinstance(mixer, LinearPlan):
        found = [mixer.qkv, mixer.z, mixer.b, mixer.a, mixer.out]
    else:
        found = [mixer.q, mixer.k, mixer.v, mixer.o]
    found += [p for p in (plan.gate, plan.up, plan.gate_up, plan.down) if p is not None]
    if plan.moe is not None:
        moe_plan = plan.moe
        found += [moe_plan.router, moe_plan.shared_gate_up, moe_plan.shared_down, moe_plan.shared_scale]
        found += [*moe_plan.gate_up, *moe_plan.down]
    return found
