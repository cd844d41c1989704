"""Snapshot slots: the state a prompt prefix left in the model, kept so that a later request which
starts with the same tokens continues from there instead of prefilling them again.

A slot holds the token ids, every per-layer cache the model reports through export_state (host
tensors) and the logits of its last position, so an exact match needs no prefill at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ds4desk.engine.api import EngineFailure, ErrorCode, SlotInfo

FORMAT = "ds4desk-snapshot"
FORMAT_VERSION = "1"
# A snapshot file's header (its metadata and tensor table) is small; a larger one is not ours.
MAX_HEADER_BYTES = 16 * 2**20

# name -> (shape, dtype) of every state tensor a snapshot of `length` tokens must hold.
StateLayout = Callable[[int], dict[str, tuple[tuple[int, ...], torch.dtype]]]


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
    # What a restored snapshot must look like (None: files are not checked beyond the metadata,
    # for stores built without a model, as some tests do) and the length of the logits row.
    layout: StateLayout | None = field(default=None, compare=False)
    vocab_size: int | None = None


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
        """Written next to `path` and renamed over it, so a crash leaves the old file or the new one.
        Only a regular file is ever created or replaced: a device, FIFO, folder or link is refused."""
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
        if snap.tag is not None:
            metadata["tag"] = snap.tag
        _check_writable_target(path)
        partial: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
            os.close(fd)
            save_file(tensors, partial, metadata=metadata)
            _check_writable_target(path)  # again: something may have appeared there meanwhile
            os.replace(partial, path)
            partial = None
        except OSError as exc:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"cannot write the snapshot to {path}: {exc.strerror or exc}"
            ) from None
        finally:
            if partial is not None:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
        snap.path = str(path)

    def load(self, path: Path, slot: int | None = None) -> Snapshot:
        """Checked whole before anything changes: a file of another model, dtype or context size, a
        tensor whose name, shape or dtype is not what this model's state holds, or no snapshot at
        all, is refused with invalid_snapshot_slot."""
        _check_readable_file(path, self.budget_bytes + MAX_HEADER_BYTES)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                meta = handle.metadata() or {}
                self._check(meta, path)
                tokens = _tokens_of(meta.get("tokens"), path)
                if not 0 < len(tokens) <= self.identity.context:
                    raise _refuse(path, f"it holds {len(tokens)} tokens; this model's context is "
                                  f"{self.identity.context}")  # fmt: skip
                self._check_tensors(handle, tokens, path)
                names = [k for k in handle.keys() if k != "logits"]  # noqa: SIM118 - no __iter__
                state = {k.removeprefix("state."): handle.get_tensor(k) for k in names}
                logits = handle.get_tensor("logits")
        except EngineFailure:
            raise
        except Exception as exc:
            raise EngineFailure(
                ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path.name} is not a readable snapshot ({exc})"
            ) from None
        if logits.ndim != 1:
            raise _refuse(path, "its logits are not one row")
        snap = self.put(tokens, state, logits, slot)
        snap.tag, snap.path = meta.get("tag"), str(path)
        return snap

    def _check_tensors(self, handle: Any, tokens: list[int], path: Path) -> None:
        """Every tensor's name, shape and dtype against what this model exports for that many
        tokens: a forged shape would otherwise broadcast into the cache and answer garbage."""
        layout = self.identity.layout
        vocab = self.identity.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in tokens):
            raise _refuse(path, f"a token id is outside this model's vocabulary (0..{vocab - 1})")
        if layout is None:
            return
        expected = {f"state.{k}": spec for k, spec in layout(len(tokens)).items()}
        expected["logits"] = ((vocab,) if vocab is not None else None, torch.float32)  # type: ignore[assignment]
        names = set(handle.keys())
        if names != set(expected):
            missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
            raise _refuse(path, f"its tensors are not this model's state (missing {missing[:4]}, "
                          f"unexpected {extra[:4]})")  # fmt: skip
        for name, (shape, dtype) in expected.items():
            part = handle.get_slice(name)
            got_shape, got_dtype = tuple(part.get_shape()), _DTYPES.get(part.get_dtype())
            if (shape is not None and got_shape != shape) or got_dtype != dtype:
                raise _refuse(
                    path, f"tensor {name} is {got_dtype} {list(got_shape)}, this model needs "
                    f"{dtype} {list(shape) if shape is not None else '[vocab]'}"
                )  # fmt: skip

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


# safetensors' dtype names -> torch's, for the types a state can hold.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _refuse(path: Path, why: str) -> EngineFailure:
    return EngineFailure(ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path.name} does not fit this model: {why}")


def _tokens_of(text: str | None, path: Path) -> list[int]:
    if text is None or len(text) > 32 * 2**20 or not re.fullmatch(r"\[[0-9, ]*\]", text):
        raise _refuse(path, "its token list is missing or not a list of token ids")
    return [int(t) for t in json.loads(text)]


def _check_writable_target(path: Path) -> None:
    """A new file, or an existing regular one (not a link to one: the rename would replace the link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"cannot write to {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise EngineFailure(
            ErrorCode.BAD_REQUEST,
            f"{path} is not a regular file ({_kind(info.st_mode)}); snapshots are written only to "
            "regular files",
        )


def _check_readable_file(path: Path, most_bytes: int) -> None:
    """A regular file no larger than a snapshot can be: a FIFO would block, a device never ends."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise EngineFailure(
            ErrorCode.INVALID_SNAPSHOT_SLOT, f"cannot read {path}: {exc.strerror or exc}"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise EngineFailure(
            ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path} is not a regular file ({_kind(info.st_mode)})"
        )
    if info.st_size > most_bytes:
        raise EngineFailure(
            ErrorCode.INVALID_SNAPSHOT_SLOT,
            f"{path.name} is {info.st_size / 2**20:.0f} MiB, more than the snapshot budget allows",
        )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def state_layout(model: Any, context: int) -> StateLayout:
    """What `model.export_state(length)` returns for any length, learned from its state at length 0
    (right after the cache is allocated) and the rule each family's cache keeps rows by: the one
    dimension that is empty at length 0 holds `length` rows, or fewer for a ring or a compressed
    cache. A family whose rule is not known here gets files refused rather than trusted."""
    base = {k: (tuple(v.shape), v.dtype) for k, v in model.export_state(0).items()}
    config = model.config
    ring = model.ring_rows(context) if hasattr(model, "ring_rows") else None

    def rows(name: str, length: int) -> int | None:
        if name in ("kv", "kv_global"):
            return length
        if name == "kv_local" and ring is not None:
            return min(length, ring)
        layer, _, kind = name.partition(".")
        if kind == "ring" and hasattr(config, "sliding_window"):
            return min(length, int(config.sliding_window))
        if kind in ("entries", "index_entries") and hasattr(config, "layer_types") and layer.isdigit():
            return length // int(config.rate(config.layer_types[int(layer)]))
        return None

    def layout(length: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, (shape, dtype) in base.items():
            empty = [i for i, n in enumerate(shape) if n == 0]
            if not empty:
                out[name] = (shape, dtype)
                continue
            count = rows(name, length)
            if count is None or len(empty) != 1:
                raise EngineFailure(
                    ErrorCode.INVALID_SNAPSHOT_SLOT,
                    f"snapshot files of this model cannot be checked ({name})",
                )
            out[name] = ((*shape[: empty[0]], count, *shape[empty[0] + 1 :]), dtype)
        return out

    return layout
