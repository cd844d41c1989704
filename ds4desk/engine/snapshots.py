"""Snapshot slots: the state a prompt prefix left in the model, kept so that a later request which
starts with the same tokens continues from there instead of prefilling them again.

A slot holds the token ids, every per-layer cache the model reports through export_state (host
tensors) and the logits of its last position, so an exact match needs no prefill at all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ds4desk.engine.api import EngineFailure, ErrorCode, SlotInfo

FORMAT = "ds4desk-snapshot"
FORMAT_VERSION = "1"


@dataclass(slots=True)
class Snapshot:
    slot: int
    tokens: tuple[int, ...]
    state: dict[str, torch.Tensor]
    logits: torch.Tensor  # float32 [V] after the last token
    pinned: bool = False
    hits: int = 0
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    tag: str | None = None  # the owner a request named (the window's chat id)
    path: str | None = None  # the file it was last saved to or loaded from

    @property
    def nbytes(self) -> int:
        tensors = [*self.state.values(), self.logits]
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self) -> SlotInfo:
        now = time.monotonic()
        return SlotInfo(
            slot=self.slot,
            tokens=len(self.tokens),
            bytes=self.nbytes,
            pinned=self.pinned,
            hits=self.hits,
            age_s=round(now - self.created, 3),
            idle_s=round(now - self.last_used, 3),
            tag=self.tag,
            path=self.path,
        )


@dataclass(slots=True, frozen=True)
class ModelIdentity:
    """What a snapshot file must match to be restored into a model."""

    fingerprint: str
    dtype: str
    context: int


class SnapshotStore:
    def __init__(self, identity: ModelIdentity, slots: int = 16, budget_bytes: int = 2 * 2**30) -> None:
        if slots < 1:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "there must be at least one snapshot slot")
        self.identity = identity
        self.slots = slots
        self.budget_bytes = budget_bytes
        self._by_slot: dict[int, Snapshot] = {}

    def __len__(self) -> int:
        return len(self._by_slot)

    def list(self) -> list[Snapshot]:
        return sorted(self._by_slot.values(), key=lambda s: s.slot)

    def get(self, slot: int) -> Snapshot:
        try:
            return self._by_slot[slot]
        except KeyError:
            raise EngineFailure(ErrorCode.INVALID_SNAPSHOT_SLOT, f"slot {slot} holds no snapshot") from None

    def longest_prefix(self, prompt: list[int]) -> Snapshot | None:
        """The snapshot with the most tokens that are all a prefix of `prompt`."""
        best: Snapshot | None = None
        for snap in self._by_slot.values():
            n = len(snap.tokens)
            if (
                n <= len(prompt)
                and (best is None or n > len(best.tokens))
                and tuple(prompt[:n]) == snap.tokens
            ):
                best = snap
        if best is not None:
            best.hits += 1
            best.last_used = time.monotonic()
        return best

    def put(
        self, tokens: list[int], state: dict[str, torch.Tensor], logits: torch.Tensor, slot: int | None = None
    ) -> Snapshot:
        if slot is not None and not 0 <= slot < self.slots:
            raise EngineFailure(ErrorCode.INVALID_SNAPSHOT_SLOT, f"slot {slot} is not in 0..{self.slots - 1}")
        same = next((s for s in self._by_slot.values() if s.tokens == tuple(tokens)), None)
        if slot is None and same is not None:
            slot = same.slot  # the same prefix again: refresh it rather than keep two copies
        snap = Snapshot(
            slot if slot is not None else -1, tuple(tokens), state, logits.to("cpu", torch.float32)
        )
        if snap.nbytes > self.budget_bytes:
            raise EngineFailure(
                ErrorCode.OUT_OF_MEMORY,
                f"a snapshot of {snap.nbytes / 2**20:.0f} MiB exceeds the snapshot budget "
                f"of {self.budget_bytes / 2**20:.0f} MiB",
            )
        if slot is not None:
            old = self._by_slot.pop(slot, None)
            snap.pinned = bool(old and old.pinned)
            if old is not None and old.tokens == snap.tokens:
                # The same prefix refreshed: it is still the snapshot that was made and restored.
                snap.hits, snap.created, snap.tag, snap.path = old.hits, old.created, old.tag, old.path
        self._make_room(snap.nbytes, need_slot=slot is None)
        if slot is None:
            slot = min(set(range(self.slots)) - self._by_slot.keys())
        snap.slot = slot
        self._by_slot[slot] = snap
        return snap

    def free(self, slot: int) -> None:
        self.get(slot)
        del self._by_slot[slot]

    def clear(self) -> None:
        self._by_slot.clear()

    def pin(self, slot: int, pinned: bool = True) -> None:
        self.get(slot).pinned = pinned

    def tag(self, slot: int, tag: str | None) -> None:
        self.get(slot).tag = tag

    def _make_room(self, incoming: int, need_slot: bool) -> None:
        """Least recently used first, never a pinned slot, leaves before prefixes that others extend."""

        def used() -> int:
            return sum(s.nbytes for s in self._by_slot.values())

        while (need_slot and len(self._by_slot) >= self.slots) or used() + incoming > self.budget_bytes:
            candidates = [s for s in self._by_slot.values() if not s.pinned]
            if not candidates:
                raise EngineFailure(
                    ErrorCode.OUT_OF_MEMORY, "every snapshot slot is pinned: free or unpin one first"
                )

            def extended(snap: Snapshot) -> bool:
                n = len(snap.tokens)
                return any(o is not snap and o.tokens[:n] == snap.tokens for o in self._by_slot.values())

            victim = min(candidates, key=lambda s: (extended(s), s.last_used))
            del self._by_slot[victim.slot]

    # ---- disk ---------------------------------------------------------------------------------

    def save(self, slot: int, path: Path) -> None:
        snap = self.get(slot)
        tensors = {f"state.{k}": v.contiguous() for k, v in snap.state.items()}
        tensors["logits"] = snap.logits.contiguous()
        metadata = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "fingerprint": self.identity.fingerprint,
            "dtype": self.identity.dtype,
            "context": str(self.identity.context),
            "tokens": json.dumps(list(snap.tokens)),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        if snap.tag is not None:
            metadata["tag"] = snap.tag
        save_file(tensors, str(partial), metadata=metadata)
        partial.replace(path)
        snap.path = str(path)

    def load(self, path: Path, slot: int | None = None) -> Snapshot:
        """Checked whole before anything changes: a file of another model, dtype or context size, or
        no snapshot at all, is refused with invalid_snapshot_slot."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                meta = handle.metadata() or {}
                self._check(meta, path)
                names = [k for k in handle.keys() if k != "logits"]  # noqa: SIM118 - no __iter__
                state = {k.removeprefix("state."): handle.get_tensor(k) for k in names}
                logits = handle.get_tensor("logits")
            tokens = [int(t) for t in json.loads(meta["tokens"])]
        except EngineFailure:
            raise
        except Exception as exc:
            raise EngineFailure(
                ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path.name} is not a readable snapshot ({exc})"
            ) from exc
        if len(tokens) > self.identity.context or logits.ndim != 1:
            raise EngineFailure(ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path.name} does not fit this model")
        snap = self.put(tokens, state, logits, slot)
        snap.tag, snap.path = meta.get("tag"), str(path)
        return snap

    def _check(self, meta: dict[str, str], path: Path) -> None:
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise EngineFailure(ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path.name} is not a ds4desk snapshot")
        mine = self.identity
        for key, expected in (
            ("fingerprint", mine.fingerprint),
            ("dtype", mine.dtype),
            ("context", str(mine.context)),
        ):
            if meta.get(key) != expected:
                raise EngineFailure(
                    ErrorCode.INVALID_SNAPSHOT_SLOT,
                    f"{path.name} was saved from another model setup "
                    f"({key} {meta.get(key)!r}, this one {expected!r})",
                )
