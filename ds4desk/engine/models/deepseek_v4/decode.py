"""DeepSeek-V4's graphable decode step: one token, CUDA-graph capturable.

The same math as forward(token, pos, "last") with every position-dependent choice made by tensor
ops on `pos`, so one captured graph serves every position below its span: the ring row is pos mod
W, a compressor writes every step but only changes an entry when its window closes, and the
compressed rows a query may see are a mask over the static span // rate rows. Nothing here reads a
device value on the host or sizes a tensor by one.

The cache's host-side length cannot follow `pos` without a sync: a step leaves it invalid, and the
caller reports the new length with set_length(pos + 1) after the step (or its replay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from ds4desk.engine.kernels.deepseek_v4 import decode_index as v4_decode_index
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from ds4desk.engine.kernels.deepseek_v4.decode_attention import decode_attention
from ds4desk.engine.kernels.dense import gemv as decode_kernels
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.cache import CompressorState, LayerState, RopeTables, V4Cache
from ds4desk.engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Attention, Backbone, Compressor, Indexer
from ds4desk.engine.models.packed import embed


@dataclass(slots=True)
class _WindowStep:
    """A decode step's place in its compression window (shared by a layer's compressors)."""

    pos: torch.Tensor  # [1]: the step's position (all that the fused compressor step reads)
    # The rest only for the eager step (None when v4_compress_step fuses it):
    slot: torch.Tensor | None = None  # [1]: pos mod rate
    here: torch.Tensor | None = None  # [rate, 1]: the open window's row that pos fills
    closing: torch.Tensor | None = None  # [1]: pos ends its window
    window: torch.Tensor | None = None  # [1]: the row of pos's window (clamped to the last); None: no rows
    first: torch.Tensor | None = None  # [1]: pos is in window 0 (CSA: the overlap's predecessor)
    turn: torch.Tensor | None = None  # [1, r / 2]: the rotation at the window's start


class GraphableDecode:
    """DeepseekV4Model's graphable decode step (a mixin): decode_devices, decode_shard and
    set_length of the CausalLM contract (base.CausalLM.decode_graphable runs the shards). The layers
    use the model's hyper-connection sites (hyper.py) and _decode_moe (moe.py)."""

    config: DeepseekV4Config
    model: Backbone
    _cache: V4Cache | None
    _context: int
    _tables: RopeTables
    _steps: torch.Tensor | None
    _boundaries: dict[int, torch.device]
    _mtp_length: int
    _mtp_pending: torch.Tensor | None

    def decode_devices(self) -> list[torch.device]:
        """The device of every shard a decode step runs through, in order (one when unsplit)."""
        return [self.device, *self._boundaries.values()]

    def decode_shard(
        self, shard: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `shard`'s part of decode_graphable, all on its own device (so each shard can be a
        graph of its own): the first shard takes (token, pos), every later one the previous one's
        (streams, token, pos) copied to its device (the token for hash routing); the last returns
        (logits,), the others (streams, token, pos)."""
        cache = self._cache
        if cache is None or self._steps is None:
            raise RuntimeError("decode_graphable before allocate_cache")
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        cfg = self.config
        starts = [0, *self._boundaries]
        first = starts[shard]
        stop = starts[shard + 1] if shard + 1 < len(starts) else cfg.num_layers
        if shard == 0:
            token, pos = inputs
            cache.length = 0  # until set_length: forward and export_state refuse to continue from here
            x = embed(self.model.embed_tokens, token)  # [1, D]
            streams = x.unsqueeze(1).expand(1, cfg.hc_mult, cfg.hidden_size).contiguous()
        else:
            streams, token, pos = inputs
        if self._boundaries:
            self._use_device(streams.device)
        turns: dict[str, torch.Tensor] = {}  # the rotation at pos, per table: the same in every layer
        if v4_hc_fused.enabled(streams, cfg.hc_mult):
            streams, last = self._decode_layers_fused(first, stop, streams, token, pos, span, turns)
        else:
            last = None
            for index in range(first, stop):
                layer = self.model.layers[index]
                h, post, comb = self._hc_site(streams, layer.attn_hc, layer.input_layernorm.weight)
                y = self._decode_attention(index, layer.self_attn, h, pos, span, turns)
                streams = ops.expand(streams, y, post, comb)
                h, post, comb = self._hc_site(streams, layer.ffn_hc, layer.post_attention_layernorm.weight)
                streams = ops.expand(streams, self._decode_moe(layer.mlp, h, token), post, comb)
        if self._boundaries:
            self._use_device(self.device)
        if stop < cfg.num_layers:
            return (streams if last is None else ops.expand(streams, *last)), token, pos
        h = self._hc_head(streams) if last is None else self._hc_head_fused(streams, last)
        return (self._one_row_logits(h),)

    def _one_row_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head of one row h [1, D]: float32 logits [V]."""
        projection = self.head_projection()
        if projection.packed is not None:  # a GGUF's blocks: the GEMV writes float32 itself
            return projection(h, out=h.new_empty((1, projection.rows), dtype=torch.float32))[0]
        head = self.head_weight()
        if decode_kernels.one_row(h, head):
            return decode_kernels.gemv(h, head, h.new_empty((1, head.shape[0]), dtype=torch.float32))[0]
        return torch.mm(h, head.t()).float()[0]

    def _decode_layers_fused(
        self,
        first: int,
        stop: int,
        streams: torch.Tensor,
        token: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turns: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """decode_shard's layers with each hyper-connection site as two kernels (v4_hc_fused): a block's
        expand happens inside the next site, so this returns the streams before the last block's
        expand and that block's (y, post, comb) (None when there were no layers)."""
        last = None
        for index in range(first, stop):
            layer = self.model.layers[index]
            streams, h, post, comb = self._hc_site_fused(streams, last, layer.attn_hc, layer.input_layernorm)
            y = self._decode_attention(index, layer.self_attn, h, pos, span, turns)
            streams, h, post, comb = self._hc_site_fused(
                streams, (y, post, comb), layer.ffn_hc, layer.post_attention_layernorm
            )
            last = (self._decode_moe(layer.mlp, h, token), post, comb)
        return streams, last

    def set_length(self, length: int) -> None:
        """After decode_graphable steps: the cache now holds positions 0..length-1."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("set_length before allocate_cache")
        if not 0 < length <= self._context:
            raise ValueError(f"length must be in 1..{self._context}, got {length}")
        cache.length = length
        # A graphable step does not feed the MTP block (mtp.py): it is out of step from here.
        self._mtp_length, self._mtp_pending = -1, None

    def _decode_attention(
        self,
        index: int,
        attn: Attention,
        x: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turns: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        cfg = self.config
        layer_type = cfg.layer_types[index]
        heads, dim, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        table = "main" if layer_type == SLIDING else "compress"
        cos, sin = self._tables[table]
        if table not in turns:
            turns[table] = ops.rotation(cos.index_select(0, pos), sin.index_select(0, pos))  # [1, r / 2]
        turn = turns[table]

        if v4_norm_rope.enabled(x):
            # One kernel each, reading the table rows at pos itself (turn is for attention's rotation).
            rope = 2 * cos.shape[-1]
            q_a, kv = ops.q_a_kv(x, attn)
            q_res = v4_norm_rope.norm_rope(q_a, attn.q_a_norm.weight, eps, cos, sin, pos, 0, q_a.dtype)
            q = ops.linear(q_res, attn.q_b_proj).view(heads, dim)
            q = v4_norm_rope.norm_rope(q, None, eps, cos, sin, pos, rope, q.dtype)  # [H, d]
            kv = v4_norm_rope.norm_rope(kv, attn.kv_norm.weight, eps, cos, sin, pos, rope, kv.dtype)
        else:
            q_res = ops.rms_norm(ops.linear(x, attn.q_a_proj), attn.q_a_norm.weight, eps)
            q = ops.linear(q_res, attn.q_b_proj).view(heads, dim)
            q = ops.norm_rope(q, None, eps, turn)  # [H, d]
            kv = ops.norm_rope(ops.linear(x, attn.kv_proj), attn.kv_norm.weight, eps, turn)

        out = self._attend_one(index, attn, x, q_res, q, kv, pos, span, turn)

        low = ops.grouped_low_rank(out.view(1, -1), attn.o_a_proj, cfg.o_groups)  # heads are grouped
        return ops.linear(low, attn.o_b_proj)

    def _attend_one(
        self,
        index: int,
        attn: Attention,
        x: torch.Tensor,
        q_res: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turn: torch.Tensor,
    ) -> torch.Tensor:
        """One query's cache writes and attention at `pos` (int64 [1]): layer input x [1, D], its
        normed low-rank query q_res [1, r], rotated query q [H, d] and key kv [1, d]; the output
        [H, d] with the rope dims rotated back."""
        cfg, cache, steps = self.config, self._cache, self._steps
        assert cache is not None and steps is not None
        state, window = cache.layers[index], cfg.sliding_window
        # Write first, then attend over the whole ring in physical order: slot s holds the latest
        # position ≡ s (mod W), which is in this query's window, or was never written by this
        # request while pos < W - 1 (slots above pos: masked).
        ring, slot = state.ring, pos % window
        ring.index_copy_(0, slot, kv)
        extra = extra_ready = picks = None
        if attn.compressor is not None:
            extra, extra_ready, picks = self._decode_compressed(
                cfg.layer_types[index], attn.compressor, state, x, q_res, pos, span, turn
            )
        # One softmax over raw and compressed keys (each with the position from which it is
        # visible) and the per-head sink logit (no value), the rope dims rotated back: [H, d].
        return decode_attention(
            q, ring, steps[:window], extra, extra_ready, picks, attn.sinks, pos, cfg.head_dim**-0.5, turn
        )

    def _decode_compressed(
        self,
        layer_type: str,
        comp: Compressor,
        state: LayerState,
        x: torch.Tensor,
        q_res: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turn: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Feed the token to the compressor(s) and return the compressed keys with the positions
        from which each is visible, the first span // rate rows [rows, d] and [rows], and which of
        them attention scores: HCA every one (None), CSA the indexer's picks [k] (indices: the
        attention kernel gathers the rows itself; None, every one, while rows <= index_topk).
        (None, None, None) when the span holds no whole window."""
        cfg, steps = self.config, self._steps
        assert steps is not None
        assert state.entries is not None and state.compressor is not None
        rate = cfg.rate(layer_type)
        csa = layer_type == CSA
        # The compressor and the indexer's (CSA) share the window arithmetic: same rate, same rows.
        at = self._window_step(pos, rate, state.entries.shape[0], csa)
        self._decode_compress(comp, state.compressor, state.entries, x, at, csa)
        indexer = comp.indexer if csa else None
        if isinstance(indexer, Indexer):
            assert state.index_entries is not None and state.indexer is not None
            self._decode_compress(indexer, state.indexer, state.index_entries, x, at, True)
        rows = span // rate
        if rows == 0:  # pos < span <= rate - 1: no window has closed yet
            return None, None, None
        # Entry w pools tokens up to (w + 1) rate - 1: visible from that token on.
        ready = steps[rate - 1 : rows * rate : rate]  # [rows]
        entries = state.entries[:rows]
        if isinstance(indexer, Indexer) and rows > cfg.index_topk:  # else the top k would be every row
            assert state.index_entries is not None
            picks = self._decode_index(indexer, state.index_entries[:rows], x, q_res, pos, turn)
            return entries, ready, picks
        return entries, ready, None

    def _window_step(self, pos: torch.Tensor, rate: int, rows: int, overlap: bool) -> _WindowStep:
        steps = self._steps
        assert steps is not None
        if v4_compress_step.enabled(pos):
            return _WindowStep(pos)  # the fused step derives its window from pos on the device
        slot = pos % rate  # [1]
        step = _WindowStep(pos, slot, (steps[:rate] == slot).unsqueeze(1), slot == rate - 1)
        if rows:
            # Closing implies pos // rate < rows; otherwise the clamped row is rewritten unchanged.
            step.window = torch.clamp(torch.div(pos, rate, rounding_mode="floor"), max=rows - 1)
            step.first = pos < rate if overlap else None
            cos, sin = self._tables["compress"]
            start = pos - slot  # window * rate (when clamped, the entry is not written)
            step.turn = ops.rotation(cos.index_select(0, start), sin.index_select(0, start))
        return step

    def _decode_compress(
        self,
        comp: Compressor,
        state: CompressorState,
        rows: torch.Tensor,
        x: torch.Tensor,
        at: _WindowStep,
        overlap: bool,
    ) -> None:
        """_compress for one token without branches: the entry of the window holding pos is pooled
        every step and written back unchanged unless pos closes it; the open window takes the token
        unless it closes (as _compress, which keeps only a closed window's first halves, for CSA).
        Fused (v4_compress_step): the two projections, then one op for all the rest."""
        if at.slot is None or at.here is None or at.closing is None:
            self._compress_fused(comp, state, rows, x, at.pos)
            return
        kv = ops.linear(x, comp.kv_proj).float()  # [1, width]
        bias = comp.position_bias.index_select(0, at.slot)
        gate = torch.add(bias, ops.linear(x, comp.gate_proj))  # float32, as the bias
        win_kv = torch.where(at.here, kv, state.kv)  # the window holding pos, pos included: [rate, width]
        win_gate = torch.where(at.here, gate, state.gate)
        closing = at.closing
        dim = win_kv.shape[-1] // 2
        if at.window is not None and at.turn is not None:  # some rows exist
            pool_kv, pool_gate = win_kv, win_gate
            if overlap:
                # Entry w pools window w-1's first halves with window w's second halves; window 0
                # has no predecessor (weight 0: its carried kv is finite, so 0 * kv adds nothing).
                assert state.prev_kv is not None and state.prev_gate is not None and at.first is not None
                prev_gate = torch.where(at.first, -math.inf, state.prev_gate)
                pool_kv = torch.cat([state.prev_kv, win_kv[:, dim:]])  # [2 rate, dim]
                pool_gate = torch.cat([prev_gate, win_gate[:, dim:]])
            # Softmax over the last dim: over dim 0 CUDA runs a kernel 10x slower for this shape.
            pooled = (pool_kv.t() * torch.softmax(pool_gate.t(), dim=-1)).sum(dim=-1).unsqueeze(0)
            entry = ops.norm_rope(pooled, comp.kv_norm.weight, self.config.rms_norm_eps, at.turn, rows.dtype)
            window = at.window
            rows.index_copy_(0, window, torch.where(closing, entry, rows.index_select(0, window)))
        # In place (out= the tensor it keeps): one kernel each, no copy.
        if overlap:
            assert state.prev_kv is not None and state.prev_gate is not None
            torch.where(closing, win_kv[:, :dim], state.prev_kv, out=state.prev_kv)
            torch.where(closing, win_gate[:, :dim], state.prev_gate, out=state.prev_gate)
        torch.where(closing, state.kv, win_kv, out=state.kv)
        torch.where(closing, state.gate, win_gate, out=state.gate)

    def _compress_fused(
        self,
        comp: Compressor,
        state: CompressorState,
        rows: torch.Tensor,
        x: torch.Tensor,
        pos: torch.Tensor,
        stop: torch.Tensor | None = None,
    ) -> None:
        """The compressor op (v4_compress_step) for the tokens x [T, D] at pos.. (one for the
        decode step, a prompt piece's or verify step's all): the projections, then one op."""
        cos, sin = self._tables["compress"]
        v4_compress_step.compress_step(
            *v4_compress_step.projections(comp, x),
            comp.position_bias,
            comp.kv_norm.weight,
            state.kv,
            state.gate,
            state.prev_kv,
            state.prev_gate,
            rows,
            pos,
            cos,
            sin,
            self.config.rms_norm_eps,
            stop,
        )

    def _decode_index(
        self,
        indexer: Indexer,
        keys: torch.Tensor,
        x: torch.Tensor,
        q_res: torch.Tensor,
        pos: torch.Tensor,
        turn: torch.Tensor,
    ) -> torch.Tensor:
        """_index_select for one query over a fixed candidate count (rows > index_topk): the top
        index_topk of the rows by score [k], invisible candidates scored -inf (fewer visible than k:
        the rest are not, and attention masks them). `turn` is the compress table's rotation at `pos`."""
        cfg = self.config
        heads, dim = cfg.index_heads, cfg.index_head_dim
        q = ops.linear(q_res, indexer.q_b_proj).view(heads, dim)
        # The q·k products in the keys' dtype, summed in float32, as in prefill (_index_select).
        if v4_norm_rope.enabled(q):  # the rotation as one kernel, cast once to the keys' dtype
            cos, sin = self._tables["compress"]
            q = v4_norm_rope.norm_rope(q, None, None, cos, sin, pos, 2 * turn.shape[-1], keys.dtype)
        else:
            q = ops.rope_(q.float(), turn).to(keys.dtype)  # [Hi, di]
        # The weights' float32 cast and scale happen in the scoring kernel (two kernels fewer a step).
        weights = ops.index_head_weights(x, indexer)  # [1, Hi]
        scale = ops.index_weight_scale(heads, dim)
        rate, k = cfg.rate(CSA), cfg.index_topk
        if v4_decode_index.enabled(q):
            return v4_decode_index.decode_index(q, keys, weights, pos, rate, k, scale)
        return v4_decode_index.reference(q, keys, weights, pos, rate, k, scale)
