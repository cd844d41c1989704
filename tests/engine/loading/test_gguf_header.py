"""The GGUF header reader's string arrays (a tokenizer's vocabulary and merges, read in one loop):
the same strings gguf-py's own reader gives on real files, stray bytes kept as replacement
characters, and a file cut inside such an array refused with the key it was reading."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.gguf_header import read_gguf_header
from tests.real_models import smollm2_gguf

TOKENS = ["<s>", "hello", " wörld", "tok-3", "日本", ""]


def test_string_arrays_equal_gguf_pys_on_the_embedded_model() -> None:
    path = smollm2_gguf()
    ours = read_gguf_header(path).metadata
    theirs = gguf.GGUFReader(path).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert ours[key] == theirs[key].contents()
    assert len(ours["tokenizer.ggml.tokens"]) == 49152


def small_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(TOKENS)
    writer.add_string("general.name", "after the array")
    writer.add_tensor("t", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_strings_and_what_follows_them_are_read(tmp_path: Path) -> None:
    header = read_gguf_header(small_gguf(tmp_path / "small.gguf"))
    assert header.metadata["tokenizer.ggml.tokens"] == TOKENS
    assert header.metadata["general.name"] == "after the array"


def test_a_stray_byte_in_a_token_becomes_a_replacement_character(tmp_path: Path) -> None:
    path = small_gguf(tmp_path / "small.gguf")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"tok-3", b"tok\xff3", 1))
    assert read_gguf_header(path).metadata["tokenizer.ggml.tokens"][3] == "tok\ufffd3"


@pytest.mark.parametrize("cut", ["in a length", "in a string"])
def test_a_file_cut_inside_the_array_names_the_key(tmp_path: Path, cut: str) -> None:
    path = small_gguf(tmp_path / "small.gguf")
    data = path.read_bytes()
    at = data.index(b"hello")  # the second token's bytes, after its 8-byte length
    path.write_bytes(data[: at - 4 if cut == "in a length" else at + 2])
    with pytest.raises(EngineFailure) as caught:
        read_gguf_header(path)
    assert caught.value.error.code == ErrorCode.LOAD_FAILED
    detail = caught.value.error.detail
    assert "truncated" in detail and "tokenizer.ggml.tokens" in detail and path.name in detail
