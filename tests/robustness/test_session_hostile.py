"""`ds4desk session` against hostile requests: every line gets exactly one answer (within 30 s,
else the test fails), a clear bad_request where it must refuse, the answers stay valid UTF-8 JSON,
nothing is written outside the data directory, no traceback reaches stderr, and the session still
answers afterwards. Every case that runs on the shared session is held to at most twice the
session's peak memory on a normal request (VmHWM, reset before each case)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from tests.robustness.hostile_session import ANSWER_TIMEOUT_S, RawSession
from tests.robustness.sandbox import Sandbox

MEMORY_FACTOR = 2  # the bound: 2x the model's normal memory


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    """Every session of this module runs here: HOME, XDG, TMPDIR and its working directory in
    the sandbox, so test_nothing_was_written_outside_the_data_directory can look at them."""
    return Sandbox.make(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def home(box: Sandbox) -> Path:
    return box.data


@pytest.fixture(scope="module")
def session(box: Sandbox) -> Iterator[RawSession]:
    strict = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    s = RawSession(box.data, env={**box.env, **strict}, cwd=box.cwd)
    assert s.answer(timeout=300)["ok"]  # the embedded model loaded
    yield s
    if s.process.poll() is None:
        s.send({"op": "quit"})
    assert s.exit_code(60) == 0
    assert b"Traceback" not in s.stderr, s.stderr.decode(errors="replace")


@pytest.fixture(scope="module")
def normal_peak(session: RawSession) -> int:
    """The session's peak memory (KiB) over a normal request: a chat message answered, with a
    snapshot saved, as the window asks."""
    session.reset_peak()
    session.send({"op": "generate", "id": "normal", "messages": [{"role": "user", "content": "Hi there"}],
                  "max_tokens": 8, "save_snapshot": {}})  # fmt: skip
    assert session.until(id="normal", event="result")["ok"]
    return session.peak_kib()


@pytest.fixture(autouse=True)
def bounded_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each case on the shared session peaks at most MEMORY_FACTOR times the normal request."""
    if "session" not in request.fixturenames:
        yield
        return
    session: RawSession = request.getfixturevalue("session")
    normal: int = request.getfixturevalue("normal_peak")
    session.reset_peak()
    yield
    peak = session.peak_kib()
    PEAKS[request.node.name] = peak / normal
    assert peak <= MEMORY_FACTOR * normal, f"peak {peak} KiB against {normal} KiB normally"


PEAKS: dict[str, float] = {}  # case -> peak / normal, printed by the last test


def _bad(answer: dict[str, object]) -> bool:
    error = answer.get("error")
    return answer.get("ok") is False and isinstance(error, dict) and error.get("code") == "bad_request"


HOSTILE_LINES = [
    '{"op":"generate","id":"a","raw":"x","max_tokens":Infinity}',
    '{"op":"generate","id":"a","raw":"x","max_tokens":1e400}',
    '{"op":"generate","id":"a","raw":"x","max_tokens":NaN}',
    '{"op":"generate","id":"a","raw":"x","top_k":-Infinity}',
    '{"op":"generate","id":"a","raw":"x","top_k":1e400}',
    '{"op":"generate","id":"a","raw":"x","temperature":1e400}',
    '{"op":"generate","id":"a","raw":"x","thinking_budget":{"max_tokens":1e400,"close_tokens":[1]}}',
    '{"op":"generate","id":"a","raw":"x","seed":' + str(2**70) + "}",
    '{"op":"generate","id":"a","raw":"x","max_tokens":' + "9" * 5000 + "}",
    '{"op":"generate","id":"a","prompt_tokens":[' + str(2**70) + "]}",
    '{"op":"generate","id":"a","raw":"x","save_snapshot":{"at":"3"}}',
    '{"op":"generate","id":"a","raw":"x","save_snapshot":{"slot":[0]}}',
    '{"op":"generate","id":{"x":1},"raw":"x"}',
    '{"op":"generate","id":"a","raw":"\\ud800"}',
    '{"op":"generate","id":"\\udfff","raw":"x"}',
    '{"op":"generate","id":"a","messages":[{"role":"user","content":"\\ud800"}]}',
    '{"op":"free_slot","slot":[0]}',
    '{"op":"free_slot","slot":"3"}',
    '{"op":"pin_slot","slot":true}',
    '{"op":"save_slot","slot":1.5,"path":"x.safetensors"}',
    '{"op":"save_slot","slot":0,"path":["x"]}',
    '{"op":"load_slot","path":7}',
    '{"op":"park","target":[1]}',
    '{"op":"cancel","id":[1]}',
    '{"op":"\\ud800"}',
    "[" * 100_000 + "]" * 100_000,
    '{"op":"generate","x":' + "[" * 100_000 + "]" * 100_000 + "}",
]


