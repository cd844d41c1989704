"""DeepSeek-V4's prompt piece and verify step as CUDA-graph capturable steps: a follow-up's
short suffix, and a speculative verify of a few drafted tokens.

A piece of T tokens (the model's prefill_piece_tokens, the first `count` real, the rest padding) at
device positions pos..pos+T-1. What reads the weights runs once for all T rows: the projections,
the hyper-connection sites, the MoE and the head. What writes the cache runs a token at a time,
exactly as the graphable decode step (decode.py) does, so each query sees the ring and the
compressed rows as they stand after its own position: the ring slot is written, the compressors
fed, then the query attends. Padding changes nothing (`stop` = pos + count): its ring writes put
the old rows back and the compressor op skips it, since a padded position would close windows and
move the overlap state a later real token still needs.

The MoE runs every expert on all T rows, the unchosen weighing zero, where that reads no more than
the T tokens' own picks would (few experts, float weights; graph_dense_moe forces either way);
otherwise each row goes through the decode step's MoE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.cache import RopeTables, V4Cache
from ds4desk.engine.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Attention, Backbone, Moe


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
        positions = pos + torch.arange(size, device=pos.device)  # [T]
        x = F.embedding(tokens, self.model.embed_tokens.weight)  # [T, D]
        streams = x.unsqueeze(1).expand(size, cfg.hc_mult, cfg.hidden_size).contiguous()
        turns: dict[str, torch.Tensor] = {}  # the rotation at each position, per table: [T, r / 2]
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
            y = self._piece_attention(index, layer.self_attn, h, pos, positions, stop, span, turns)
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
        return torch.mm(h, self.head_weight().t()).float()

    def _piece_attention(
        self,
        index: int,
        attn: Attention,
        x: torch.Tensor,
        pos: torch.Tensor,
        positions: torch.Tensor,
        stop: torch.Tensor,
        span: int,
        turns: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Layer `index`'s attention for the piece x [T, D]: projections for all rows (prefill's
        _queries_and_keys and _output), the cache writes and attention a query at a time (decode's
        _attend_one)."""
        cfg = self.config
        table = "main" if cfg.layer_types[index] == SLIDING else "compress"
        cos, sin = self._tables[table]
        if table not in turns:
            turns[table] = ops.rotation(cos.index_select(0, positions), sin.index_select(0, positions))
        turn = turns[table]
        q_res, q, kv = self._queries_and_keys(attn, x, pos, cos, sin, turn)
        out = torch.stack(
            [
                self._attend_one(
                    index,
                    attn,
                    x[t : t + 1],
                    q_res[t : t + 1],
                    q[t],
                    kv[t : t + 1],
                    positions[t : t + 1],
                    span,
                    turn[t : t + 1],
                    stop,
                )
                for t in range(x.shape[0])
            ]
        )  # [T, H, d]
        return self._output(attn, out)

    def _piece_moe(self, moe: Moe, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The MoE of the piece's rows x [T, D]: every expert at once where they are few and in a
        float dtype, else the decode step's MoE a row at a time."""
        cfg = self.config
        size, experts = x.shape[0], moe.experts
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
        routed = torch.einsum("te,etd->td", mixing, ys.float()).to(x.dtype)
        return routed + ops.shared_expert(moe.shared_experts, x, limit)
