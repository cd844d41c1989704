"""A `ds4desk session` process for hostile-input tests: raw bytes in, every output line kept as bytes
so a test can check that each one is valid UTF-8 JSON."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.robustness.sandbox import peak_kib, reset_peak

ANSWER_TIMEOUT_S = 30  # the bound: every case ends within 30 s


class RawSession:
    def __init__(
        self, home: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ds4desk", "--data-dir", str(home), "session", "--context", "512", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.stderr = b""
        threading.Thread(target=self._read, daemon=True).start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr += line

    def reset_peak(self) -> None:
        reset_peak(self.process.pid)

    def peak_kib(self) -> int:
        return peak_kib(self.process.pid)

    def exit_code(self, timeout: float = ANSWER_TIMEOUT_S) -> int:
        """Waits for the process to end and for the last of its stderr."""
        code = self.process.wait(timeout=timeout)
        self._stderr_reader.join(timeout)
        return code

    def send_bytes(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data if data.endswith(b"\n") else data + b"\n")
        self.process.stdin.flush()

    def send(self, command: dict[str, Any] | str) -> None:
        text = command if isinstance(command, str) else json.dumps(command)
        self.send_bytes(text.encode("utf-8", errors="surrogatepass"))

    def answer(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        """The next line, checked to be strict UTF-8 and one JSON object."""
        raw = self.lines.get(timeout=timeout)
        line = json.loads(raw.decode("utf-8"))  # strict: a lone surrogate would fail here
        assert isinstance(line, dict)
        return line

    def until(self, **match: Any) -> dict[str, Any]:
        while True:
            line = self.answer()
            if all(line.get(k) == v for k, v in match.items()):
                return line

    def one_answer(self, command: dict[str, Any] | str | bytes) -> dict[str, Any]:
        """Send `command` and a `slots` probe: the probe runs on the engine queue behind whatever the
        command started, so the two answers come in order and exactly one belongs to the command."""
        if isinstance(command, bytes):
            self.send_bytes(command)
        else:
            self.send(command)
        self.send({"op": "slots"})
        first = self.answer()
        probe = self.answer()
        assert first.get("op") != "slots" or command_op(command) == "slots", first
        assert probe.get("op") == "slots" and probe["ok"], probe
        return first


def command_op(command: dict[str, Any] | str | bytes) -> str | None:
    return command.get("op") if isinstance(command, dict) else None
