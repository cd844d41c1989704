"""DeepSeek-V4's prompt piece and verify step as CUDA-graph capturable steps: a follow-up's
short suffix, and a speculative verify of a few drafted tokens.

A piece of T tokens (the model's prefill_piece_tokens, the first `count` real, the rest padding) at
device positions pos..pos+T-1 runs as prefill runs a chunk, every part once for all T rows: the
projections, the hyper-connection sites, the MoE, the head and the attention. Attention takes
prefill's layout and op: each query's window of raw keys from the ring's W - 1 positions before
the piece and the piece's own keys, masked from the device values (pos, and a pad for positions
before 0), so one captured graph serves every position. The compressors take all T tokens in one
op, in order; then every query scores the entries as they stand after the piece, an entry closed by
a later token being visible only from that token's position on. Padding changes nothing (`stop` =
pos + count): the ring keeps its old rows there and the compressor op skips it, since a padded
position would close windows and move the overlap state a later real token still needs.

The MoE runs every expert on all T rows, the unchosen weighing zero, where that reads no more than
the T tokens' own picks would (few experts, float weights; graph_dense_moe forces either way);
otherwise each row goes through the decode step's MoE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4 import moe_tail
from ds4desk.engine.kernels.deepseek_v4.prefill_attention import prefill_attention
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.cache import LayerState, RopeTables, V4Cache
from ds4desk.engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Attention, Backbone, Compressor, Indexer, Moe
from ds4desk.engine.models.packed import embed


@dataclass(slots=True)
class _PieceLayout:
    """What every layer of a piece shares, from the device values pos and stop: computed once a
    piece, not once a layer (each is a few small kernels, and a graph replays every one)."""

    positions: torch.Tensor  # [T]: pos, pos + 1, ..
    before: torch.Tensor  # [W - 1]: the ring slots of positions pos - W + 1 .. pos - 1, in order
    pad: torch.Tensor  # [1]: how many of those are before position 0 (never visible)
    # Slot s takes the key of the latest real position of the piece (below stop) that is s mod W,
    # if there is one: one rewrite of the whole ring, whatever T and W are, with no duplicate index
    # (T may exceed W) and no padding written.
    fresh: torch.Tensor  # [W, 1]: slot s takes a key of the piece
    rows: torch.Tensor  # [W]: which row of the piece (clamped into range where not fresh)
    # Per rope table: the rotation at each position [T, r / 2] and its conjugate (rotating back).
    turns: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per compression rate: which of the first span // rate entries each query sees [T, rows],
    # and the same as attention's float32 bias (0 or -inf).
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @staticmethod
    def of(window: int, pos: torch.Tensor, stop: torch.Tensor, size: int) -> _PieceLayout:
        steps = torch.arange(max(window, size), device=pos.device)
        before = torch.remainder(steps[1:window] - window + pos, window)
        latest = stop - 1 - torch.remainder(stop - 1 - steps[:window], window)  # [W]
        return _PieceLayout(
            pos + steps[:size],
            before,
            torch.clamp(window - 1 - pos, min=0),
            (latest >= pos).unsqueeze(1),
            torch.clamp(latest - pos, 0, size - 1),
        )


class GraphablePiece:
    """DeepseekV4Model's prefill_graphable and verify_graphable (a mixin over GraphableDecode,
    HyperConnectionSites and MixtureOfExperts)."""

    config: DeepseekV4Config
    model: Backbone
    _cache: V4Cache | None
    _context: int
    _tables: RopeTables
    _boundaries: dict[int, torch.device]
    _verify_inputs: dict[int, list[torch.Tensor]] | None
    _steps: torch.Tensor | None
    graph_dense_moe: bool | None
    mtp_tracking: bool
    # The compressed layers' inputs of each captured verify graph, by (tokens, span): static
    # buffers its replays rewrite (held here, so no later capture reuses their memory).
    _graph_verify_inputs: dict[tuple[int, int], dict[int, torch.Tensor]]

    def prefill_graphable(
        self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, span: int
    ) -> torch.Tensor | None:
        """See CausalLM.prefill_graphable: one shard only (a split runs pieces eagerly)."""
        if self._boundaries:
            return None
        return self._rows_graphable(tokens, pos, pos + count, span, count - 1, None)[0]

    def verify_graphable(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor | None:
        """See CausalLM.verify_graphable: a piece whose rows are all real, the head on every row.
        One shard, and not while the MTP block follows the target (a graph step does not feed it).
        A roll-back (verify.py) needs the compressed layers' inputs: an eager call hands them over
        as forward does, a graph's are kept by (tokens, span) for verify_replayed."""
        if self._boundaries or self.mtp_tracking:
            return None
        inputs: dict[int, torch.Tensor] = {}
        logits = self._rows_graphable(tokens, pos, pos + tokens.shape[0], span, None, inputs)
        if tokens.is_cuda and torch.cuda.is_current_stream_capturing():
            self._graph_verify_inputs[(tokens.shape[0], span)] = inputs
        elif self._verify_inputs is not None:
            self._verify_inputs = {index: [x] for index, x in inputs.items()}
        return logits

    def verify_replayed(self, count: int, span: int) -> None:
        """After a replay of the verify graph of (count, span): its compressed layers' inputs are
        what a roll-back recomputes from."""
        if self._verify_inputs is not None:
            self._verify_inputs = {i: [x] for i, x in self._graph_verify_inputs[(count, span)].items()}

    def _rows_graphable(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        stop: torch.Tensor,
        span: int,
        row: torch.Tensor | None,
        inputs: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Tokens [T] at device positions pos.., those from `stop` on padding; float32 logits of
        `row` [1, V] (None: of every row, [T, V]). `inputs` collects the compressed layers' inputs."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("a graphable piece before allocate_cache")
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        cfg = self.config
        size = tokens.shape[0]
        cache.length = 0  # until set_length: forward and export_state refuse to continue from here
        x = embed(self.model.embed_tokens, tokens)  # [T, D]
        streams = x.unsqueeze(1).expand(size, cfg.hc_mult, cfg.hidden_size).contiguous()
        piece = _PieceLayout.of(cfg.sliding_window, pos, stop, size)
        last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        fused = v4_hc_fused.enabled(streams, cfg.hc_mult)
        for index, layer in enumerate(self.model.layers):
            if fused:
                streams, h, post, comb = self._hc_site_fused(
                    streams, last, layer.attn_hc, layer.input_layernorm
                )
            else:
                h, post, comb = self._hc_site(streams, layer.attn_hc, layer.input_layernorm.weight)
            if inputs is not None and layer.self_attn.compressor is not None:
                inputs[index] = h
            y = self._piece_attention(index, layer.self_attn, h, pos, stop, span, piece)
            if fused:
                streams, h, post, comb = self._hc_site_fused(
                    streams, (y, post, comb), layer.ffn_hc, layer.post_attention_layernorm
                )
            else:
                streams = ops.expand(streams, y, post, comb)
                h, post, comb = self._hc_site(streams, layer.ffn_hc, layer.post_attention_layernorm.weight)
            y = self._piece_moe(layer.mlp, h, tokens)
            if fused:
                last = (y, post, comb)
            else:
                streams = ops.expand(streams, y, post, comb)
        if row is not None:
            streams = streams.index_select(0, row)
            if last is not None:
                y, post, comb = (t.index_select(0, row) for t in last)
                last = (y, post, comb)
        h = self._hc_head(streams) if last is None else self._hc_head_fused(streams, last)
        if row is not None:
            return self._one_row_logits(h).unsqueeze(0)
        return self.head_projection()(h).float()

    def _piece_attention(
        self,
        index: int,
        attn: Attention,
        x: torch.Tensor,
        pos: torch.Tensor,
        stop: torch.Tensor,
        span: int,
        piece: _PieceLayout,
    ) -> torch.Tensor:
        """Layer `index`'s attention for the piece x [T, D] at device positions pos.., laid
        out as prefill lays out a chunk (_attention), so prefill's attention op serves every query
        at once: the raw keys are the W - 1 positions before the piece (from the ring, in logical
        order; those before position 0 masked by a device-side pad) and the piece's own."""
        cfg, cache = self.config, self._cache
        assert cache is not None
        state, layer_type = cache.layers[index], cfg.layer_types[index]
        table = "main" if layer_type == SLIDING else "compress"
        cos, sin = self._tables[table]
        if table not in piece.turns:
            positions = piece.positions
            turn = ops.rotation(cos.index_select(0, positions), sin.index_select(0, positions))
            piece.turns[table] = (turn, torch.conj_physical(turn).unsqueeze(1))
        turn, back = piece.turns[table]
        q_res, q, kv = self._queries_and_keys(attn, x, pos, cos, sin, turn)
        ring = state.ring
        keys = torch.cat([ring.index_select(0, piece.before), kv])  # [W - 1 + T, d]
        torch.where(piece.fresh, kv.index_select(0, piece.rows), ring, out=ring)  # elementwise: in place
        entries = picks = bias = None
        if attn.compressor is not None:
            entries, picks, bias = self._piece_compressed(
                layer_type, attn.compressor, state, x, q_res, pos, stop, span, turn, piece
            )
        out = prefill_attention(q, keys, piece.pad, entries, picks, bias, attn.sinks, cfg.head_dim**-0.5)
        # V = K carries the key's rotation; rotating back by the query's angle leaves relative ones.
        out = ops.rope_(out, back)
        return self._output(attn, out)

    def _piece_compressed(
        self,
        layer_type: str,
        comp: Compressor,
        state: LayerState,
        x: torch.Tensor,
        q_res: torch.Tensor,
        pos: torch.Tensor,
        stop: torch.Tensor,
        span: int,
        turn: torch.Tensor,
        piece: _PieceLayout,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Feed the piece's real tokens to the layer's compressor(s) (one op each for all T), then
        what prefill's attention op takes for the first span // rate entries: the entries, CSA's
        indexer picks [T, k] (HCA: None) and the float32 bias (0 visible, -inf not). Every query
        sees the entries as they stand after the whole piece: an entry closed by a later token of
        the piece is visible only from that token on, and no entry changes once closed. (None,
        None, None) while the span holds no whole window."""
        cfg, steps = self.config, self._steps
        assert steps is not None
        assert state.entries is not None and state.compressor is not None
        rate = cfg.rate(layer_type)
        self._compress_fused(comp, state.compressor, state.entries, x, pos, stop)
        indexer = comp.indexer if layer_type == CSA else None
        if isinstance(indexer, Indexer):
            assert state.index_entries is not None and state.indexer is not None
            self._compress_fused(indexer, state.indexer, state.index_entries, x, pos, stop)
        rows = span // rate
        if rows == 0:
            return None, None, None
        if rate not in piece.masks:
            # Entry w pools tokens up to (w + 1) rate - 1: visible from that token on.
            visible = steps[rate - 1 : rows * rate : rate].unsqueeze(0) <= piece.positions.unsqueeze(1)
            piece.masks[rate] = (visible, torch.where(visible, 0.0, -math.inf))
        visible, bias = piece.masks[rate]
        if isinstance(indexer, Indexer) and rows > cfg.index_topk:  # else the top k would be every row
            assert state.index_entries is not None
            keys = state.index_entries[:rows]
            picks, visible = self._index_select(indexer, keys, x, q_res, pos, visible, turn)
            return state.entries[:rows], picks, torch.where(visible, 0.0, -math.inf)
        return state.entries[:rows], None, bias

    def _piece_moe(self, moe: Moe, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The MoE of the piece's rows x [T, D]: every expert at once where they are few and in a
        float dtype, GGUF experts read by id for all rows at once, else the decode step's MoE a row
        at a time."""
        cfg = self.config
        size, experts = x.shape[0], moe.experts
        if self._reads_by_id(moe, x):
            return self._moe_by_id(moe, x, *self._route(moe, x, tokens))
        dense = self.graph_dense_moe
        if dense is None:
            dense = cfg.num_experts <= size * cfg.experts_per_token
        if not dense or cfg.gguf_experts or experts.gate_up_proj.dtype == torch.uint8:
            return torch.cat([self._decode_moe(moe, x[t : t + 1], tokens[t : t + 1]) for t in range(size)])
        chosen, weights = self._route(moe, x, tokens)  # [T, k] each
        mixing = weights.new_zeros((size, cfg.num_experts)).scatter_(1, chosen, weights)  # [T, E]
        limit = cfg.swiglu_limit
        hidden = ops.swiglu(*torch.matmul(x, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1), limit)
        ys = torch.bmm(hidden, experts.down_proj.transpose(1, 2))  # [E, T, D]
        return moe_tail.combine(mixing, ys, ops.shared_expert(moe.shared_experts, x, limit))
