"""`ds4desk session` end to end: a real process, the real embedded model, JSON lines both ways."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


class Session:
    def __init__(self, home: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ds4desk", "--data-dir", str(home), "session", "--context", "512"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.held: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(json.loads(line))

    def send(self, line: dict[str, Any] | str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        self.process.stdin.flush()

    def _lines(self) -> Iterator[dict[str, Any]]:
        """Lines held back by an earlier next(), then new ones. Requests run while commands are
        read, so a result may come before the acknowledgement of the cancel that caused it."""
        while self.held:
            yield self.held.pop(0)
        while True:
            yield self.lines.get(timeout=300)

    def next(self, **match: Any) -> dict[str, Any]:
        """The next line whose fields equal `match`; result lines passed on the way are held for
        collect(), other lines are dropped."""
        passed: list[dict[str, Any]] = []
        for line in self._lines():
            if all(line.get(k) == v for k, v in match.items()):
                self.held[:0] = passed
                return line
            if line.get("event") == "result":
                passed.append(line)
        raise AssertionError("unreachable")

    def collect(self, request_id: Any) -> tuple[list[int], dict[str, Any]]:
        """Streamed tokens of one request, then its result line."""
        streamed: list[int] = []
        for line in self._lines():
            if line.get("id") != request_id:
                continue
            if line["event"] == "tokens":
                streamed += line["tokens"]
            else:
                return streamed, line


@pytest.fixture
def session(ds4_home: Path) -> Iterator[Session]:
    s = Session(ds4_home)
    assert s.next(op="load")["ok"]
    yield s
    if s.process.poll() is None:
        s.send({"op": "quit"})
        s.process.wait(timeout=60)


def test_generate_stream_result_and_snapshot_reuse(session: Session) -> None:
    session.send(
        {
            "op": "generate",
            "id": "a",
            "prompt": "Name two planets.",
            "max_tokens": 12,
            "save_snapshot": {"at": None},
        }
    )
    streamed, result = session.collect("a")
    assert result["ok"] and result["event"] == "result" and result["error"] is None
    assert streamed == result["tokens"] and result["text"] and len(result["logprobs"]) == len(streamed)
    assert result["snapshot_slot"] is not None

    session.send({"op": "slots"})
    slots = session.next(op="slots")
    assert slots["ok"] and [s["slot"] for s in slots["slots"]] == [result["snapshot_slot"]]

    follow = result["prompt_tokens"] + result["tokens"][:-1] + [28]
    session.send({"op": "generate", "id": "b", "prompt_tokens": follow, "max_tokens": 4})
    _, again = session.collect("b")
    assert again["ok"] and again["stats"]["reused_tokens"] == len(follow) - 1
    assert again["stats"]["prefill_tokens"] == 1


def test_cancel_park_unpark_slots_on_disk_and_bad_lines(session: Session, tmp_path: Path) -> None:
    session.send(
        {"op": "generate", "id": 7, "raw": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    )
    session.next(id=7, event="tokens")
    session.send({"op": "cancel", "id": 7})
    assert session.next(op="cancel")["ok"]
    _, cancelled = session.collect(7)
    assert cancelled["finish_reason"] == "cancelled" and len(cancelled["tokens"]) < 400

    session.send("this is not json")
    assert session.next(ok=False)["error"]["code"] == "bad_request"
    session.send({"op": "frobnicate"})
    assert session.next(op="frobnicate")["error"]["code"] == "bad_request"
    session.send({"op": "generate", "id": 8})
    assert session.next(op="generate")["error"]["code"] == "bad_request"

    session.send(
        {
            "op": "generate",
            "id": 9,
            "prompt_tokens": [1, 2, 3, 4],
            "max_tokens": 2,
            "save_snapshot": {"at": 4, "slot": 3},
        }
    )
    assert session.collect(9)[1]["snapshot_slot"] == 3
    session.send({"op": "save_slot", "slot": 3, "path": str(tmp_path / "three.safetensors")})
    assert session.next(op="save_slot")["ok"]
    session.send({"op": "free_slot", "slot": 3})
    assert session.next(op="free_slot")["ok"]
    session.send({"op": "free_slot", "slot": 3})
    assert session.next(op="free_slot")["error"]["code"] == "invalid_snapshot_slot"
    session.send({"op": "load_slot", "path": str(tmp_path / "three.safetensors"), "slot": 5})
    loaded = session.next(op="load_slot")
    assert loaded["ok"] and loaded["slot"] == 5
    session.send({"op": "pin_slot", "slot": 5})
    assert session.next(op="pin_slot")["slots"][0]["pinned"]

    session.send({"op": "park", "target": "target"})
    parked = session.next(op="park")
    assert parked["ok"] and parked["freed_bytes"] > 96_000_000  # the packed weights, and the cache
    session.send({"op": "status"})
    assert session.next(op="status")["parked"] is True
    session.send({"op": "unpark", "target": "target"})
    assert session.next(op="unpark")["ok"]
    session.send({"op": "generate", "id": 10, "prompt_tokens": [1, 2, 3, 4], "max_tokens": 2})
    assert session.collect(10)[1]["stats"]["reused_tokens"] == 4  # snapshots survived the park

    session.send({"op": "quit"})
    assert session.process.wait(timeout=60) == 0