@pytest.mark.parametrize("line", HOSTILE_LINES, ids=range(len(HOSTILE_LINES)))
def test_each_hostile_line_gets_one_clear_refusal(session: RawSession, line: str) -> None:
    answer = session.one_answer(line)
    assert _bad(answer), answer


def test_bytes_that_are_not_utf8_are_refused_under_a_strict_locale(session: RawSession) -> None:
    answer = session.one_answer(b'{"op":"generate","id":"a","raw":"caf\xe9 \xff"}')
    assert _bad(answer), answer
    assert "UTF-8" in answer["error"]["detail"]


def test_the_session_still_answers_correctly_afterwards(session: RawSession) -> None:
    session.send({"op": "generate", "id": "after", "raw": "Once upon a time", "max_tokens": 3})
    result = session.until(id="after", event="result")
    assert result["ok"] and len(result["tokens"]) == 3


def test_slot_files_only_ever_replace_regular_files(session: RawSession, home: Path, tmp_path: Path) -> None:
    session.send({"op": "generate", "id": "s", "prompt_tokens": [1, 2, 3, 4], "max_tokens": 1,
                  "save_snapshot": {"at": 4, "slot": 2}})  # fmt: skip
    assert session.until(id="s", event="result")["snapshot_slot"] == 2

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    link = tmp_path / "link.safetensors"
    regular = tmp_path / "kept.txt"
    regular.write_text("mine")
    link.symlink_to(regular)
    targets = [fifo, folder, link, Path("/proc/ds4desk-no-such-file")]
    if Path("/dev/full").exists():
        targets.append(Path("/dev/full"))
    for target in targets:
        answer = session.one_answer({"op": "save_slot", "slot": 2, "path": str(target)})
        assert _bad(answer) and str(target) in answer["error"]["detail"], answer
    assert stat.S_ISFIFO(fifo.stat().st_mode) and folder.is_dir() and link.is_symlink()
    assert regular.read_text() == "mine"
    if Path("/dev/full").exists():
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)

    # Reading: a FIFO would block forever and a device never ends; both are refused at once.
    for source in (fifo, folder, Path("/dev/zero")):
        answer = session.one_answer({"op": "load_slot", "path": str(source)})
        assert answer["ok"] is False and answer["error"]["code"] == "invalid_snapshot_slot", answer

    # A relative path lands in the data directory, not wherever the session was started.
    answer = session.one_answer({"op": "save_slot", "slot": 2, "path": "mine.safetensors"})
    assert answer["ok"], answer
    saved = home / "snapshots" / "mine.safetensors"
    assert saved.is_file()
    assert [p.name for p in saved.parent.iterdir()] == ["mine.safetensors"]  # no partial file left


