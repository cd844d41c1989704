"""What `ds4desk` does before and after the model's work: the command line imports nothing heavy,
reads its version only when asked, reports the load with its warm-up, and on the real command line
leaves the exit's garbage walk out (gc.freeze) while tests that call main(argv) keep theirs. The
runs are real processes on the real embedded SmolLM2."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from ds4desk import cli

PYTHON = sys.executable
PROMPT = ["--prompt-tokens", "1,504,3101,198,12,1,9690,198,19556,28,2,198", "--max-tokens", "6"]


def run(*args: str, home: Path, code: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [PYTHON, "-c", code, *args] if code else [PYTHON, "-m", "ds4desk", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment(home))


def environment(home: Path) -> dict[str, str]:
    return {**os.environ, "DS4DESK_HOME": str(home)}


def test_importing_the_command_line_loads_no_torch_and_no_package_metadata(tmp_path: Path) -> None:
    code = "import sys, json, ds4desk.cli; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(run(home=tmp_path, code=code).stdout))
    assert "ds4desk.cli" in loaded
    assert not {"torch", "numpy", "importlib.metadata", "ds4desk.engine"} & loaded


def test_version_is_read_when_asked(tmp_path: Path) -> None:
    out = run("--version", home=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"ds4desk {version('ds4desk')}"


def test_generate_reports_the_load_with_its_warm_up_and_answers_the_same(tmp_path: Path) -> None:
    warm = run("generate", *PROMPT, home=tmp_path)
    cold = run("generate", *PROMPT, "--no-warm-up", home=tmp_path)
    assert warm.returncode == 0 and cold.returncode == 0, (warm.stderr, cold.stderr)
    assert warm.stdout == cold.stdout and warm.stdout.strip()
    load_lines = [line for line in warm.stderr.splitlines() if line.startswith("load ")]
    assert len(load_lines) == 1 and "of which warm-up" in load_lines[0]
    total, warm_up = (float(word) for word in load_lines[0].replace(",", "").split() if _number(word))
    assert 0 < warm_up < total
    cold_lines = [line for line in cold.stderr.splitlines() if line.startswith("load ")]
    assert len(cold_lines) == 1 and "warm-up" not in cold_lines[0]


def test_the_session_says_how_long_its_warm_up_took(tmp_path: Path) -> None:
    out = subprocess.run(
        [PYTHON, "-m", "ds4desk", "session", "--context", "256"],
        input="",
        capture_output=True,
        text=True,
        timeout=600,
        env=environment(tmp_path),
    )
    ready = json.loads(out.stdout.splitlines()[0])
    assert ready["op"] == "load" and ready["ok"] is True
    assert 0 < ready["warm_up_seconds"] < ready["seconds"]


def test_the_real_command_line_freezes_the_collector_before_exit(tmp_path: Path) -> None:
    model = tmp_path / "not-a-model"
    model.mkdir()
    code = (
        "import gc, sys; from ds4desk.cli import main; sys.argv = ['ds4desk', 'check', sys.argv[1]]; "
        "before = gc.get_freeze_count(); code = main(); print(before, gc.get_freeze_count(), code)"
    )
    before, after, code = run(str(model), home=tmp_path, code=code).stdout.split()
    assert before == "0" and int(after) > 0 and code == "2"  # check's answer is unchanged


def test_main_called_with_arguments_keeps_the_collector(tmp_path: Path) -> None:
    model = tmp_path / "not-a-model"
    model.mkdir()
    frozen = gc.get_freeze_count()
    assert cli.main(["--data-dir", str(tmp_path / "home"), "check", str(model)]) == 2
    assert gc.get_freeze_count() == frozen


def _number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
