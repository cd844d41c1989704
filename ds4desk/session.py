"""`ds4desk session`: the engine driven by JSON lines on stdin, answering JSON lines on stdout.

Commands are read while requests run, so a script can cancel, park or ask for the status of a
generation in flight. Streamed tokens leave in batches (at most `updates_per_second` lines a
second per request), then one result line; every other command answers one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from ds4desk import strict_json
from ds4desk.engine import (
    Engine,
    EngineFailure,
    ErrorCode,
    GenerateRequest,
    GenerateResult,
    LoadRequest,
    SamplingParams,
    SaveSnapshot,
    ThinkingBudget,
)
from ds4desk.engine.api import SPECULATIVE_MODES

log = logging.getLogger(__name__)

Json = dict[str, Any]

# A command line is a request, not a document: anything longer is refused before it is parsed.
MAX_LINE_CHARS = 16 * 2**20
MAX_TOKENS = 2**20  # max_tokens and thinking budgets: far beyond any context, far below overflow
MAX_SEED = 2**63 - 1


def _bad(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.BAD_REQUEST, detail)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) and abs(v) < 2**63 for v in value):
        raise _bad(f"{what} must be a list of integers")
    return list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(command: Json, name: str, default: int | None, low: int, high: int) -> int | None:
    value = command.get(name, default)
    if value is None and default is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise _bad(f"{name} must be an integer in {low}..{high}, got {_shown(value)}")
    return int(value)


def _float(command: Json, name: str, default: float, low: float, high: float) -> float:
    value = command.get(name, default)
    if not (_is_int(value) or isinstance(value, float)) or not low <= value <= high:
        raise _bad(f"{name} must be a number in {low:g}..{high:g}, got {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _request_from(command: Json) -> GenerateRequest:
    given = [k for k in ("prompt_tokens", "prompt", "raw", "messages") if k in command]
    if len(given) != 1:
        raise _bad("give exactly one of prompt_tokens, prompt, raw or messages")
    request = GenerateRequest(
        sampling=SamplingParams(
            temperature=_float(command, "temperature", 0.0, 0.0, 100.0),
            top_p=_float(command, "top_p", 1.0, 0.0, 1.0),
            top_k=_int(command, "top_k", 0, 0, 2**31 - 1) or 0,
            seed=_int(command, "seed", None, 0, MAX_SEED),
        ),
        max_new_tokens=_int(command, "max_tokens", 256, 1, MAX_TOKENS) or 1,
        use_snapshots=bool(command.get("use_snapshots", True)),
    )
    if (speculative := command.get("speculative")) is not None:
        if speculative not in SPECULATIVE_MODES:
            raise _bad(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {_shown(speculative)}"
            )
        request.speculative = speculative
    if "prompt_tokens" in command:
        request.prompt_tokens = _int_list(command["prompt_tokens"], "prompt_tokens")
    elif "prompt" in command:
        if not isinstance(command["prompt"], str):
            raise _bad("prompt must be a string")
        request.messages = [{"role": "user", "content": command["prompt"]}]
    elif "raw" in command:
        if not isinstance(command["raw"], str):
            raise _bad("raw must be a string")
        request.raw_text = command["raw"]
    else:
        messages = command["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _bad("messages must be a list of {role, content} objects")
        request.messages = messages
    if command.get("ignore_eos"):
        request.stop_tokens = []
    elif "stop_tokens" in command:
        request.stop_tokens = _int_list(command["stop_tokens"], "stop_tokens")
    if (save := command.get("save_snapshot")) is not None:
        if not isinstance(save, dict):
            raise _bad("save_snapshot must be an object {slot, at}")
        request.save_snapshot = SaveSnapshot(
            at=_int(save, "at", None, 1, 2**31 - 1), slot=_int(save, "slot", None, 0, 2**31 - 1)
        )
    if (budget := command.get("thinking_budget")) is not None:
        if not isinstance(budget, dict):
            raise _bad("thinking_budget must be an object {max_tokens, close_tokens}")
        request.thinking_budget = ThinkingBudget(
            _int(budget, "max_tokens", 0, 0, MAX_TOKENS) or 0,
            _int_list(budget.get("close_tokens"), "close_tokens"),
        )
    return request


def parse_command(line: str) -> Json:
    """One line as a command object, or EngineFailure(bad_request): JSON proper (no NaN, Infinity
    or numbers that overflow to them), not absurdly long or deep, every string valid Unicode."""
    if len(line) > MAX_LINE_CHARS:
        raise _bad(f"a command line is limited to {MAX_LINE_CHARS} characters")

    try:
        command = strict_json.loads(line)
    except strict_json.StrictJsonError as exc:
        if exc.kind == "deep":
            raise _bad("the command is nested too deeply") from None
        raise _bad(
            exc.detail if exc.kind in ("constant", "range") else f"not valid JSON ({exc.detail})"
        ) from None
    if not isinstance(command, dict) or not isinstance(command.get("op"), str):
        raise _bad('each line must be a JSON object with an "op"')
    if strict_json.has_lone_surrogate(command):
        raise _bad("a string holds a lone surrogate or bytes that are not UTF-8")
    return command


class _TokenBatches:
    """Engine-thread side of one request's token stream: a line at most every `interval_s`."""

    def __init__(self, session: Session, user_id: Any, interval_s: float) -> None:
        self._session = session
        self._id = user_id
        self._interval_s = interval_s
        self._pending: list[int] = []
        self._last = 0.0

    def push(self, token: int | None, _text: str) -> None:
        if token is not None:
            self._pending.append(token)
        now = time.monotonic()
        if now - self._last >= self._interval_s:
            self.flush()
            self._last = now

    def flush(self) -> None:
        if self._pending:
            self._session.write({"id": self._id, "event": "tokens", "tokens": self._pending})
            self._pending = []


