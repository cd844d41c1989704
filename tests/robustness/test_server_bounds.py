"""`ds4desk serve` under the issue's bounds: hostile HTTP requests (malformed JSON, numbers that
overflow, deep nesting, bodies over the limit, bytes that are not UTF-8) each get a JSON error
within 30 s (the client's timeout: a slower answer fails the test), at no more than twice the
server's peak memory on a normal request (VmHWM, reset before each case), with no traceback; the
server still answers afterwards, exits 130 on Ctrl+C, and wrote nothing outside its data directory.
(tests/server/test_hostile_requests.py checks each error's status and wording.)"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.robustness.sandbox import Sandbox, peak_kib, reset_peak

CASE_TIMEOUT_S = 30
MEMORY_FACTOR = 2
KEY = "robust22-key"
GOOD = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
HOSTILE: dict[str, bytes | list[bytes]] = {
    "not json": b"{not json",
    "not an object": b"[1, 2]",
    "not utf-8": b"\xff\xfe{}",
    "NaN": b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
    "1e999": b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}',
    "nesting": b"[" * 100_000 + b"]" * 100_000,
    "nested in a field": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "max_tokens 10^30": json.dumps({**GOOD, "max_tokens": 10**30}).encode(),
    "seed 2^70": json.dumps({**GOOD, "seed": 2**70}).encode(),
    "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    "9 MiB body": json.dumps({**GOOD, "padding": "x" * (9 * 2**20)}).encode(),
    "9 MiB chunked": [b"x" * 2**20] * 9,
}


@dataclass(slots=True)
class Server:
    process: subprocess.Popen[str]
    host: str
    port: int

    def post(self, body: bytes | Iterable[bytes]) -> tuple[int, dict[str, Any]]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=CASE_TIMEOUT_S)
        try:
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            chunked = not isinstance(body, bytes)
            connection.request(
                "POST", "/v1/chat/completions", body=body, headers=headers, encode_chunked=chunked
            )
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        assert b"Traceback" not in raw
        return response.status, json.loads(raw)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Sandbox, Path]]:
    root = tmp_path_factory.mktemp("serve-bounds")
    box = Sandbox.make(root / "box")
    log = root / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "ds4desk", "--data-dir", str(box.data), "serve", "--device", "cpu",
             "--port", "0", "--api-key", KEY, "--context", "512"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=box.env, cwd=box.cwd,
        )  # fmt: skip
    assert process.stdout is not None
    ready = process.stdout.readline()
    if "serving" not in ready:
        process.kill()
        pytest.fail(f"ds4desk serve did not start: {ready!r} {log.read_text()}")
    host, port = (
        ready.split(" at ", 1)[1].split()[0].removesuffix("/v1").removeprefix("http://").rsplit(":", 1)
    )
    yield Server(process, host, int(port)), box, log
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def test_hostile_requests_stay_within_time_and_memory(
    served: tuple[Server, Sandbox, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server, box, log = served
    pid = server.process.pid
    assert server.post(json.dumps(GOOD).encode())[0] == 200  # warm
    reset_peak(pid)
    assert server.post(json.dumps(GOOD).encode())[0] == 200
    normal = peak_kib(pid)
    ratios: dict[str, float] = {}
    for name, body in HOSTILE.items():
        reset_peak(pid)
        status, answer = server.post(body)
        peak = peak_kib(pid)
        assert 400 <= status < 500 and set(answer.get("error", {})) >= {"message", "type"}, (
            name,
            status,
            answer,
        )
        ratios[name] = peak / normal
        assert peak <= MEMORY_FACTOR * normal, (name, peak, normal)
    status, answer = server.post(json.dumps(GOOD).encode())  # still answering
    assert status == 200 and answer["choices"][0]["message"]["content"], answer
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=60) == 130
    assert "Traceback" not in log.read_text()
    assert box.written_outside_data() == []
    with capsys.disabled():
        worst = max(ratios, key=ratios.__getitem__)
        print(f"\nserve: normal peak {normal / 1024:.0f} MiB; worst hostile/normal {ratios[worst]:.3f} "
              f"({worst}) over {len(ratios)} requests")  # fmt: skip
