"""`ds4desk generate --remote URL`: the command line's answer from a server equals the engine's own."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from ds4desk.engine.api import GenerateRequest
from ds4desk.engine.engine import Engine
from tests.remote.conftest import KEY
from tests.server.conftest import Served

PROMPT = "Name a primary colour."


def ds4desk(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(home), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_remote_answers_as_the_engine_does(served: tuple[Served, Engine], tmp_path: Path) -> None:
    server, engine = served
    messages = [{"role": "user", "content": PROMPT}]
    local = engine.generate(GenerateRequest(messages=messages, max_new_tokens=8, use_snapshots=False))
    out = ds4desk(
        tmp_path, "generate", "--remote", server.base_url, "--api-key", KEY, "--model", server.model,
        "--prompt", PROMPT, "--max-tokens", "8", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["text"] == local.text
    assert answer["stats"]["generated_tokens"] == local.stats.generated_tokens


def test_generate_remote_without_a_server_fails_clearly(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = ds4desk(tmp_path, "generate", "--remote", f"http://127.0.0.1:{port}", "--prompt", "hi", "--json")
    assert out.returncode == 1
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert "connection refused" in answer["error"]["detail"]
