"""Our own safetensors header reader: good files parse, every kind of bad header is a clear error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.safetensors_header import read_safetensors_header


def _raw(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", size) + blob + data)
    return path


def _error(path: Path) -> str:
    with pytest.raises(EngineFailure) as exc:
        read_safetensors_header(path)
    assert exc.value.error.code == ErrorCode.LOAD_FAILED
    assert path.name in exc.value.error.detail
    return exc.value.error.detail


def test_reads_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "a": np.zeros((3, 4), dtype=np.float32),
            "b": np.ones(5, dtype=np.float16),
            "empty": np.zeros((0, 7), dtype=np.float32),
        },
        str(path),
        metadata={"format": "pt"},
    )
    entries = read_safetensors_header(path)
    assert set(entries) == {"a", "b", "empty"}
    a = entries["a"]
    assert (a.file, a.dtype, a.shape, a.end - a.begin) == (path, "F32", (3, 4), 48)
    assert entries["b"].dtype == "F16" and entries["b"].end - entries["b"].begin == 10
    assert entries["empty"].shape == (0, 7)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": np.zeros((64, 64), dtype=np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    detail = _error(path)
    assert "is truncated: header promises 16384 bytes of data, file has 15384" in detail


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "only 0 bytes"),
        (b"\x01\x02\x03", "only 3 bytes"),
        (struct.pack("<Q", 1 << 60) + b"{}", "implausible"),
        (struct.pack("<Q", 5000) + b'{"a": 1}', "larger than the rest of the file"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 200, "implausible"),
    ],
)
def test_bogus_header_lengths(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    assert problem in _error(path)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (b"\xff\xfe not utf8", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        ({"w": "nope"}, "not an object"),
        ({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "bad shape"),
        ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "bad shape"),
        ({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, "bad shape"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, "bad data_offsets"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, "bad data_offsets"),
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
            "needs 8 bytes but its offsets span 4",
        ),
        ({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, "whole number of bytes"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "overlap",
        ),
    ],
)
def test_bad_headers(tmp_path: Path, header: object, problem: str) -> None:
    path = _raw(tmp_path / "bad.safetensors", header, data=b"\0" * 16)
    assert problem in _error(path)


def test_metadata_and_sub_byte_types_are_accepted(tmp_path: Path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "packed": {"dtype": "F4", "shape": [4, 2], "data_offsets": [0, 4]},
        "scale": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [4, 8]},
    }
    entries = read_safetensors_header(_raw(tmp_path / "fp4.safetensors", header, data=b"\0" * 8))
    assert set(entries) == {"packed", "scale"} and entries["packed"].shape == (4, 2)


def test_missing_file_is_a_load_failure(tmp_path: Path) -> None:
    with pytest.raises(EngineFailure) as exc:
        read_safetensors_header(tmp_path / "nope.safetensors")
    assert exc.value.error.code == ErrorCode.LOAD_FAILED and "nope.safetensors" in exc.value.error.detail