class Session:
    """`snapshot_dir`: where a relative save_slot/load_slot path points (the data directory's
    snapshots folder; None: the current directory)."""

    def __init__(
        self,
        engine: Engine,
        out: TextIO,
        updates_per_second: float = 40.0,
        snapshot_dir: Path | None = None,
    ) -> None:
        self._engine = engine
        self._out = out
        self._write_lock = threading.Lock()
        self._interval_s = 1.0 / updates_per_second
        self._snapshot_dir = snapshot_dir
        self._running: dict[Any, int] = {}  # the user's id -> the engine's request id
        self._pending: list[Future[Any]] = []
        self.closed = False  # the reader of our output went away: nothing more can be said

    def write(self, line: Json) -> None:
        try:
            text = json.dumps(line, ensure_ascii=False)
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate in text we echo: escaped, still valid JSON
            text = json.dumps(line, ensure_ascii=True)
        with self._write_lock:
            if self.closed:
                return
            try:
                self._out.write(text + "\n")
                self._out.flush()
            except (BrokenPipeError, ValueError, OSError):  # closed pipe or closed file
                self.closed = True

    def handle(self, line: str) -> bool:
        """One input line; False once the session should end. Every command gets one answer."""
        if not line.strip():
            return True
        command: Json | None = None
        try:
            command = parse_command(line)
            op = command["op"]
            if op == "quit":
                self.cancel_all()  # queued and running answers end now, as cancelled
                return False
            handler = self._handlers().get(op)
            if handler is None:
                raise _bad(f"unknown op {_shown(op)}")
            handler(command)
        except EngineFailure as failure:
            self.write({"op": _op_of(command), "ok": False, "error": failure.error.to_json()})
        except Exception as exc:  # a bug of ours: still an answer, and the session goes on
            log.error("session command failed: %s: %s", type(exc).__name__, exc)
            detail = f"{type(exc).__name__}: {exc}"
            self.write(
                {"op": _op_of(command), "ok": False, "error": {"code": "bad_request", "detail": detail}}
            )
        return not self.closed

    def cancel_all(self) -> None:
        for request_id in list(self._running.values()):
            self._engine.cancel(request_id)

    def wait(self) -> None:
        for future in list(self._pending):
            future.exception()  # waits; the callbacks have written the answers

    def _handlers(self) -> dict[str, Callable[[Json], None]]:
        return {
            "generate": self._generate,
            "cancel": self._cancel,
            "park": lambda c: self._park(c, park=True),
            "unpark": lambda c: self._park(c, park=False),
            "slots": lambda c: self._slots(c, "list"),
            "free_slot": lambda c: self._slots(c, "free"),
            "pin_slot": lambda c: self._slots(c, "unpin" if c.get("pinned") is False else "pin"),
            "save_slot": lambda c: self._slots(c, "save"),
            "load_slot": lambda c: self._slots(c, "load"),
            "status": self._status,
        }

    def _generate(self, command: Json) -> None:
        user_id = command.get("id")
        if not (isinstance(user_id, str) or _is_int(user_id)) or user_id in self._running:
            raise _bad("generate needs an id (a string or an integer) that is not already running")
        request = _request_from(command)
        batches = _TokenBatches(self, user_id, self._interval_s)
        self._running[user_id] = request.request_id
        future = self._engine.submit_generate(request, batches.push)

        def done(finished: Future[GenerateResult]) -> None:
            self._running.pop(user_id, None)
            batches.flush()
            result = finished.result()
            self.write({"id": user_id, "event": "result", "ok": result.ok, **result.to_json()})

        self._track(future, done, {"id": user_id, "event": "result"})

    def _cancel(self, command: Json) -> None:
        user_id = command.get("id")
        request_id = self._running.get(user_id) if isinstance(user_id, str | int) else None
        if request_id is None:
            raise _bad(f"no running request has id {_shown(user_id)}")
        self._engine.cancel(request_id)
        self.write({"op": "cancel", "ok": True, "id": user_id})

    def _park(self, command: Json, park: bool) -> None:
        target = command.get("target", "")
        if not isinstance(target, str):
            raise _bad("target must be a string")
        future = self._engine.submit_park(target) if park else self._engine.submit_unpark(target)
        op = "park" if park else "unpark"

        def done(finished: Future[Any]) -> None:
            result = finished.result()
            line: Json = {"op": op, "ok": result.ok, "target": target, "parked": result.parked}
            line["freed_bytes" if park else "loaded_bytes"] = result.bytes
            if result.error:
                line["error"] = result.error.to_json()
            self.write(line)

        self._track(future, done, {"op": op})

    def _slots(self, command: Json, op: str) -> None:
        slot = command.get("slot")
        if slot is not None and not (_is_int(slot) and 0 <= slot < 2**31):
            raise _bad(f"slot must be a slot number, got {_shown(slot)}")
        path = command.get("path")
        if path is not None and (not isinstance(path, str) or not path or "\0" in path):
            raise _bad("path must be a non-empty file path")
        where = None
        if path:
            where = Path(path).expanduser()
            if not where.is_absolute() and self._snapshot_dir is not None:
                where = self._snapshot_dir / where
        future = self._engine.submit_slots(op, slot, where)
        name = command["op"]

        def done(finished: Future[Any]) -> None:
            result = finished.result()
            slots = [info.to_json() for info in result.slots]
            line: Json = {"op": name, "ok": result.ok, "slot": result.slot, "slots": slots}
            if result.error:
                line["error"] = result.error.to_json()
            self.write(line)

        self._track(future, done, {"op": name})

    def _status(self, _command: Json) -> None:
        info = self._engine.model_info
        self.write(
            {
                "op": "status",
                "ok": True,
                "model": asdict(info) if info else None,
                "parked": self._engine.parked,
                "running": list(self._running),
            }
        )

    def _track(self, future: Future[Any], done: Callable[[Future[Any]], None], failed: Json) -> None:
        """`done` writes the answer; if it cannot (the engine failed in a way of ours), `failed` with
        the error is written instead, so no command is left unanswered."""

        def answer(finished: Future[Any]) -> None:
            try:
                done(finished)
            except BaseException as exc:
                log.error("engine command failed: %s: %s", type(exc).__name__, exc)
                error = {"code": "bad_request", "detail": f"{type(exc).__name__}: {exc}"}
                self.write({**failed, "ok": False, "error": error})

        self._pending.append(future)
        future.add_done_callback(answer)


