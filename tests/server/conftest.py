"""A real `ds4desk serve` process on the embedded SmolLM2 (CPU, float32), on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key-7f3a"


@dataclass(slots=True)
class Served:
    base_url: str  # http://127.0.0.1:PORT/v1
    root: str  # http://127.0.0.1:PORT
    host: str
    port: int
    model: str
    pid: int | None = None  # the serving process, when it is one of its own


def ds4desk(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(home), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def serving(home: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """`ds4desk serve --device cpu --port 0 --api-key API_KEY EXTRA...` until Ctrl+C at the end;
    `env`: variables added to this process's environment for it."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "ds4desk", "--data-dir", str(home), "serve", "--device", "cpu",
             "--port", "0", "--api-key", API_KEY, *extra],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **env} if env else None,
        )  # fmt: skip
    assert process.stdout is not None
    ready = process.stdout.readline()  # the ready line, or "" when it died loading
    if "serving" not in ready:
        process.kill()
        pytest.fail(f"ds4desk serve did not start: {ready!r} {log.read_text()}")
    root = ready.split(" at ", 1)[1].split()[0].removesuffix("/v1")
    host, port = root.removeprefix("http://").rsplit(":", 1)
    model = ready.split("serving ", 1)[1].split(" at ")[0]
    try:
        yield Served(f"{root}/v1", root, host, int(port), model, process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
    # Ctrl+C is the documented way to stop it: 130, like every verb after Ctrl+C, and no traceback.
    assert code == 130, log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="session")
def server(ds4_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(ds4_home, tmp_path_factory.mktemp("serve") / "stderr.txt") as served:
        yield served


@pytest.fixture(scope="session")
def generated(ds4_home: Path) -> dict[str, object]:
    """What `ds4desk generate` answers greedily to the prompt the server tests send."""
    out = ds4desk(
        "generate", "--device", "cpu", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json",
        home=ds4_home,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROMPT = "Name three colours of the rainbow."
MAX_TOKENS = 16
