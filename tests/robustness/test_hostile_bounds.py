"""The hostile corpus under the issue's bounds, each case in a real process of ds4desk: every case
ends in a clear error within 30 s (a case that takes longer kills the process and fails the test),
peaks at no more than twice that process's memory on the same work with a normal model, prints no
traceback, writes nothing outside the data directory (HOME, XDG, TMPDIR and the working directory
point into a sandbox that must stay empty), and the process still does normal work afterwards.

- Hostile model files through `ds4desk check` (check_worker.py: the real CLI, one process, the
  peak reset before each case); the normal memory is `check` of the tiny model the files are
  forged from.
- Chat-template memory bombs through a real `ds4desk session` on a tiny model whose chat template
  holds them all (the last message's text picks one); the normal memory is that session answering
  an ordinary message.

test_session_hostile.py holds the session's hostile requests to the same memory bound."""

from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ds4desk.engine.loading import gguf_header
from ds4desk.engine.loading.safetensors_header import MAX_HEADER_BYTES
from tests.robustness.hostile_files import (
    TEMPLATE_BOMBS,
    dispatching_template,
    gguf_file,
    gguf_key,
    with_config,
)
from tests.robustness.hostile_session import RawSession
from tests.robustness.sandbox import Sandbox

CASE_TIMEOUT_S = 30  # the bound
MEMORY_FACTOR = 2  # the bound: 2x the model's normal memory
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.tiny_dense import save_tiny

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    save_tiny("llama", folder)
    shutil.copy(ROOT / "tests" / "engine" / "tiny_tokenizer.json", folder / "tokenizer.json")
    return folder


def _hostile_files(tiny: Path, place: Path) -> dict[str, tuple[Path, str]]:
    """name -> (the file or folder, a word its refusal must contain); all made here."""
    cases: dict[str, tuple[Path, str]] = {}
    for key, value in [
        ("num_hidden_layers", 10**9),
        ("num_hidden_layers", 10**5),
        ("hidden_size", 2**40),
        ("vocab_size", 10**12),
        ("intermediate_size", 2**62),
    ]:
        name = f"{key}={value}"
        cases[name] = (with_config(tiny, place / name, **{key: value}), key)

    v4 = place / "deepseek-v4"
    v4.mkdir()
    (v4 / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 10**9, "num_hash_layers": 0})
    )
    cases["deepseek layer lists"] = (v4, "num_hidden_layers")

    blocks = [
        gguf_key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama",
        gguf_key("llama.block_count") + struct.pack("<II", 4, 10**9),
    ]
    cases["gguf 10^9 blocks"] = (gguf_file(place / "deep.gguf", blocks, tail=bytes(64)), "block_count")
    count = gguf_header.MAX_ARRAY_ELEMENTS + 1
    array = gguf_key("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, count)
    cases["gguf array"] = (gguf_file(place / "array.gguf", [array], tail=bytes(count)), "limited to")
    noise = place / "noise.gguf"
    noise.write_bytes(os.urandom(8192))
    cases["gguf noise"] = (noise, "GGUF")

    header = with_config(tiny, place / "huge-header")
    with (header / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(8 + MAX_HEADER_BYTES + 1 + 16)  # sparse: never read
    cases["safetensors header"] = (header, "implausible")
    truncated = with_config(tiny, place / "truncated")
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 3)
    cases["truncated weights"] = (truncated, "model.safetensors")

    loop_a, loop_b = place / "loop-a", place / "loop-b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    cases["symlink loop"] = (loop_a, "symbolic links")
    dangling = place / "dangling"
    dangling.symlink_to(place / "nowhere")
    cases["dangling link"] = (dangling, "does not exist")
    return cases


class Checker:
    """check_worker.py in the sandbox; check(path) waits at most CASE_TIMEOUT_S for its answer."""

    def __init__(self, box: Sandbox) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.robustness.check_worker", str(box.data)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**box.env, "PYTHONPATH": str(ROOT)}, cwd=box.cwd,
        )  # fmt: skip
        self.answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.answers.put(line)

    def check(self, path: Path, timeout: float = CASE_TIMEOUT_S) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        try:
            return json.loads(self.answers.get(timeout=timeout))
        except queue.Empty:
            self.process.kill()
            pytest.fail(f"`check {path}` took more than {timeout} s")

    def close(self) -> str:
        """Ends the worker; its stderr (nothing of the checks: those are captured per case)."""
        _, stderr = self.process.communicate(timeout=60)
        return stderr


