"""The snapshot slots and park / unpark over HTTP, as llama.cpp's server has /slots.

A slot file is named by the client but lives in the one folder the server was started with: a name
is one plain file name (letters, digits, `.`, `_`, `-`; no separators, no `..`, not absolute), and
only a regular file is read (a link, folder or device there is refused), so no request can reach a
path the server was not given.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

from ds4desk.engine.api import EngineError, ErrorCode, ParkResult, SlotResult
from ds4desk.engine.client import EngineClient
from ds4desk.server.protocol import ApiError, bad

MAX_SLOT_ID = 2**31 - 1
MAX_FILENAME = 128
_FILENAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# llama.cpp's names for the actions, and the engine's slot commands they are.
ACTIONS = {"save": "save", "restore": "load", "erase": "free", "pin": "pin", "unpin": "unpin"}


def slot_id(text: str) -> int:
    """The {id} of /slots/{id}: a small non-negative decimal number."""
    if not text.isascii() or not text.isdigit() or len(text) > 10 or int(text) > MAX_SLOT_ID:
        raise bad(f"a slot id is a number in 0..{MAX_SLOT_ID}, got {_shown(text)}", "id")
    return int(text)


def slot_file(folder: Path | None, name: Any, must_exist: bool) -> Path:
    """`name` inside `folder`, checked as the module says."""
    if folder is None:
        raise ApiError(
            400, "slot files are off: the server was started without a slot folder", code="slot_files_off"
        )
    if not isinstance(name, str) or not name:
        raise bad("filename must be a non-empty string", "filename")
    if len(name) > MAX_FILENAME or not _FILENAME.fullmatch(name) or ".." in name:
        raise bad(
            f"filename must be one plain file name (letters, digits, '.', '_', '-'; at most "
            f"{MAX_FILENAME} characters; no folders), got {_shown(name)}",
            "filename",
        )
    path = folder / name
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        if must_exist:
            raise ApiError(
                404, f"no slot file named {name}", kind="not_found_error", param="filename"
            ) from None
        return path
    except OSError as exc:
        raise bad(f"cannot read {name}: {exc.strerror or exc}", "filename") from None
    if not stat.S_ISREG(mode):  # a link could point anywhere; a FIFO would block a read forever
        raise bad(f"{name} is not a regular file", "filename")
    return path


def slot_body(result: SlotResult, folder: Path | None) -> dict[str, Any]:
    slots = []
    for info in result.slots:
        entry = info.to_json()
        entry.pop("path")
        entry["filename"] = _inside(info.path, folder)
        slots.append(entry)
    return {"slot": result.slot, "slots": slots}


def engine_slot_error(error: EngineError, folder: Path | None) -> ApiError:
    detail = error.detail
    if folder is not None:  # the client named a file, not the server's folder: say only the name
        detail = detail.replace(str(folder) + "/", "").replace(str(folder), "the slot folder")
    if error.code == ErrorCode.MODEL_NOT_LOADED:
        return ApiError(503, detail, kind="server_error", code=str(error.code))
    return ApiError(400, detail, code=str(error.code))  # a bad slot, file or command: the client's to fix


async def run_slot_action(
    client: EngineClient, slot: int, action: str, body: dict[str, Any], folder: Path | None
) -> dict[str, Any]:
    if action not in ACTIONS:
        raise bad(f"action must be one of {', '.join(ACTIONS)}, got {_shown(action)}", "action")
    path = None
    if action in ("save", "restore"):
        path = slot_file(folder, body.get("filename"), must_exist=action == "restore")
        if action == "save":
            assert folder is not None
            folder.mkdir(parents=True, exist_ok=True)
    result = await client.slots(ACTIONS[action], slot, path)
    if result.error is not None:
        raise engine_slot_error(result.error, folder)
    answer = slot_body(result, folder)
    answer["action"] = action
    if path is not None:
        answer["filename"] = path.name
    return answer


def park_body(result: ParkResult) -> dict[str, Any]:
    if result.error is not None:
        status = 503 if result.error.code in (ErrorCode.LOAD_FAILED, ErrorCode.OUT_OF_MEMORY) else 400
        raise ApiError(status, result.error.detail, code=str(result.error.code))
    return result.to_json()


def _inside(path: str | None, folder: Path | None) -> str | None:
    if path is None or folder is None:
        return None
    where = Path(path)
    return where.name if where.parent == folder else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