def _op_of(command: Json | None) -> str | None:
    op = command.get("op") if command is not None else None
    return op if isinstance(op, str) else None


def _speak_utf8(*streams: TextIO) -> None:
    """Our own stdin/stdout speak UTF-8 whatever the locale says; bytes that are not UTF-8 come in
    as lone surrogates, which parse_command refuses instead of dying on them."""
    for stream in streams:
        if stream in (sys.stdin, sys.stdout) and isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, OSError):  # already read from, or closed
                stream.reconfigure(encoding="utf-8", errors="surrogateescape")


def run_session(
    load: LoadRequest,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    snapshot_dir: Path | None = None,
) -> int:
    """0 after quit or the end of input; 130 after Ctrl+C (what it was doing is cancelled first)."""
    _speak_utf8(stdin, stdout)
    engine = Engine()
    session = Session(engine, stdout, snapshot_dir=snapshot_dir)
    code = 0
    try:
        try:
            loaded = engine.load(load)
            ready: Json = {
                "op": "load",
                "ok": loaded.ok,
                "seconds": round(loaded.seconds, 3),  # the warm-up included
                "warm_up_seconds": round(loaded.warm_up_seconds, 3),
            }
            if loaded.info:
                ready["model"] = asdict(loaded.info)
            if loaded.error:
                ready["error"] = loaded.error.to_json()
            session.write(ready)
            for line in stdin:
                if not session.handle(line):
                    break
            session.wait()
        except KeyboardInterrupt:
            engine.cancel_load()
            session.cancel_all()
            code = 130
    finally:
        engine.close()
    return code
