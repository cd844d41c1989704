"""`ds4desk session`: the engine driven by JSON lines on stdin, answering JSON lines on stdout.

Commands are read while requests run, so a script can cancel, park or ask for the status of a
generation in flight. Streamed tokens leave in batches (at most `updates_per_second` lines a
second per request), then one result line; every other command answers one line.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

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

Json = dict[str, Any]


def _bad(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.BAD_REQUEST, detail)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _bad(f"{what} must be a list of integers")
    return list(value)


def _request_from(command: Json) -> GenerateRequest:
    given = [k for k in ("prompt_tokens", "prompt", "raw", "messages") if k in command]
    if len(given) != 1:
        raise _bad("give exactly one of prompt_tokens, prompt, raw or messages")
    request = GenerateRequest(
        sampling=SamplingParams(
            temperature=float(command.get("temperature", 0.0)),
            top_p=float(command.get("top_p", 1.0)),
            top_k=int(command.get("top_k", 0)),
            seed=command.get("seed"),
        ),
        max_new_tokens=int(command.get("max_tokens", 256)),
        use_snapshots=bool(command.get("use_snapshots", True)),
    )
    if "prompt_tokens" in command:
        request.prompt_tokens = _int_list(command["prompt_tokens"], "prompt_tokens")
    elif "prompt" in command:
        request.messages = [{"role": "user", "content": str(command["prompt"])}]
    elif "raw" in command:
        request.raw_text = str(command["raw"])
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
        request.save_snapshot = SaveSnapshot(at=save.get("at"), slot=save.get("slot"))
    if (budget := command.get("thinking_budget")) is not None:
        if not isinstance(budget, dict):
            raise _bad("thinking_budget must be an object {max_tokens, close_tokens}")
        request.thinking_budget = ThinkingBudget(
            int(budget.get("max_tokens", 0)), _int_list(budget.get("close_tokens"), "close_tokens")
        )
    return request


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
    def __init__(self, engine: Engine, out: TextIO, updates_per_second: float = 40.0) -> None:
        self._engine = engine
        self._out = out
        self._write_lock = threading.Lock()
        self._interval_s = 1.0 / updates_per_second
        self._running: dict[Any, int] = {}  # the user's id -> the engine's request id
        self._pending: list[Future[Any]] = []

    def write(self, line: Json) -> None:
        text = json.dumps(line, ensure_ascii=False)
        with self._write_lock:
            self._out.write(text + "\n")
            self._out.flush()

    def handle(self, line: str) -> bool:
        """One input line; False once the session should end."""
        if not line.strip():
            return True
        try:
            command = json.loads(line)
            if not isinstance(command, dict) or not isinstance(command.get("op"), str):
                raise _bad('each line must be a JSON object with an "op"')
            op = command["op"]
            if op == "quit":
                return False
            handler = self._handlers().get(op)
            if handler is None:
                raise _bad(f"unknown op '{op}'")
            handler(command)
        except EngineFailure as failure:
            self.write({"op": _op_of(line), "ok": False, "error": failure.error.to_json()})
        except (ValueError, TypeError, KeyError) as exc:
            self.write(
                {"op": _op_of(line), "ok": False, "error": {"code": "bad_request", "detail": str(exc)}}
            )
        return True

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
        if user_id is None or user_id in self._running:
            raise _bad("generate needs an id that is not already running")
        request = _request_from(command)
        batches = _TokenBatches(self, user_id, self._interval_s)
        self._running[user_id] = request.request_id
        future = self._engine.submit_generate(request, batches.push)

        def done(finished: Future[GenerateResult]) -> None:
            self._running.pop(user_id, None)
            batches.flush()
            result = finished.result()
            self.write({"id": user_id, "event": "result", "ok": result.ok, **result.to_json()})

        self._track(future, done)

    def _cancel(self, command: Json) -> None:
        request_id = self._running.get(command.get("id"))
        if request_id is None:
            raise _bad(f"no running request has id {command.get('id')!r}")
        self._engine.cancel(request_id)
        self.write({"op": "cancel", "ok": True, "id": command.get("id")})

    def _park(self, command: Json, park: bool) -> None:
        target = str(command.get("target", ""))
        future = self._engine.submit_park(target) if park else self._engine.submit_unpark(target)
        op = "park" if park else "unpark"

        def done(finished: Future[Any]) -> None:
            result = finished.result()
            line: Json = {"op": op, "ok": result.ok, "target": target, "parked": result.parked}
            line["freed_bytes" if park else "loaded_bytes"] = result.bytes
            if result.error:
                line["error"] = result.error.to_json()
            self.write(line)

        self._track(future, done)

    def _slots(self, command: Json, op: str) -> None:
        slot = command.get("slot")
        path = command.get("path")
        future = self._engine.submit_slots(op, slot, Path(path) if path else None)
        name = command["op"]

        def done(finished: Future[Any]) -> None:
            result = finished.result()
            slots = [info.to_json() for info in result.slots]
            line: Json = {"op": name, "ok": result.ok, "slot": result.slot, "slots": slots}
            if result.error:
                line["error"] = result.error.to_json()
            self.write(line)

        self._track(future, done)

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

    def _track(self, future: Future[Any], done: Callable[[Future[Any]], None]) -> None:
        self._pending.append(future)
        future.add_done_callback(done)


def _op_of(line: str) -> str | None:
    try:
        command = json.loads(line)
    except ValueError:
        return None
    return command.get("op") if isinstance(command, dict) else None


def run_session(load: LoadRequest, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    engine = Engine()
    session = Session(engine, stdout)
    try:
        loaded = engine.load(load)
        ready: Json = {"op": "load", "ok": loaded.ok, "seconds": round(loaded.seconds, 3)}
        if loaded.info:
            ready["model"] = asdict(loaded.info)
        if loaded.error:
            ready["error"] = loaded.error.to_json()
        session.write(ready)
        for line in stdin:
            if not session.handle(line):
                break
        session.wait()
    finally:
        engine.close()
    return 0