def test_forged_snapshot_tensors_are_refused(session: RawSession, home: Path, tmp_path: Path) -> None:
    saved = home / "snapshots" / "forge-me.safetensors"
    session.send({"op": "generate", "id": "f", "prompt_tokens": [5, 6, 7, 8, 9], "max_tokens": 1,
                  "save_snapshot": {"at": 5, "slot": 4}})  # fmt: skip
    assert session.until(id="f", event="result")["snapshot_slot"] == 4
    assert session.one_answer({"op": "save_slot", "slot": 4, "path": str(saved)})["ok"]
    with safe_open(str(saved), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    kv_name = next(k for k in tensors if k.startswith("state."))

    def forged(name: str, **changes: object) -> Path:
        out = tmp_path / f"{name}.safetensors"
        save_file({**tensors, **changes}, str(out), metadata=meta)  # type: ignore[arg-type]
        return out

    import torch

    kv = tensors[kv_name]
    rows = max(i for i, n in enumerate(kv.shape) if n == 5)  # the dimension that holds the 5 tokens
    cases = {
        "broadcastable": forged("broadcastable", **{kv_name: torch.zeros(1)}),
        "one-short": forged("one-short", **{kv_name: kv.narrow(rows, 0, 4).clone()}),
        "wrong-dtype": forged("wrong-dtype", **{kv_name: kv.to(torch.float16)}),
        "extra": forged("extra", **{"state.extra": torch.zeros(3)}),
        "logits": forged("logits", logits=torch.zeros(7)),
    }
    tokens_out_of_vocab = tmp_path / "vocab.safetensors"
    save_file(tensors, str(tokens_out_of_vocab), metadata={**meta, "tokens": json.dumps([5, 6, 7, 8, 10**9])})
    cases["vocab"] = tokens_out_of_vocab
    for name, path in cases.items():
        answer = session.one_answer({"op": "load_slot", "path": str(path), "slot": 6})
        assert answer["ok"] is False and answer["error"]["code"] == "invalid_snapshot_slot", (name, answer)
    slots = session.one_answer({"op": "slots"})["slots"]
    assert 6 not in [s["slot"] for s in slots]  # nothing was restored
    # The genuine file still loads.
    assert session.one_answer({"op": "load_slot", "path": str(saved), "slot": 6})["ok"]


def test_quit_cancels_queued_work_instead_of_draining_it(box: Sandbox) -> None:
    s = RawSession(box.data, env=box.env, cwd=box.cwd)
    assert s.answer(timeout=300)["ok"]
    for n in range(3):
        s.send({"op": "generate", "id": n, "raw": "Once upon a time", "max_tokens": 400, "ignore_eos": True})
    s.send({"op": "quit"})
    results = [s.until(event="result") for _ in range(3)]
    assert s.exit_code() == 0
    assert all(r["finish_reason"] == "cancelled" for r in results), results
    assert sum(len(r["tokens"]) for r in results) < 400  # the first one was cut, the others never ran


def test_ctrl_c_during_a_session_cancels_and_exits_130(box: Sandbox) -> None:
    s = RawSession(box.data, env=box.env, cwd=box.cwd)
    assert s.answer(timeout=300)["ok"]
    s.send({"op": "generate", "id": 1, "raw": "Once upon a time", "max_tokens": 400, "ignore_eos": True})
    assert s.until(id=1, event="tokens")
    s.process.send_signal(signal.SIGINT)
    assert s.exit_code() == 130
    assert b"Traceback" not in s.stderr, s.stderr


def test_ctrl_c_during_generate_exits_130_without_a_traceback(box: Sandbox) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(box.data), "generate",
         "--raw", "Once upon a time", "--max-tokens", "4000", "--context", "4096"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=box.env, cwd=box.cwd,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stdout.read(1)  # the first token is out: it is generating
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=ANSWER_TIMEOUT_S)
    assert process.returncode == 130
    assert b"Traceback" not in stderr


def test_a_closed_stdout_ends_the_session_quietly(box: Sandbox) -> None:
    read_end, write_end = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(box.data), "session", "--context", "512"],
        stdin=subprocess.PIPE, stdout=write_end, stderr=subprocess.PIPE, env=box.env, cwd=box.cwd,
    )  # fmt: skip
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        assert json.loads(reader.readline())["ok"]  # loaded; then the reader goes away
    assert process.stdin is not None
    for command in (
        {"op": "generate", "id": 1, "raw": "Once upon a time", "max_tokens": 5},
        {"op": "status"},
        {"op": "status"},
    ):
        process.stdin.write(json.dumps(command).encode() + b"\n")
        process.stdin.flush()
    _, stderr = process.communicate(timeout=ANSWER_TIMEOUT_S)
    assert process.returncode in (0, 1)
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr


def test_nothing_was_written_outside_the_data_directory(box: Sandbox) -> None:
    """Last in this module: every session above ran with HOME, XDG, TMPDIR and its working
    directory in the sandbox; only the data directory may have changed."""
    if PEAKS:
        worst = max(PEAKS, key=PEAKS.__getitem__)
        print(f"\npeak / normal over {len(PEAKS)} session cases: worst {PEAKS[worst]:.3f} ({worst})")
    assert box.written_outside_data() == []
