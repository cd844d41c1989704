"""What a model's cache must forget after a verify step whose tail was rejected.

A verify forward writes the cache entries of every scored position; those past the accepted
prefix are dead. A model that speculation may run on says so (`supports_speculation`) and gives
three hooks: the most positions one verify may cover, a checkpoint taken before the verify forward,
and the roll-back to the accepted length. A dense cache with a row per position needs nothing (its
attention never reads past the length, and the next write overwrites the dead rows); a ring that
keeps only a window (Gemma 3's local layers) must put back the rows the dead positions overwrote;
a recurrent state that holds every position at once (Qwen3.5's Gated DeltaNet layers) is copied at
the checkpoint and, after a rejection, rebuilt from the copy over the kept positions only (the
verify keeps what it fed each layer). DeepSeek-V4 (a sliding ring, compressor carries, compressed
and indexer rows, and its MTP block's own cache) puts back what the verify overwrote and feeds the
kept tokens' inputs to its compressors again (models/deepseek_v4/verify.py). The hooks are opt-in:
a family without them never speculates.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Rollback(Protocol):
    supports_speculation: bool

    def max_verify_tokens(self) -> int | None:
        """The most positions one verify forward may write (None: no limit)."""

    def verify_checkpoint(self, start_pos: int, count: int) -> Any:
        """Before writing positions start_pos..start_pos+count-1: what verify_rollback needs."""

    def verify_rollback(self, saved: Any, start_pos: int, kept: int) -> None:
        """Positions start_pos+kept..start_pos+count-1 of that checkpoint are dead: undo them."""


def rollback_of(model: object) -> Rollback | None:
    """The model's roll-back hooks, or None when speculation cannot run on it."""
    if isinstance(model, Rollback) and getattr(model, "supports_speculation", False):
        return model
    return None
