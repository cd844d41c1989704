"""Hostile model files and paths, each generated here: every one ends in a clear error from `check`
(exit status 2, one line, no traceback) before memory is spent on what the file claims."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pytest

from ds4desk.cli import main as cli_main
from ds4desk.engine.api import EngineFailure
from ds4desk.engine.loading import gguf_header
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_header import read_gguf_header
from ds4desk.engine.loading.safetensors_header import MAX_HEADER_BYTES, read_safetensors_header
from tests.engine.tiny_dense import save_tiny
from tests.robustness.hostile_files import gguf_file, gguf_key, with_config


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny("llama", folder)
    return folder


def _check(path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`ds4desk check PATH`: refused with status 2 and one line on stderr; that line."""
    code = cli_main(["--data-dir", str(home), "check", str(path)])
    out = capsys.readouterr()
    assert code == 2, out
    assert "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1, out.err
    return out.err


@pytest.mark.parametrize(
    "changes",
    [
        {"num_hidden_layers": 10**9},
        {"num_hidden_layers": 10**5},
        {"hidden_size": 2**40},
        {"vocab_size": 10**12},
        {"intermediate_size": 2**62},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_config_with_absurd_sizes_is_refused_before_anything_is_built(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, int]
) -> None:
    folder = with_config(tiny_llama, tmp_path / "model", **changes)
    tracemalloc.start()
    try:
        err = _check(folder, tmp_path, capsys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    key = next(iter(changes))
    assert key in err and "more than" in err
    assert peak < 64 * 2**20  # nothing sized from the claim was allocated


def test_a_deepseek_config_with_a_billion_layers_is_refused_before_its_layer_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # normalize_config would build ["moe"] * layers from num_hash_layers: 8 GB for 10^9 layers.
    folder = tmp_path / "v4"
    folder.mkdir()
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 10**9, "num_hash_layers": 0}
    (folder / "config.json").write_text(json.dumps(config))
    assert "num_hidden_layers" in _check(folder, tmp_path, capsys)


def test_a_gguf_with_a_billion_blocks_is_refused_in_its_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = [
        gguf_key("general.architecture") + struct.pack("<IQ", 8, 5) + b"llama",
        gguf_key("llama.block_count") + struct.pack("<II", 4, 10**9),
    ]
    path = gguf_file(tmp_path / "deep.gguf", entries, tail=bytes(64))
    assert "block_count" in _check(path, tmp_path, capsys)


def test_a_huge_gguf_metadata_array_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    count = gguf_header.MAX_ARRAY_ELEMENTS + 1
    entry = gguf_key("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, count)  # an array of u8
    path = gguf_file(tmp_path / "array.gguf", [entry], tail=bytes(count))
    tracemalloc.start()
    try:
        with pytest.raises(EngineFailure, match="limited to"):
            read_gguf_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size  # not ten times the file, not even once


def test_gguf_string_metadata_is_bounded_as_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real limit is 256 MiB; a smaller one shows the same check without writing that much.
    monkeypatch.setattr(gguf_header, "MAX_METADATA_BYTES", 2**20)
    strings = b"".join(struct.pack("<Q", 100) + b"x" * 100 for _ in range(20_000))  # 2.1 MB
    entry = gguf_key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 20_000) + strings
    with pytest.raises(EngineFailure, match="metadata is larger than 1 MiB"):
        read_gguf_header(gguf_file(tmp_path / "strings.gguf", [entry], tail=bytes(64)))


def test_a_huge_safetensors_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    length = MAX_HEADER_BYTES + 1
    with path.open("wb") as f:
        f.write(struct.pack("<Q", length))
        f.truncate(8 + length + 16)  # sparse: the header bytes exist, and are never read
    tracemalloc.start()
    try:
        with pytest.raises(EngineFailure, match="implausible"):
            read_safetensors_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_a_symlink_loop_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    assert "symbolic links" in _check(a, tmp_path, capsys)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "symbolic link to something that does not exist" in _check(dangling, tmp_path, capsys)


def test_a_folder_we_may_not_read_gives_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    """As root, mode 000 still reads: the check then runs in a child that dropped to `nobody`."""
    # pytest's own tmp folders are closed to other users: this one is open down to the model folder.
    place = Path(tempfile.mkdtemp(prefix="ds4desk-closed-", dir="/tmp"))
    place.chmod(0o777)
    folder = Path(shutil.copytree(tiny_llama, place / "closed"))
    folder.chmod(0)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            sys.stderr = err = io.StringIO()
            code = cli_main(["--data-dir", str(place), "check", str(folder)])
            payload = json.dumps({"code": code, "err": err.getvalue()})
        except BaseException as exc:  # anything escaping is what the test looks for
            payload = json.dumps({"code": -1, "err": f"escaped: {type(exc).__name__}: {exc}"})
        os.write(write_end, payload.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        report = json.loads(reader.read())
    os.waitpid(child, 0)
    folder.chmod(0o755)
    shutil.rmtree(place)
    assert report["code"] == 2, report
    assert "Permission denied" in report["err"] and "Traceback" not in report["err"], report


def test_a_folder_that_is_fine_still_checks(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bounds leave real models alone."""
    assert read_source(tiny_llama).config["num_hidden_layers"] >= 1
    assert cli_main(["--data-dir", str(tmp_path), "check", str(tiny_llama)]) == 0