def test_hostile_files_end_in_a_clear_error_within_time_and_memory(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    box = Sandbox.make(tmp_path / "box")
    cases = _hostile_files(tiny_model, tmp_path / "files")
    checker = Checker(box)
    try:
        # The first check pays for the imports: the normal memory is the second one.
        first = checker.check(tiny_model, timeout=300)
        assert first["code"] == 0, first
        normal = checker.check(tiny_model)
        assert normal["code"] == 0 and "Traceback" not in normal["err"], normal
        ratios: dict[str, float] = {}
        for name, (path, words) in cases.items():
            answer = checker.check(path)
            assert answer["code"] == 2, (name, answer)
            err = answer["err"].strip()
            assert "Traceback" not in err and len(err.splitlines()) == 1 and words in err, (name, err)
            ratios[name] = answer["peak_kib"] / normal["peak_kib"]
            assert answer["peak_kib"] <= MEMORY_FACTOR * normal["peak_kib"], (name, answer, normal)
        again = checker.check(tiny_model)  # still alive, still right
        assert again["code"] == 0 and again["out"] == normal["out"], again
    finally:
        stderr = checker.close()
    assert "Traceback" not in stderr, stderr
    assert box.written_outside_data() == []
    with capsys.disabled():
        worst = max(ratios, key=ratios.__getitem__)
        print(f"\ncheck: normal peak {normal['peak_kib'] / 1024:.0f} MiB; worst hostile/normal "
              f"{ratios[worst]:.3f} ({worst}) over {len(ratios)} files")  # fmt: skip


@pytest.fixture
def bomb_session(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[RawSession, Sandbox]]:
    model = Path(shutil.copytree(tiny_model, tmp_path / "bombs"))
    (model / "chat_template.jinja").write_text(dispatching_template(TEMPLATE_BOMBS))
    box = Sandbox.make(tmp_path / "box")
    session = RawSession(box.data, str(model), "--device", "cpu", env=box.env, cwd=box.cwd)
    assert session.answer(timeout=300)["ok"], session.stderr  # loaded: the template compiles
    yield session, box
    if session.process.poll() is None:
        session.send({"op": "quit"})
    assert session.exit_code(60) == 0
    assert b"Traceback" not in session.stderr, session.stderr.decode(errors="replace")
    assert box.written_outside_data() == []


def _chat(session: RawSession, request_id: str, text: str) -> dict[str, Any]:
    session.send({"op": "generate", "id": request_id, "messages": [{"role": "user", "content": text}],
                  "max_tokens": 4})  # fmt: skip
    return session.until(id=request_id, event="result")  # each line within 30 s, or the test fails


def test_chat_template_bombs_in_a_session_end_in_a_clear_error_within_time_and_memory(
    bomb_session: tuple[RawSession, Sandbox], capsys: pytest.CaptureFixture[str]
) -> None:
    session, _ = bomb_session
    assert _chat(session, "warm", "t1 t2 t3")["ok"]
    session.reset_peak()
    assert _chat(session, "normal", "t4 t5 t6")["ok"]
    normal = session.peak_kib()
    ratios: dict[str, float] = {}
    for n, name in enumerate(TEMPLATE_BOMBS):
        session.reset_peak()
        answer = _chat(session, f"bomb-{n}", name)
        peak = session.peak_kib()
        error = answer.get("error") or {}
        assert answer["ok"] is False and error.get("code") == "bad_request", (name, answer)
        assert "chat template" in error.get("detail", ""), (name, answer)
        ratios[name] = peak / normal
        assert peak <= MEMORY_FACTOR * normal, (name, peak, normal)
    assert _chat(session, "after", "t7 t8 t9")["ok"]  # the session still answers
    with capsys.disabled():
        worst = max(ratios, key=ratios.__getitem__)
        print(f"\nsession: normal peak {normal / 1024:.0f} MiB; worst bomb/normal {ratios[worst]:.3f} "
              f"({worst}) over {len(ratios)} templates")  # fmt: skip
