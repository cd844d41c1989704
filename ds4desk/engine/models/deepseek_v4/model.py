"""DeepSeek-V4 (Flash / Pro): a hyper-connected MoE decoder with three attention kinds.

What differs from the dense family:

- The residual is `hc_mult` parallel streams mixed by manifold-constrained hyper-connections
  (mHC): each block reads a weighted sum of the streams and writes back `post * y + Cᵀ X`, with C
  made doubly stochastic by Sinkhorn iterations (float32). See hyper.py.
- Attention has a low-rank normed query, one shared K=V head, partial interleaved RoPE on the
  trailing dims (undone on the output at the query position), a per-head sink logit and a
  grouped low-rank output projection.
- Every layer attends to the raw keys of a sliding window. CSA layers add compressed entries
  (one per 4 tokens, overlapping windows) chosen per query by a lightning indexer; HCA layers add
  every compressed entry (one per 128 tokens). See attention.py.
- Every FFN is a MoE: hash-routed (a token-id table) in the first layers, score-routed after. See
  moe.py.

Parameter names equal transformers' DeepseekV4ForCausalLM state-dict names (modules.py), so a
folder in that layout loads by name; the other layouts are mapped onto them
(loading/deepseek_v4_names.py). The checkpoint's MTP blocks, if any, are kept under `mtp.K.`.
Batch is always 1: activations are [T, hidden], streams [T, hc_mult, hidden].

The cache (cache.py) is plain tensors allocated once for the context. Calls must be contiguous
(start 0, or where the last call ended), so nothing stale is ever read: every row a query can see
was written by this request.

This module holds the model itself: loading and placement, the cache's allocation, export and
import, and the prefill forward. The layer math lives in mixins, one job each: HyperConnectionSites
(hyper.py), PrefillAttention (attention.py), MixtureOfExperts (moe.py), GraphableDecode
(decode.py, the CUDA-graph capturable step) and GraphablePiece (piece.py, a capturable prompt piece);
ops.py has the math on tensors they share.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.models import base  # base.hand_over looked up per call: one place to spy on
from ds4desk.engine.models.base import CausalLM, LogitsMode
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.attention import PrefillAttention
from ds4desk.engine.models.deepseek_v4.cache import (
    LayerState,
    RopeTables,
    V4Cache,
    layer_cache_bytes,
    new_layer_state,
)
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.decode import GraphableDecode
from ds4desk.engine.models.deepseek_v4.hyper import HyperConnectionSites
from ds4desk.engine.models.deepseek_v4.modules import (
    Attention,
    Backbone,
    Compressor,
    Layer,
    MtpBlock,
    SharedExpert,
    check_hash_table,
    linear_weight,
)
from ds4desk.engine.models.deepseek_v4.moe import MixtureOfExperts
from ds4desk.engine.models.deepseek_v4.mtp import MtpTracking
from ds4desk.engine.models.deepseek_v4.piece import GraphablePiece
from ds4desk.engine.models.deepseek_v4.verify import VerifyRollback
from ds4desk.engine.models.packed import embed, hold_device_rows
from ds4desk.engine.models.row_buckets import buckets
from ds4desk.engine.split import materialize_parameters


class DeepseekV4Model(
    HyperConnectionSites,
    PrefillAttention,
    MixtureOfExperts,
    GraphableDecode,
    GraphablePiece,
    VerifyRollback,
    MtpTracking,
    CausalLM,
):
    """The CausalLM of the DeepSeek-V4 family; the mixins before CausalLM hold the layer math and
    read the state this class keeps: the cache, the rope tables and steps of the current device, and
    the shard boundaries of a split."""

    def __init__(
        self,
        config: DeepseekV4Config,
        dtype: torch.dtype = torch.float32,
        quantized: bool = False,
        packed: Mapping[str, int] | None = None,
    ) -> None:
        """`quantized`: the linears the official checkpoint stores in FP8 stay FP8 (Fp8Weight) and
        the routed experts packed FP4; everything else, and all activations, in `dtype`. `packed`:
        the GGUF block type of each weight a GGUF file stores in blocks; the routed experts, the
        linears (modules.linear_weight), the head and the embedding keep them."""
        super().__init__(config, dtype)
        self.quantized = quantized
        self.model = Backbone(config, dtype, quantized, packed)
        if not config.tie_word_embeddings:  # else None (base): the embedding is the head
            head = (config.vocab_size, config.hidden_size)
            self.lm_head = linear_weight(head, dtype, False, packed, "lm_head")
        # The checkpoint's MTP blocks (`mtp.K.*`, none unless it holds some): loaded and kept, in the
        # weight bytes and on the last shard of a split; the speculative MTP drafter runs the first
        # (mtp.py).
        self.mtp = nn.ModuleList(
            MtpBlock(config, k, dtype, quantized, packed) for k in range(len(config.mtp_layer_types))
        )
        self._inv_freq: dict[str, torch.Tensor] = {}
        self._tables: RopeTables = {}
        self._cache: V4Cache | None = None
        # 0, 1, 2, ...: the index constants the graphable decode slices (never built inside a capture).
        self._steps: torch.Tensor | None = None
        # A layer split (ds4desk.engine.split): the first layer of every later shard -> its device,
        # and per device the rope tables and steps its layers read (copies of the first device's).
        self._boundaries: dict[int, torch.device] = {}
        self._per_device: dict[torch.device, tuple[RopeTables, torch.Tensor]] = {}
        # Speculative decoding (verify.py, mtp.py): an open verify's stashed compressor inputs, and
        # the MTP block's cache while it follows the target.
        self._verify_inputs: dict[int, list[torch.Tensor]] | None = None
        self._graph_verify_inputs: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        self._mtp_state = None

    @property
    def cache(self) -> V4Cache | None:
        return self._cache

    # --- loading -----------------------------------------------------------------------------

    def materialize(self, device: torch.device) -> None:
        """Give every parameter real (uninitialised) storage on `device` (or where the split puts
        it), keeping its dtype."""
        split = self._split
        # The compressors the loader fills: kv_proj and gate_proj become the row halves of one
        # tensor, so a decode step projects once (v4_compress_step.projections); likewise the
        # shared experts' gate_proj and up_proj (SharedExpert.gate_up) and attention's q_a_proj
        # and kv_proj (Attention.q_a_kv).
        fresh = [m for m in self.modules() if isinstance(m, Compressor) and m.kv_proj.weight.is_meta]
        shared = [m for m in self.modules() if isinstance(m, SharedExpert) and m.gate_proj.weight.is_meta]
        attention = [m for m in self.modules() if isinstance(m, Attention) and m.q_a_proj.weight.is_meta]
        materialize_parameters(self, device, split)
        for comp in fresh:
            v4_compress_step.fuse_projections(comp)
        for expert in shared:
            expert.join_gate_up()
        for attn in attention:
            attn.join_q_a_kv()

    def finish_loading(self) -> None:
        """After the weights are in: check the hash tables and derive the rope frequencies."""
        cfg = self.config
        blocks = [(f"model.layers.{i}", layer) for i, layer in enumerate(self.model.layers)]
        blocks += [(f"mtp.{k}", block) for k, block in enumerate(self.mtp)]
        for prefix, layer in blocks:
            table = getattr(layer.mlp.gate, "tid2eid", None)
            if table is not None:
                check_hash_table(f"{prefix}.mlp.gate.tid2eid", table, cfg.num_experts)
        device = self.device
        self._inv_freq = {
            "main": cfg.main_rope.inverse_frequencies(device),
            "compress": cfg.compress_rope.inverse_frequencies(device),
        }
        self._boundaries = {}
        if self._split is not None:
            for start, _stop in self._split.bounds()[1:]:
                self._boundaries[start] = self.model.layers[start].input_layernorm.weight.device
        self.copy_tied_head()
        hold_device_rows(self)  # a GGUF's Q8_0 linears in the GPU's row layout
        if self._context:
            self.allocate_cache(self._context)

    # --- cache -------------------------------------------------------------------------------

    def allocate_cache(self, context: int) -> None:
        """Allocate every layer's state and the rope tables for `context` positions."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        if not self._inv_freq:
            raise RuntimeError("allocate_cache before finish_loading")
        cfg = self.config
        self.free_cache()
        device = self.device
        positions = torch.arange(context, device=device, dtype=torch.float32)
        for kind, rope in (("main", cfg.main_rope), ("compress", cfg.compress_rope)):
            angles = torch.outer(positions, self._inv_freq[kind])
            self._tables[kind] = (angles.cos() * rope.attention_factor, angles.sin() * rope.attention_factor)
        layers = [
            # Each layer's state on its shard's device (the only one, unsplit).
            new_layer_state(cfg, layer_type, context, self.dtype, layer.input_layernorm.weight.device)
            for layer_type, layer in zip(cfg.layer_types, self.model.layers, strict=True)
        ]
        self._cache = V4Cache(layers)
        self._context = context
        longest = max(context, cfg.sliding_window, cfg.csa_rate, cfg.hca_rate)
        self._steps = torch.arange(longest, device=self.device)
        # Other devices read copies of the first device's tables: bit-identical angles everywhere.
        self._per_device = {self.device: (self._tables, self._steps)}
        for shard_device in self._boundaries.values():
            if shard_device not in self._per_device:
                tables = {
                    k: (c.to(shard_device, copy=True), s.to(shard_device, copy=True))
                    for k, (c, s) in self._tables.items()
                }
                self._per_device[shard_device] = (tables, self._steps.to(shard_device, copy=True))

    def free_cache(self) -> None:
        self._cache = None
        self._verify_inputs = None
        self._graph_verify_inputs = {}  # the graphs go with the cache
        self.set_mtp_tracking(False)  # its cache was sized for this context: asked for again per request
        self._tables = {}
        self._per_device = {}
        self._context = 0
        self._steps = None

    def _use_device(self, device: torch.device) -> None:
        """Point the rope tables and steps the layer code reads at `device`'s copies (a split's
        shard boundary; the layer code itself stays device-agnostic)."""
        self._tables, self._steps = self._per_device[device]

    def cache_bytes(self) -> int:
        if self._cache is None:
            return 0
        mtp = self._mtp_state  # the MTP block's own cache while it follows the target (mtp.py)
        extra = 0 if mtp is None else sum(t.numel() * t.element_size() for t in mtp.tensors())
        return self._cache.nbytes() + extra

    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """cache_bytes_for per layer (a split plan places each with its layer)."""
        return layer_cache_bytes(self.config, self.dtype, context)

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """The state after positions 0..length-1, as host tensors: the raw window in logical order
        (oldest position first), the closed compressed and indexer rows, the compressors' carry,
        and the MTP block's while it follows the target (mtp.py).
        Only the current position can be exported: older raw rows are already overwritten."""
        cache = self._cache
        assert cache is not None
        if length != cache.length:
            raise EngineFailure(
                ErrorCode.INVALID_SNAPSHOT_SLOT,
                f"DeepSeek-V4 can snapshot its current position {cache.length}, not {length}",
            )
        state: dict[str, torch.Tensor] = {}
        for i, (layer, kind) in enumerate(zip(cache.layers, self.config.layer_types, strict=True)):
            state.update(self._export_layer(str(i), layer, kind, length))
        state.update(self._mtp_export(length))
        return state

    def _export_layer(
        self, prefix: str, layer: LayerState, kind: str, length: int
    ) -> dict[str, torch.Tensor]:
        """One layer's part of export_state (a copy also on the CPU: the cache changes on)."""
        window = self.config.sliding_window
        logical = [p % window for p in range(max(0, length - window), length)]
        state = {f"{prefix}.ring": layer.ring[logical].to("cpu", copy=True)}
        if layer.entries is not None:
            rows = length // self.config.rate(kind)
            state[f"{prefix}.entries"] = layer.entries[:rows].to("cpu", copy=True)
            if layer.index_entries is not None:
                state[f"{prefix}.index_entries"] = layer.index_entries[:rows].to("cpu", copy=True)
        for name, carry in (("compressor", layer.compressor), ("indexer", layer.indexer)):
            if carry is not None:
                for j, tensor in enumerate(carry.tensors()):
                    state[f"{prefix}.{name}.{j}"] = tensor.to("cpu", copy=True)
        return state

    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state; afterwards the model continues at `length`."""
        cache = self._cache
        assert cache is not None
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(cache.layers):
            copies += self._layer_copies(str(i), layer, state, length)
        copies += self._mtp_import(state, length)
        # A multi-tensor copy per dtype: a follow-up turn restores dozens of small tensors, and a
        # copy each cost more in launches than in bytes. torch copies a list in one kernel only when
        # all its tensors share a dtype; mixed, it falls back to a copy each.
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in copies:
            by_dtype.setdefault((dst.dtype, src.dtype), []).append((dst, src))
        for group in by_dtype.values():
            torch._foreach_copy_([dst for dst, _ in group], [src for _, src in group])
        cache.length = length

    def _layer_copies(
        self, prefix: str, layer: LayerState, state: dict[str, torch.Tensor], length: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs that put one layer's part of export_state back."""
        window = self.config.sliding_window
        ring = state[f"{prefix}.ring"]  # logical order: position max(0, length - window) first
        first = (length - ring.shape[0]) % window  # its row; the rows after it wrap around
        head = min(ring.shape[0], window - first)
        copies = [(layer.ring[first : first + head], ring[:head])]
        if head < ring.shape[0]:
            copies.append((layer.ring[: ring.shape[0] - head], ring[head:]))
        for name in ("entries", "index_entries"):
            target = getattr(layer, name)
            if target is not None:
                rows = state[f"{prefix}.{name}"]
                copies.append((target[: rows.shape[0]], rows))
        for name, carry in (("compressor", layer.compressor), ("indexer", layer.indexer)):
            if carry is not None:
                tensors = carry.tensors()
                copies += [(tensor, state[f"{prefix}.{name}.{j}"]) for j, tensor in enumerate(tensors)]
        return copies

    def prefill_row_buckets(self, chunk: int) -> list[int]:
        """The buckets its prefill products run at (ops.PAD_PRODUCT_ROWS): a prompt of each, run
        once by the warm-up, meets every cuBLAS kernel a prompt of up to `chunk` tokens needs. None
        for weights kept in FP8, FP4 or GGUF blocks: their products run on kernels of their own,
        and a bucket's prompt would cost a large model's warm-up a prefill for the few left."""
        if not ops.pads_rows(self.device) or self._keeps_quantized():
            return []
        return buckets(min(chunk, self._context), self._context)

    def _keeps_quantized(self) -> bool:
        held = itertools.chain(self.parameters(), self.buffers())
        return any(t.dtype in (torch.uint8, torch.float8_e4m3fn) for t in held)

    # --- forward -----------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, updating the cache. start_pos is 0
        (a new request) or where the previous call ended. Returns float32 logits: [V] for "last",
        [T, V] for "all", None for "none"."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("forward before allocate_cache")
        count = input_ids.shape[0]
        self.check_positions(start_pos, count)
        if start_pos not in (0, cache.length):
            raise EngineFailure(
                ErrorCode.BAD_REQUEST,
                f"DeepSeek-V4 continues at position {cache.length} or restarts at 0, not at {start_pos}",
            )
        cfg = self.config
        cache.length = 0  # until this call completes, the state is not a valid continuation
        if start_pos == 0:
            # A new request: whatever a failed verify left open is over.
            self._verify_inputs, self._mtp_rows = None, None
        ids = input_ids.to(self.device)  # the caller's device may be another shard's
        x = embed(self.model.embed_tokens, ids)  # [T, D]
        streams = x.unsqueeze(1).expand(count, cfg.hc_mult, cfg.hidden_size).contiguous()
        if self._boundaries:
            self._use_device(self.device)
        # Fused sites (v4_hc_fused): a block's expand happens inside the next site, so `last` holds
        # the previous block's (y, post, comb) until then.
        fused = v4_hc_fused.enabled(streams, cfg.hc_mult)
        last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        for index, layer in enumerate(self.model.layers):
            if index in self._boundaries:
                # A shard boundary: the next layers need the streams and the token ids (hash
                # routing); positions are host ints here. Copies, never aliases.
                if last is not None:
                    streams, last = ops.expand(streams, *last), None
                device = self._boundaries[index]
                streams, ids = base.hand_over(streams, device), base.hand_over(ids, device)
                self._use_device(device)
            if fused:
                streams, last = self._block_fused(index, layer, streams, last, ids, start_pos)
            else:
                streams = self._block(index, layer, streams, ids, start_pos)
        if self._boundaries:
            self._use_device(self.device)
        if self._mtp_state is not None:
            # The MTP block follows the target's final streams (mtp.py), one position behind.
            final = streams if last is None else ops.expand(streams, *last)
            self._mtp_follow(final, ids, start_pos)
        cache.length = start_pos + count
        if logits == "none":
            return None
        if logits == "last":
            streams = streams[-1:]
            last = None if last is None else (last[0][-1:], last[1][-1:], last[2][-1:])
        h = self._hc_head(streams) if last is None else self._hc_head_fused(streams, last)
        return self.logits_from(h, logits, input_ids)  # split: back where the ids came from

    def _block(
        self, index: int, layer: Layer, streams: torch.Tensor, ids: torch.Tensor, start: int
    ) -> torch.Tensor:
        """One layer over a chunk: attention, then the MoE, each read from and written back into the
        streams by its hyper-connection site."""
        h, post, comb = self._hc_site(streams, layer.attn_hc, layer.input_layernorm.weight)
        streams = ops.expand(streams, self._attention(index, layer.self_attn, h, start), post, comb)
        h, post, comb = self._hc_site(streams, layer.ffn_hc, layer.post_attention_layernorm.weight)
        return ops.expand(streams, self._moe(layer.mlp, h, ids), post, comb)

    def _block_fused(
        self,
        index: int,
        layer: Layer,
        streams: torch.Tensor,
        last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        ids: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """_block with fused sites: expands `last` (the previous block's (y, post, comb)) first and
        returns the streams before its own expand, with its own (y, post, comb)."""
        streams, h, post, comb = self._hc_site_fused(streams, last, layer.attn_hc, layer.input_layernorm)
        y = self._attention(index, layer.self_attn, h, start)
        streams, h, post, comb = self._hc_site_fused(
            streams, (y, post, comb), layer.ffn_hc, layer.post_attention_layernorm
        )
        return streams, (self._moe(layer.mlp, h, ids), post, comb)


def build(
    config: dict[str, Any],
    family: str,
    dtype: torch.dtype,
    quantized: bool = False,
    packed: Mapping[str, int] | None = None,
) -> DeepseekV4Model:
    """The registry's entry point: the model for a config.json dict (`quantized`: FP8 / FP4 kept)."""
    return DeepseekV4Model(DeepseekV4Config.from_hf(config), dtype, quantized, packed)
