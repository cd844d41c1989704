"""DeepSeek-V4's roll-back hooks for speculative decoding (speculative/rollback.py's protocol).

A verify forward of `count` tokens at start..start+count-1 writes, in every layer, the raw ring's
slots of those positions, the compressors' carries (the open window's projections, and for CSA the
last closed window's first halves) and the compressed and indexer rows of every window that closes
inside the span. After a rejection only start..start+kept-1 stand, and the state must be exactly
what feeding those alone leaves:

- ring: a verify covers at most one window (max_verify_tokens), so each slot is written once; the
  slots of dead positions get their old rows back;
- compressed / indexer rows the span may close, and the carries: put back as they were, then the
  kept tokens' layer inputs (stashed by the verify forward, `count` rows a compressed layer) go
  through the compressor again, which closes exactly the windows the kept tokens close and leaves
  exactly their carry. Recomputing costs two small projections of `kept` rows a compressed layer,
  and only after a rejection; undoing a pooled window without its inputs is not possible.

The MTP layer's own state (mtp.py) rolls back the same way, one position behind the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4desk.engine.models.deepseek_v4.cache import LayerState, V4Cache
from ds4desk.engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Attention, Backbone, Indexer

# The stash key of the MTP block's layer inputs (the main layers use their index).
MTP_KEY = -1


@dataclass(slots=True)
class LayerCheckpoint:
    """What a write of positions start..start+count-1 may change in one LayerState."""

    slots: torch.Tensor  # [count]: the ring slots of those positions, in position order
    ring_rows: torch.Tensor  # [count, d]: their rows before the write
    carries: list[torch.Tensor]  # copies of the compressor's and the indexer's carried tensors
    first_row: int  # the first compressed row a window closing in the span writes
    entries: torch.Tensor | None  # copies of the compressed rows first_row.. the span may close
    index_entries: torch.Tensor | None  # the same rows of the indexer keys (CSA)


def checkpoint_layer(state: LayerState, start: int, count: int, rate: int | None) -> LayerCheckpoint:
    """Copy what writing `count` positions from `start` may change (`rate`: the layer's compression
    rate, None for a sliding layer). count must not exceed the ring's length."""
    window = state.ring.shape[0]
    if not 0 < count <= window:
        raise ValueError(f"a verify covers 1..{window} positions, got {count}")
    slots = torch.arange(start, start + count, device=state.ring.device) % window
    carries = [
        t.clone() for part in (state.compressor, state.indexer) if part is not None for t in part.tensors()
    ]
    first_row, entries, index_entries = 0, None, None
    if rate is not None and state.entries is not None:
        first_row = start // rate
        stop = min((start + count) // rate, state.entries.shape[0])
        entries = state.entries[first_row:stop].clone()
        if state.index_entries is not None:
            index_entries = state.index_entries[first_row:stop].clone()
    return LayerCheckpoint(
        slots, state.ring.index_select(0, slots), carries, first_row, entries, index_entries
    )


def restore_layer(state: LayerState, saved: LayerCheckpoint, kept: int) -> None:
    """Put back the ring rows of the dead positions (those after the first `kept`), and all the
    carries and rows the span may have changed, in place (captured graphs read these tensors)."""
    if kept < saved.slots.shape[0]:
        state.ring.index_copy_(0, saved.slots[kept:], saved.ring_rows[kept:])
    live = [t for part in (state.compressor, state.indexer) if part is not None for t in part.tensors()]
    for tensor, copy in zip(live, saved.carries, strict=True):
        tensor.copy_(copy)
    for rows, copy in ((state.entries, saved.entries), (state.index_entries, saved.index_entries)):
        if rows is not None and copy is not None:
            rows[saved.first_row : saved.first_row + copy.shape[0]].copy_(copy)


@dataclass(slots=True)
class VerifyCheckpoint:
    start: int
    count: int
    layers: list[LayerCheckpoint]
    # The MTP layer's, when it follows the target in step (mtp.py): its positions are one behind,
    # and the target's streams it held for the first of them.
    mtp: LayerCheckpoint | None = None
    mtp_pending: torch.Tensor | None = None


class VerifyRollback:
    """DeepseekV4Model's roll-back hooks (a mixin). While a checkpoint is open, the prefill
    attention stashes every compressed layer's inputs in `_verify_inputs` (PrefillAttention)."""

    config: DeepseekV4Config
    model: Backbone
    _cache: V4Cache | None
    _boundaries: dict[int, torch.device]
    _verify_inputs: dict[int, list[torch.Tensor]] | None

    supports_speculation = True
    # A forward continues where the cache ends or restarts at 0: a drafter must not ask it to feed
    # a position again (draft_model.py restarts such a draft from 0).
    rewinds = False

    def max_verify_tokens(self) -> int | None:
        # One ring's worth: each slot is written at most once, so its old row is all a roll-back needs.
        return self.config.sliding_window

    def verify_checkpoint(self, start_pos: int, count: int) -> VerifyCheckpoint:
        cache = self._cache
        if cache is None:
            raise RuntimeError("verify_checkpoint before allocate_cache")
        cfg = self.config
        layers = [
            checkpoint_layer(state, start_pos, count, None if kind == SLIDING else cfg.rate(kind))
            for state, kind in zip(cache.layers, cfg.layer_types, strict=True)
        ]
        self._verify_inputs = {}
        mtp = self._mtp_verify_checkpoint(start_pos, count)
        return VerifyCheckpoint(start_pos, count, layers, mtp, self._mtp_pending if mtp is not None else None)

    def verify_rollback(self, saved: VerifyCheckpoint, start_pos: int, kept: int) -> None:
        cache = self._cache
        assert cache is not None
        inputs, self._verify_inputs = self._verify_inputs or {}, None
        if not 0 <= kept <= saved.count or start_pos != saved.start:
            raise ValueError(
                f"cannot keep {kept} of {saved.count} positions from {saved.start} at {start_pos}"
            )
        if kept < saved.count:
            cfg = self.config
            for index, (state, kind, layer) in enumerate(
                zip(cache.layers, cfg.layer_types, self.model.layers, strict=True)
            ):
                restore_layer(state, saved.layers[index], kept)
                if kind != SLIDING and kept:
                    self._recompute_compressed(layer.self_attn, state, kind, inputs[index], start_pos, kept)
        self._mtp_verify_rollback(saved, inputs.get(MTP_KEY), kept)
        cache.length = start_pos + kept

    def _recompute_compressed(
        self,
        attn: Attention,
        state: LayerState,
        kind: str,
        stashed: list[torch.Tensor],
        start: int,
        kept: int,
    ) -> None:
        """Feed the kept tokens' layer inputs to the (restored) compressor and indexer again."""
        x = torch.cat(stashed)[:kept]
        comp = attn.compressor
        assert comp is not None and state.compressor is not None and state.entries is not None
        rate, csa = self.config.rate(kind), kind == CSA
        if self._boundaries:
            self._use_device(x.device)
        self._compress(comp, state.compressor, state.entries, x, start, rate, csa)
        if csa:
            assert isinstance(comp.indexer, Indexer)
            assert state.indexer is not None and state.index_entries is not None
            self._compress(comp.indexer, state.indexer, state.index_entries, x, start, rate, True)
        if self._boundaries:
            self._use_device(self.device)
