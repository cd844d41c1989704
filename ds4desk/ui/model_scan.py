"""Finding models in a folder the user chose: `.gguf` files and Hugging Face model folders.

Plain Python with no Qt and no torch, run on a worker thread by the model picker. A models folder
can be anything (a home directory, a network share, a Hugging Face cache full of symlinks), so the
walk is bounded three ways: by depth, by the number of directory entries it looks at, and by a
deadline. Symlinked folders are never entered, so a link loop cannot trap it; a symlinked file is
followed (the Hugging Face cache links every file of a snapshot to its blob).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_DEPTH = 4  # root/models--org--name/snapshots/<hash>/ is a Hugging Face cache model at depth 3
MAX_ENTRIES = 20_000  # directory entries looked at, whole walk
MAX_SECONDS = 5.0
MAX_MODELS = 500
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
# "model-00002-of-00003.gguf": only the first part names the model.
_GGUF_PART = re.compile(r"-(\d+)-of-\d+\.gguf$", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class FoundModel:
    path: str
    name: str
    kind: str  # "gguf" | "folder"
    size_bytes: int  # on disk: the file, or the folder's weight files


@dataclass(slots=True)
class ScanResult:
    models: list[FoundModel] = field(default_factory=list)
    truncated: bool = False  # a bound was reached: there may be more than is listed
    error: str | None = None  # the folder itself could not be read


def model_size(path: str) -> int:
    """Bytes on disk of a .gguf file, or of a model folder's weight files; 0 when unknown."""
    try:
        target = Path(path)
        if target.is_file():
            return target.stat().st_size
        total = 0
        with os.scandir(target) as entries:
            for entry in entries:
                if entry.name.lower().endswith(WEIGHT_SUFFIXES) and entry.is_file():
                    total += entry.stat().st_size
        return total
    except OSError:
        return 0


def scan_models_folder(
    root: str | Path,
    *,
    max_depth: int = MAX_DEPTH,
    max_entries: int = MAX_ENTRIES,
    max_seconds: float = MAX_SECONDS,
    max_models: int = MAX_MODELS,
) -> ScanResult:
    """The models under `root`, sorted by name. A folder with a config.json is one model and is not
    looked into further; hidden folders (.git, .cache) are skipped."""
    result = ScanResult()
    deadline = time.monotonic() + max_seconds
    looked_at = 0
    seen: set[tuple[int, int]] = set()  # (device, inode) of folders entered: bind mounts loop too
    stack: list[tuple[Path, int]] = [(Path(root), 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            info = folder.stat()
            key = (info.st_dev, info.st_ino)
            if key in seen:
                continue
            seen.add(key)
            with os.scandir(folder) as scan:
                entries = []
                for entry in scan:
                    looked_at += 1
                    if looked_at > max_entries or time.monotonic() > deadline:
                        result.truncated = True
                        break
                    entries.append(entry)
        except OSError as exc:
            if depth == 0:
                result.error = exc.strerror or str(exc)
                return result
            continue
        if any(e.name == "config.json" and _is_file(e) for e in entries):
            result.models.append(FoundModel(str(folder), folder.name, "folder", _weights_size(entries)))
        else:
            for entry in entries:
                name = entry.name
                if name.lower().endswith(".gguf") and not _later_part(name) and _is_file(entry):
                    result.models.append(FoundModel(entry.path, name, "gguf", _size(entry)))
                elif depth < max_depth and not name.startswith(".") and _is_real_dir(entry):
                    stack.append((Path(entry.path), depth + 1))
        if len(result.models) >= max_models:
            result.truncated = True
            break
        if result.truncated:
            break
    result.models.sort(key=lambda m: (m.name.lower(), m.path))
    del result.models[max_models:]
    return result


def _later_part(name: str) -> bool:
    part = _GGUF_PART.search(name)
    return part is not None and int(part.group(1)) != 1


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()  # follows a symlink to a file
    except OSError:
        return False


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)  # a linked folder could lead back up
    except OSError:
        return False


def _size(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat().st_size
    except OSError:
        return 0


def _weights_size(entries: list[os.DirEntry[str]]) -> int:
    return sum(_size(e) for e in entries if e.name.lower().endswith(WEIGHT_SUFFIXES) and _is_file(e))
