"""DeepSeek-V4's attention over a prefill chunk (any number of tokens at host-int positions).

A low-rank normed query, one shared K=V head, partial interleaved RoPE on the trailing dims (undone
on the output at the query position), a per-head sink logit and a grouped low-rank output
projection. Every layer attends to the raw keys of a sliding window (the cache's ring); CSA layers
add compressed entries (one per `csa_rate` tokens, overlapping windows) chosen per query by a
lightning indexer, HCA layers every compressed entry (one per `hca_rate` tokens).
"""

from __future__ import annotations

import math

import torch

from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from ds4desk.engine.kernels.deepseek_v4.prefill_attention import prefill_attention
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.cache import CompressorState, LayerState, RopeTables, V4Cache
from ds4desk.engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Attention, Compressor, Indexer


class PrefillAttention:
    """DeepseekV4Model's prefill attention methods (a mixin). `_compress` is also the reference the
    graphable decode step's compressor must equal."""

    config: DeepseekV4Config
    _cache: V4Cache | None
    _tables: RopeTables
    # Every compressed layer's inputs while a verify's checkpoint is open (verify.py), else None.
    _verify_inputs: dict[int, list[torch.Tensor]] | None = None

    def _attention(
        self,
        index: int,
        attn: Attention,
        x: torch.Tensor,
        start: int,
        own: tuple[LayerState, str] | None = None,
    ) -> torch.Tensor:
        """Layer `index`'s attention over the chunk x at start.. (`own`: the state and kind of a
        block outside the main stack, the MTP block, whose inputs are stashed under `index`)."""
        cfg, cache = self.config, self._cache
        assert cache is not None
        state, layer_type = own if own is not None else (cache.layers[index], cfg.layer_types[index])
        if self._verify_inputs is not None and attn.compressor is not None:
            # An open verify (verify.py): a roll-back feeds the kept rows to the compressor again.
            self._verify_inputs.setdefault(index, []).append(x)
        count = x.shape[0]
        dim, window = cfg.head_dim, cfg.sliding_window
        cos, sin = self._tables["main" if layer_type == SLIDING else "compress"]
        turn = ops.rotation(cos[start : start + count], sin[start : start + count])  # [T, r / 2]

        q_res, q, kv = self._queries_and_keys(attn, x, start, cos, sin, turn)

        # Raw keys: each query t sees exactly the W positions t - W + 1 .. t, so every query gets
        # a window of its own, rows t .. t + W - 1 of [padding | ring rows before this chunk, in
        # logical order | the chunk's keys]: W scores a query instead of the chunk's whole length.
        # The chunk goes into the ring only after the old rows were gathered, so early queries
        # still see keys a wrapped chunk overwrites.
        old = min(start, window - 1)
        pad = window - 1 - old  # slots before position 0: never visible
        device = x.device
        ring_rows = state.ring.index_select(0, torch.arange(start - old, start, device=device) % window)
        keys = torch.cat([kv.new_zeros((pad, dim)), ring_rows, kv])  # [W - 1 + T, d]
        kept = min(count, window)
        state.ring.index_copy_(
            0, torch.arange(start + count - kept, start + count, device=device) % window, kv[-kept:]
        )

        entries: torch.Tensor | None = None
        picks: torch.Tensor | None = None
        extra_bias: torch.Tensor | None = None
        if attn.compressor is not None:
            entries, picks, extra_bias = self._compressed_keys(
                layer_type, attn.compressor, state, x, q_res, start
            )
        # One softmax over raw keys, compressed keys and the per-head sink logit (no value); fused
        # on NVIDIA GPUs (v4_prefill_attention), where picked entries are read in place.
        out = prefill_attention(q, keys, pad, entries, picks, extra_bias, attn.sinks, dim**-0.5)
        # V = K carries the key's rotation; rotating back by the query's angle leaves relative ones.
        out = ops.rope_(out, torch.conj_physical(turn).unsqueeze(1))

        return self._output(attn, out)

    def _queries_and_keys(
        self,
        attn: Attention,
        x: torch.Tensor,
        start: int | torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        turn: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For rows x [T, D] at consecutive positions from `start` (a host int, or int64 [1] on the
        device): the normed low-rank query q_res [T, r], the rotated query q [T, H, d] and key kv
        [T, d]. `turn` [T, r / 2] is the rotation at each row's position (cos, sin: its table)."""
        cfg = self.config
        count, heads, dim, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        if v4_norm_rope.enabled(x):
            # One kernel each, without float32 copies of the [T, H, d] query.
            at = start if isinstance(start, torch.Tensor) else ops.position(start, x.device)
            rope = 2 * cos.shape[-1]
            q_a = ops.linear(x, attn.q_a_proj)
            q_res = v4_norm_rope.norm_rope(q_a, attn.q_a_norm.weight, eps, cos, sin, at, 0, q_a.dtype)
            q = ops.linear(q_res, attn.q_b_proj).view(count * heads, dim)
            q = v4_norm_rope.norm_rope(q, None, eps, cos, sin, at, rope, q.dtype, heads)
            q = q.view(count, heads, dim)
            kv = ops.linear(x, attn.kv_proj)
            kv = v4_norm_rope.norm_rope(kv, attn.kv_norm.weight, eps, cos, sin, at, rope, kv.dtype, 1)
        else:
            q_res = ops.rms_norm(ops.linear(x, attn.q_a_proj), attn.q_a_norm.weight, eps)
            q = ops.linear(q_res, attn.q_b_proj).view(count, heads, dim)
            q = ops.norm_rope(q, None, eps, turn.unsqueeze(1))
            kv = ops.norm_rope(ops.linear(x, attn.kv_proj), attn.kv_norm.weight, eps, turn)
        return q_res, q, kv

    def _output(self, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output projection of the attention output out [T, H, d]: [T, D]."""
        low = ops.grouped_low_rank(out, attn.o_a_proj, self.config.o_groups)
        return ops.linear(low, attn.o_b_proj)

    def _compressed_keys(
        self,
        layer_type: str,
        comp: Compressor,
        state: LayerState,
        x: torch.Tensor,
        q_res: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Feed the chunk to the layer's compressor(s) and return the compressed keys the chunk's
        queries score, the picks among them and the float32 bias (0 = visible, -inf = not): HCA
        every entry so far, [E, d], None and [T, E]; CSA the entries [E, d] with each query's
        indexer picks [T, k] and [T, k], so attention never scores the thousands of entries a long
        context has (no picks, as HCA, while there are no more entries than index_topk: the top k
        would be every one)."""
        cfg = self.config
        rate = cfg.rate(layer_type)
        assert state.entries is not None and state.compressor is not None
        self._compress(comp, state.compressor, state.entries, x, start, rate, layer_type == CSA)
        count = x.shape[0]
        available = (start + count) // rate
        entries = state.entries[:available]
        # Entry w pools tokens up to (w + 1) rate - 1: visible from that token on.
        visible = v4_index_scores.visible_entries(count, available, start, rate, x.device)
        picks: torch.Tensor | None = None
        if layer_type == CSA:
            indexer = comp.indexer
            assert isinstance(indexer, Indexer)
            assert state.index_entries is not None and state.indexer is not None
            self._compress(indexer, state.indexer, state.index_entries, x, start, rate, True)
            if available > cfg.index_topk:  # else the top k are all of them: attend to every one
                keys = state.index_entries[:available]
                picks, visible = self._index_select(indexer, keys, x, q_res, start, visible)
        bias = torch.zeros(visible.shape, device=x.device, dtype=torch.float32)
        return entries, picks, bias.masked_fill_(~visible, -math.inf)

    def _compress(
        self,
        comp: Compressor,
        state: CompressorState,
        rows: torch.Tensor,
        x: torch.Tensor,
        start: int,
        rate: int,
        overlap: bool,
    ) -> None:
        """Append the chunk's tokens to the open window and emit an entry for every window that
        closes (windows are anchored at multiples of `rate`, whatever the chunking). Decode and
        prefill share this path, so they pool identically."""
        count = x.shape[0]
        positions = torch.arange(start, start + count, device=x.device)
        kv = ops.linear(x, comp.kv_proj).float()
        gate = ops.linear(x, comp.gate_proj).float() + comp.position_bias[positions % rate]
        buffered = start % rate  # tokens of the open window that earlier calls saw
        kv = torch.cat([state.kv[:buffered], kv])
        gate = torch.cat([state.gate[:buffered], gate])
        closed = kv.shape[0] // rate
        used = closed * rate
        if closed:
            first = (start - buffered) // rate  # index of the first window closing now
            win_kv = kv[:used].view(closed, rate, -1)
            win_gate = gate[:used].view(closed, rate, -1)
            if overlap:
                dim = win_kv.shape[-1] // 2
                assert state.prev_kv is not None and state.prev_gate is not None
                # Entry w pools window w-1's first halves with window w's second halves.
                prev_kv = torch.cat([state.prev_kv.unsqueeze(0), win_kv[:-1, :, :dim]])
                prev_gate = torch.cat([state.prev_gate.unsqueeze(0), win_gate[:-1, :, :dim]])
                if first == 0:  # window 0 has no predecessor: weight 0
                    prev_kv[0] = 0.0
                    prev_gate[0] = -math.inf
                state.prev_kv.copy_(win_kv[-1, :, :dim])
                state.prev_gate.copy_(win_gate[-1, :, :dim])
                win_kv = torch.cat([prev_kv, win_kv[:, :, dim:]], dim=1)
                win_gate = torch.cat([prev_gate, win_gate[:, :, dim:]], dim=1)
            pooled = (win_kv * torch.softmax(win_gate, dim=1)).sum(dim=1)  # per-channel softmax
            cos, sin = self._tables["compress"]
            at = torch.arange(first, first + closed, device=x.device) * rate
            turn = ops.rotation(cos[at], sin[at])
            rows[first : first + closed] = ops.norm_rope(
                pooled, comp.kv_norm.weight, self.config.rms_norm_eps, turn
            )
        left = kv.shape[0] - used
        state.kv[:left] = kv[used:]
        state.gate[:left] = gate[used:]

    def _index_select(
        self,
        indexer: Indexer,
        keys: torch.Tensor,
        x: torch.Tensor,
        q_res: torch.Tensor,
        start: int | torch.Tensor,
        visible: torch.Tensor,
        turn: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer: per query, the top-k visible entries by Σ_h w_h · ReLU(q_h · k).
        Returns the picks [T, k] and whether each is visible (too few visible: some are not).
        `start`: a host int, or int64 [1] on the device (a graphed prompt piece: then `visible`
        masks the scores and `turn` [T, r / 2] is the compress table's rotation at each row)."""
        cfg = self.config
        count, heads, dim = x.shape[0], cfg.index_heads, cfg.index_head_dim
        rate = cfg.rate(CSA)
        cos, sin = self._tables["compress"]
        q = ops.linear(q_res, indexer.q_b_proj)
        if v4_norm_rope.enabled(q):  # rotated in float32, cast once to the keys' dtype, as below
            at = start if isinstance(start, torch.Tensor) else ops.position(start, x.device)
            q = v4_norm_rope.norm_rope(
                q.view(count * heads, dim), None, None, cos, sin, at, 2 * cos.shape[-1], keys.dtype, heads
            )
            q = q.view(count, heads, dim)
        else:
            if turn is None:
                assert isinstance(start, int)
                turn = ops.rotation(cos[start : start + count], sin[start : start + count])
            q = ops.rope_(q.view(count, heads, dim).float(), turn.unsqueeze(1))
        weights = ops.index_weights(x, indexer, heads, dim)  # [T, Hi]
        # The q·k products in the model's dtype (tensor cores for bf16), summed in float32; -inf
        # where `visible` is False (visible_entries' rule, from the positions). A device start
        # scores every entry (from a start at which all are visible) and masks after.
        q, total = q.to(keys.dtype), keys.shape[0]
        host = start if isinstance(start, int) else total * rate
        if v4_index_scores.enabled(q):
            scores = v4_index_scores.index_scores(q, keys, weights, host, rate)
        else:
            scores = v4_index_scores.reference(q, keys, weights, host, rate)
        if isinstance(start, torch.Tensor):
            scores.masked_fill_(~visible, -math.inf)
        picks = scores.topk(cfg.index_topk, dim=-1).indices  # callers: more entries than index_topk
        return picks, visible.gather(1, picks)
