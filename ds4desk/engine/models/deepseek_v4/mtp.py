"""DeepSeek-V4's multi-token-prediction (MTP) block as a drafter: its forward, its own cache, and
how that cache follows the target.

The block (modules.MtpBlock, DeepSeek's published semantics) at position i reads the main model's
final streams at i (after the last layer, before the head's collapse) and the embedding of token
i + 1: each stream RMS-normed with `hnorm` and projected by `h_proj`, plus the `enorm`-normed
embedding projected by `e_proj` (the same for every stream). One full V4 layer runs on that, with
its own attention cache (positions are the block's i, as the main model's), and its own stream
head and norm feed the main model's head: the logits for token i + 2. Chained for more drafts,
the block's output streams stand in for the main model's at the next position.

Following the target: the entry at i needs token i + 1, so the block runs one position behind.
While tracking is on (set_mtp_tracking, before the request's prefill), every forward of the
target feeds the block the positions whose next token it now knows, and keeps the last position's
streams (`pending`) for the entry the next token completes. A verify forward's rows past the
accepted ones roll back with the target's (verify.py); drafting itself writes only positions the
drafter then rolls back, so the block's cache always holds exactly the target's accepted history.
A forward that does not feed it (a captured decode step, a snapshot without its state) leaves it
out of step until the next request starts at position 0: then it drafts nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.cache import LayerState, V4Cache, new_layer_state
from ds4desk.engine.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Backbone, MtpBlock
from ds4desk.engine.models.deepseek_v4.verify import (
    MTP_KEY,
    LayerCheckpoint,
    VerifyCheckpoint,
    checkpoint_layer,
    restore_layer,
)
from ds4desk.engine.models.packed import embed

# Chooses a draft from the block's logits [V] (greedy argmax or a draw): a 0-d long tensor.
Choose = Callable[[torch.Tensor], torch.Tensor]


class MtpTracking:
    """DeepseekV4Model's MTP methods (a mixin)."""

    config: DeepseekV4Config
    model: Backbone
    mtp: nn.ModuleList
    dtype: torch.dtype
    _cache: V4Cache | None
    _context: int
    _boundaries: dict[int, torch.device]
    _verify_inputs: dict[int, list[torch.Tensor]] | None

    # Set by set_mtp_tracking: the block's cache (None: not tracking), how many positions it holds
    # (-1: out of step with the target), and the target's streams at its last position [1, m, D].
    _mtp_state: LayerState | None = None
    _mtp_length: int = -1
    _mtp_pending: torch.Tensor | None = None
    # The target's final streams of an open verify's rows (a roll-back keeps the last kept one's).
    _mtp_rows: list[torch.Tensor] | None = None

    @property
    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    @property
    def mtp_tracking(self) -> bool:
        return self._mtp_state is not None

    def set_mtp_tracking(self, on: bool) -> None:
        """Feed the MTP block from every forward (on) or not (off, the default: it costs a layer).
        Turned on, it follows from the next forward at position 0 (or a snapshot that has its state)."""
        if on and not self.has_mtp:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "this model has no MTP block")
        self._mtp_length, self._mtp_pending, self._mtp_rows = -1, None, None
        if not on:
            self._mtp_state = None
            return
        if self._cache is None:
            raise RuntimeError("set_mtp_tracking before allocate_cache")
        if self._mtp_state is None:  # sized for this context (free_cache turns tracking off)
            kind = self.config.mtp_layer_types[0]
            device = self._mtp_block().input_layernorm.weight.device
            self._mtp_state = new_layer_state(self.config, kind, self._context, self.dtype, device)

    def _mtp_block(self) -> MtpBlock:
        block = self.mtp[0]
        assert isinstance(block, MtpBlock)
        return block

    def mtp_ready(self, length: int) -> bool:
        """Whether the block can draft after the target's first `length` positions: it follows
        the target and holds the positions before the last one."""
        cache = self._cache
        return (
            self._mtp_state is not None
            and cache is not None
            and length >= 1
            and cache.length == length
            and self._mtp_length == length - 1
            and self._mtp_pending is not None
        )

    # --- following the target ------------------------------------------------------------------

    def _mtp_follow(self, streams: torch.Tensor, ids: torch.Tensor, start: int) -> None:
        """After the target's forward of ids at start.. with final streams [T, m, D]: feed the
        block every position whose next token is now known and keep the last one's streams."""
        if start == 0:
            hidden, tokens, at = streams[:-1], ids[1:], 0
        elif self._mtp_length == start - 1 and self._mtp_pending is not None:
            hidden, tokens, at = torch.cat([self._mtp_pending, streams[:-1]]), ids, start - 1
        else:
            self._mtp_out_of_step()
            return
        state = self._mtp_state
        assert state is not None
        if hidden.shape[0]:
            self._mtp_forward(hidden, tokens, at, state)
        self._mtp_length = at + hidden.shape[0]
        self._mtp_pending = streams[-1:].clone()  # not a view: it would keep the whole chunk alive
        if self._mtp_rows is not None:
            self._mtp_rows.append(streams)

    def _mtp_out_of_step(self) -> None:
        self._mtp_length, self._mtp_pending = -1, None

    def _mtp_verify_checkpoint(self, start: int, count: int) -> LayerCheckpoint | None:
        """verify_checkpoint's MTP part: the block's next forward writes count positions from start - 1."""
        state = self._mtp_state
        if state is None or self._mtp_length != start - 1 or self._mtp_pending is None:
            return None
        kind = self.config.mtp_layer_types[0]
        self._mtp_rows = []
        return checkpoint_layer(state, start - 1, count, None if kind == SLIDING else self.config.rate(kind))

    def _mtp_verify_rollback(
        self, saved: VerifyCheckpoint, stashed: list[torch.Tensor] | None, kept: int
    ) -> None:
        rows, self._mtp_rows = self._mtp_rows, None
        state = self._mtp_state
        if saved.mtp is None or state is None:
            return
        if rows is None or self._mtp_length != saved.start - 1 + saved.count:
            self._mtp_out_of_step()  # the verify's forward did not feed the block in step
            return
        if kept == saved.count:
            return
        first = saved.start - 1
        restore_layer(state, saved.mtp, kept)
        kind = self.config.mtp_layer_types[0]
        if kind != SLIDING and kept:
            assert stashed is not None
            block = self._mtp_block()
            self._recompute_compressed(block.self_attn, state, kind, stashed, first, kept)
        self._mtp_length = first + kept
        # The target's streams at its new last position: a kept row, or (nothing kept) as before.
        self._mtp_pending = torch.cat(rows)[kept - 1 : kept].clone() if kept else saved.mtp_pending

    # --- drafting --------------------------------------------------------------------------------

    @torch.inference_mode()
    def mtp_draft(self, token: int, count: int, choose: Choose) -> list[torch.Tensor]:
        """`count` chained drafts after the target's last position and `token` (the one it just
        chose), each picked by `choose` from the block's logits. The block's cache is as before."""
        cache = self._cache
        state = self._mtp_state
        assert cache is not None and state is not None and self._mtp_pending is not None
        count = min(count, self.config.sliding_window, self._context - self._mtp_length)
        if count <= 0:
            return []
        kind = self.config.mtp_layer_types[0]
        at = self._mtp_length
        saved = checkpoint_layer(state, at, count, None if kind == SLIDING else self.config.rate(kind))
        stash, self._verify_inputs = self._verify_inputs, None  # drafting is no part of a verify
        block = self._mtp_block()
        hidden = self._mtp_pending
        ids = torch.tensor([token], dtype=torch.long, device=hidden.device)
        picks: list[torch.Tensor] = []
        try:
            for index in range(count):
                hidden = self._mtp_forward(hidden, ids, at + index, state)
                pick = choose(self._mtp_logits(block, hidden)[0])
                picks.append(pick)
                ids = pick.view(1).to(hidden.device)
        finally:
            restore_layer(state, saved, 0)
            self._verify_inputs = stash
        return picks

    # --- the block's math --------------------------------------------------------------------------

    def _mtp_forward(
        self, hidden: torch.Tensor, ids: torch.Tensor, start: int, state: LayerState
    ) -> torch.Tensor:
        """The block at positions start..: the target's streams [T, m, D] there and the next
        tokens' ids [T] in, the block's output streams [T, m, D] out (its cache `state` written)."""
        cfg = self.config
        block = self._mtp_block()
        eps = cfg.rms_norm_eps
        count, mult, width = hidden.shape
        embedded = ops.rms_norm(embed(self.model.embed_tokens, ids), block.enorm.weight, eps)
        normed = ops.rms_norm(hidden, block.hnorm.weight, eps)  # each stream on its own
        streams = ops.linear(normed.reshape(count * mult, width), block.h_proj).view(count, mult, width)
        streams = streams + ops.linear(embedded, block.e_proj).unsqueeze(1)
        if self._boundaries:
            self._use_device(streams.device)
        own = (state, cfg.mtp_layer_types[0])
        h, post, comb = self._hc_site(streams, block.attn_hc, block.input_layernorm.weight)
        streams = ops.expand(streams, self._attention(MTP_KEY, block.self_attn, h, start, own), post, comb)
        h, post, comb = self._hc_site(streams, block.ffn_hc, block.post_attention_layernorm.weight)
        streams = ops.expand(streams, self._moe(block.mlp, h, ids), post, comb)
        if self._boundaries:
            self._use_device(self.device)
        return streams

    def _mtp_logits(self, block: MtpBlock, streams: torch.Tensor) -> torch.Tensor:
        """The block's stream head and norm, then the main model's head: float32 [T, V]."""
        cfg, head = self.config, block.hc_head
        z, streams32 = ops.hc_mix(streams, head.hc_fn, cfg.rms_norm_eps)
        pre = torch.sigmoid(torch.addcmul(head.hc_base, z, head.hc_scale)) + cfg.hc_eps
        normed = ops.rms_norm(
            ops.collapse(streams32, pre), block.norm.weight, cfg.rms_norm_eps, streams.dtype
        )
        return self.head_projection()(normed).float()

    # --- snapshots -------------------------------------------------------------------------------

    def _mtp_export(self, length: int) -> dict[str, torch.Tensor]:
        """The block's state beside the target's at `length` (nothing when it is not in step)."""
        state = self._mtp_state
        if state is None or self._mtp_length != length - 1 or self._mtp_pending is None:
            return {}
        out = self._export_layer("mtp", state, self.config.mtp_layer_types[0], self._mtp_length)
        out["mtp.pending"] = self._mtp_pending.to("cpu", copy=True)
        return out

    def _mtp_import(
        self, state_dict: dict[str, torch.Tensor], length: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Follows the target's import_state: the copies that put the block's state back."""
        state = self._mtp_state
        if state is None:
            return []
        if "mtp.pending" not in state_dict or length < 1:
            self._mtp_out_of_step()  # saved without the block: it cannot follow from here
            return []
        pending = state_dict["mtp.pending"]
        self._mtp_pending = pending.to(state.ring.device, state.ring.dtype, copy=True)
        self._mtp_length = length - 1
        return self._layer_copies("mtp", state, state_dict, length - 1)
