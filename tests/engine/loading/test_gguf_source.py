"""GGUF files loaded in place (loading/gguf_source.py + loader.py): the real SmolLM2 file, tiny
synthetic files in every block type and architecture against transformers, and broken files.

The key oracle: transformers loads the same GGUF (dequantizing it with gguf-py) and runs it in
float32; ds4desk runs it on its packed weights. Packed weights hold exactly the dequantized values,
so the two may differ only by float32 summation order: far below 1e-3 on logits of size ~10-100,
while a wrong block decoder, a wrong row order or a missed norm shift moves logits by whole units.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_py_dequantize

from ds4desk.engine import loader
from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.kernels.quant.gguf import dequantize
from ds4desk.engine.loader import LoadedModel, load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_source import (
    gguf_tensor_name,
    packed_types,
    permute_rope_rows,
    rope_row_order,
)
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear
from ds4desk.engine.preflight import stored_types
from tests.engine.gguf_fakes import (
    HEADS,
    KV_HEADS,
    SP_TOKENS,
    WideSizes,
    gguf_rows_from_hf,
    hf_weights,
    llama3_rope_divisors,
    quantize_with_llama_cpp,
    wide_weights,
    write_tiny_gguf,
    write_wide_gguf,
)
from tests.real_models import smollm2_gguf

CPU = torch.device("cpu")
# 12 prompt tokens (prefill) then 3 teacher-forced decode steps; spread over the fake vocabulary's
# specials, byte tokens and pieces.
TOKENS = (1, 17, 100, 200, 258, 259, 262, 270, 275, 280, 290, 295, 2, 64, 287)
PREFILL = 12
LOGIT_TOLERANCE = 1e-3  # max |Δ logit|, absolute


def _load_failed(exc: pytest.ExceptionInfo[EngineFailure]) -> str:
    assert exc.value.error.code == ErrorCode.LOAD_FAILED
    return exc.value.error.detail


# --- the two sides of the oracle ------------------------------------------------------------------


def _ds4desk_logits(loaded: LoadedModel, tokens: Sequence[int] = TOKENS) -> torch.Tensor:
    """[len(tokens), V]: a prefill of the first PREFILL tokens, then one decode step per token."""
    model = loaded.model
    model.allocate_cache(len(tokens) + 4)
    with torch.no_grad():
        rows = [model.forward(torch.tensor(tokens[:PREFILL]), 0, "all")]
        for position in range(PREFILL, len(tokens)):
            rows.append(model.forward(torch.tensor([tokens[position]]), position, "last").reshape(1, -1))
    return torch.cat(rows).float()


def _transformers_logits(path: Path, tokens: Sequence[int] = TOKENS) -> torch.Tensor:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return reference(torch.tensor([list(tokens)])).logits[0].float()


def _compare(path: Path, label: str) -> tuple[float, float]:
    """ds4desk on the file's packed weights against transformers on the same file: (max |Δ|, the
    largest |logit|), printed for the report; asserts max |Δ| within LOGIT_TOLERANCE."""
    ours = _ds4desk_logits(load_model(read_source(path), CPU, torch.float32))
    theirs = _transformers_logits(path)
    assert ours.shape == theirs.shape
    delta = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    print(f"\n{label}: max |Δ logit| {delta:.3g} (largest |logit| {scale:.3g}, relative {delta / scale:.2g})")
    assert scale > 1.0, "logits this small would make the tolerance meaningless"
    assert delta <= LOGIT_TOLERANCE, label
    # Same greedy choice at every position: a coarse check that still holds if the bar is relaxed.
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    return delta, scale


def _file_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> GGML type name, as gguf-py reads the file."""
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


# --- the real model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> Path:
    return smollm2_gguf()  # skips, naming the pip command, where the package is missing


@pytest.mark.slow
def test_smollm_source_has_a_sane_config_and_its_stored_types(smollm: Path) -> None:
    source = read_source(smollm)
    config = source.config
    assert source.architecture == "LlamaForCausalLM" and source.origin == smollm and source.is_gguf
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        576,
        1536,
        30,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["rope_scaling"] is None and config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert source.tokenizer is not None and source.tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    assert source.chat_template is not None and "<|im_start|>" in source.chat_template

    # Every tensor keeps its stored GGML type, the same one gguf-py reads from the file.
    stored = _file_types(smollm)
    assert len(source.tensors) == len(stored) == 2 + 30 * 9
    for name, entry in source.tensors.items():
        assert entry.dtype == stored[gguf_tensor_name(name)], name
    assert set(stored_types(source)) == {"Q4_1", "Q8_0", "F32"}
    assert source.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert source.tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert source.tensors["model.layers.0.self_attn.q_proj.weight"].rope_heads == 9
    assert source.tensors["model.layers.0.self_attn.k_proj.weight"].rope_heads == 3
    assert source.tensors["model.layers.0.self_attn.v_proj.weight"].rope_heads == 0
    assert "lm_head.weight" not in source.tensors


class _WriteWatch:
    """Records every file Python opens for writing while active (an audit hook, which cannot be
    removed: it stays installed but inert)."""

    active: ClassVar[bool] = False
    writes: ClassVar[list[str]] = []

    @classmethod
    def hook(cls, event: str, args: tuple[object, ...]) -> None:
        if not cls.active or event != "open":
            return
        path, mode, flags = args
        written = isinstance(mode, str) and any(c in mode for c in "wax+")
        if isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            written = True
        if written:
            cls.writes.append(str(path))


sys.addaudithook(_WriteWatch.hook)


@pytest.mark.slow
def test_read_source_writes_nothing_anywhere(
    smollm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every place a cache could go points at an empty folder that must stay empty.
    home = tmp_path / "home"
    home.mkdir()
    for variable in ("HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "TMPDIR", "HF_HOME"):
        monkeypatch.setenv(variable, str(home))
    before = smollm.stat()
    _WriteWatch.writes.clear()
    _WriteWatch.active = True
    try:
        source = read_source(smollm)
    finally:
        _WriteWatch.active = False
    assert _WriteWatch.writes == []
    assert list(home.iterdir()) == []
    after = smollm.stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert source.folder == smollm.parent
    assert {Path(entry.file) for entry in source.tensors.values()} == {smollm}


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="measures memory through Linux's /proc")
def test_smollm_loads_packed_without_a_float_copy(smollm: Path, tmp_path: Path) -> None:
    source = read_source(smollm)
    file_tensor_bytes = sum(entry.end - entry.begin for entry in source.tensors.values())
    float32_bytes = 4 * sum(math.prod(entry.shape) for entry in source.tensors.values())
    # A first load of a tiny file imports and initialises everything a load touches, so the
    # measurement below sees only the weights.
    load_model(read_source(write_tiny_gguf(tmp_path / "warm.gguf")), CPU, torch.float32)
    # Writing 5 to clear_refs resets the peak (VmHWM) to the current RSS (Linux >= 4.0); where that
    # is not allowed the peak is only checked if the load raised it.
    try:
        Path("/proc/self/clear_refs").write_text("5")
        peak_reset = True
    except OSError:
        peak_reset = False
    before, peak_before = _rss(), _peak_rss()
    loaded = load_model(source, CPU, torch.float32)
    growth, peak_growth = _rss() - before, _peak_rss() - before
    print(
        f"\nSmolLM2 Q4_1: file tensors {file_tensor_bytes / 2**20:.1f} MiB, weight_bytes "
        f"{loaded.weight_bytes / 2**20:.1f} MiB, RSS growth {growth / 2**20:.1f} MiB, peak growth "
        f"{peak_growth / 2**20:.1f} MiB (float32 copy: {float32_bytes / 2**20:.1f} MiB)"
    )
    assert loaded.weight_bytes <= 1.1 * file_tensor_bytes
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear | PackedEmbedding)]
    assert len(packed) == 1 + 30 * 7  # every matrix, the tied embedding included
    # What stays is the packed weights (~1x the file's tensors; float32 would be 5.6x). The peak
    # adds at most the file's pages read through the copy-on-write map while copying (1x more).
    assert growth < 1.5 * file_tensor_bytes
    if peak_reset or _peak_rss() > peak_before:
        assert peak_growth < 2.5 * file_tensor_bytes < float32_bytes / 2


# --- tiny synthetic llama files -------------------------------------------------------------------


def test_loading_undoes_the_rope_row_order_of_float_weights(tmp_path: Path) -> None:
    weights = hf_weights(seed=3)
    source = read_source(write_tiny_gguf(tmp_path / "tiny.gguf", weights=weights))
    assert source.config["tie_word_embeddings"] is True and source.config["rope_scaling"] is None
    params = dict(load_model(source, CPU, torch.float32).model.named_parameters())
    for layer in range(2):
        for part, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            got = params[f"model.layers.{layer}.self_attn.{hf}.weight"]
            assert got.dtype == torch.float32
            np.testing.assert_array_equal(got.numpy(), weights[f"blk.{layer}.{part}.weight"])
    np.testing.assert_array_equal(params["model.embed_tokens.weight"].numpy(), weights["token_embd.weight"])


def test_loading_reorders_the_rows_of_packed_weights(tmp_path: Path) -> None:
    weights = hf_weights(seed=4)
    quantized = {
        f"blk.{layer}.{part}.weight": GGMLQuantizationType.Q8_0
        for layer in range(2)
        for part in ("attn_q", "attn_k", "attn_v")
    }
    path = write_tiny_gguf(tmp_path / "q8.gguf", weights=weights, quantized=quantized)
    stored = {t.name: t for t in GGUFReader(path).tensors}
    params = dict(load_model(read_source(path), CPU, torch.float32).model.named_parameters())
    for layer in range(2):
        for part, hf, heads in (
            ("attn_q", "q_proj", HEADS),
            ("attn_k", "k_proj", KV_HEADS),
            ("attn_v", "v_proj", 0),
        ):
            packed = params[f"model.layers.{layer}.self_attn.{hf}.weight"]
            assert packed.dtype == torch.uint8  # kept as Q8_0 blocks
            tensor = stored[f"blk.{layer}.{part}.weight"]
            expected = gguf_py_dequantize(np.asarray(tensor.data), GGMLQuantizationType.Q8_0)
            rows = expected.shape[0]
            if heads:
                expected = expected[rope_row_order(rows, heads)]
            got = dequantize(packed.contiguous(), int(GGMLQuantizationType.Q8_0), (rows, expected.shape[1]))
            np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"{layer}.{hf}")
            # And the reordered rows are the HF-order weights up to Q8_0's rounding.
            np.testing.assert_allclose(got.numpy(), weights[f"blk.{layer}.{part}.weight"], atol=0.05)


def test_llama3_rope_frequencies_become_rope_scaling(tmp_path: Path) -> None:
    divisors = llama3_rope_divisors(10000.0, 8, factor=8.0, low=1.0, high=4.0, ctx=16)
    path = write_tiny_gguf(
        tmp_path / "l3.gguf",
        raw_tensors={"rope_freqs.weight": (divisors, GGMLQuantizationType.F32)},
        metadata={"llama.rope.scaling.factor": 8.0, "llama.rope.scaling.original_context_length": 16},
    )
    source = read_source(path)
    assert source.config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    assert not any("rope_freqs" in name for name in source.tensors)


def test_rope_frequencies_of_another_scheme_are_refused(tmp_path: Path) -> None:
    divisors = np.linspace(1.0, 3.0, 4, dtype=np.float32)  # no Llama 3 (low, high) gives these
    path = write_tiny_gguf(
        tmp_path / "odd_rope.gguf", raw_tensors={"rope_freqs.weight": (divisors, GGMLQuantizationType.F32)}
    )
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    assert "odd_rope.gguf" in _load_failed(exc) and "rope_freqs" in exc.value.error.detail


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gguf_cut_in_half(smollm: Path, tmp_path: Path) -> None:
    data = smollm.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineFailure) as exc:
        read_source(half)
    detail = _load_failed(exc)
    assert "half.gguf is not a valid GGUF file" in detail and "truncated" in detail
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half.gguf"]


def test_gguf_cut_inside_its_metadata(smollm: Path, tmp_path: Path) -> None:
    with smollm.open("rb") as f:
        head = f.read(300_000)  # ends inside the token list
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(EngineFailure) as exc:
        read_source(cut)
    assert "cut.gguf is not a valid GGUF file (truncated" in _load_failed(exc)


def test_tiny_gguf_cut_inside_its_last_tensor(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "short.gguf"
    cut.write_bytes(data[:-16])
    with pytest.raises(EngineFailure) as exc:
        read_source(cut)
    assert "short.gguf is not a valid GGUF file" in _load_failed(exc)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "GGUF magic"),
        (b"GGUF" + struct.pack("<I", 7) + b"\0" * 32, "version 7"),
        (b"GGUF", "only 4 bytes"),
        (b"", "only 0 bytes"),
    ],
)
def test_not_a_gguf(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    detail = _load_failed(exc)
    assert "model.gguf is not a valid GGUF file" in detail and problem in detail


def _kv_header(key: bytes, value: bytes, kv_count: int = 1, tensor_count: int = 0) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)
    return head + struct.pack("<Q", len(key)) + key + value


def test_lying_counts_fail_fast(tmp_path: Path) -> None:
    """A huge array length or entry count must be an error at once, not a walk over imaginary data."""
    cases = {
        "array.gguf": _kv_header(b"a", struct.pack("<IIQ", 9, 0, 1 << 62)),  # u8 array of 2^62 items
        "strings.gguf": _kv_header(b"a", struct.pack("<IIQ", 9, 8, 1 << 40)),  # 2^40 strings
        "kvs.gguf": _kv_header(b"a", struct.pack("<IB", 0, 1), kv_count=1 << 60),
        "key.gguf": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 50) + b"k" * 64,  # key longer than file
        "tensors.gguf": b"GGUF" + struct.pack("<IQQ", 3, 1 << 55, 0),
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content + b"\0" * 64)
        started = time.perf_counter()
        with pytest.raises(EngineFailure) as exc:
            read_source(path)
        # Generous: a walk over 2^40 entries would take hours, a refusal takes microseconds.
        assert time.perf_counter() - started < 5.0, name
        assert f"{name} is not a valid GGUF file" in _load_failed(exc)


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    detail = _load_failed(exc)
    assert "'falcon'" in detail and "falcon.gguf" in detail
    assert all(arch in detail for arch in ("llama", "qwen2", "qwen3", "gemma3"))


def test_mixture_of_experts_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "moe.gguf", metadata={"llama.expert_count": 8})
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    assert "mixture-of-experts" in _load_failed(exc) and "moe.gguf" in exc.value.error.detail


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    source = read_source(write_tiny_gguf(tmp_path / "holes.gguf", drop=("blk.1.ffn_up.weight",)))
    with pytest.raises(EngineFailure) as exc:
        load_model(source, CPU, torch.float32)
    assert "model.layers.1.mlp.up_proj.weight" in _load_failed(exc)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    extra = np.zeros(32, dtype=np.float32)
    path = write_tiny_gguf(
        tmp_path / "odd.gguf", raw_tensors={"blk.0.ffn_gate_exps.weight": (extra, GGMLQuantizationType.F32)}
    )
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    assert "blk.0.ffn_gate_exps.weight" in _load_failed(exc) and "odd.gguf" in exc.value.error.detail


def test_tensor_of_a_layer_the_model_lacks_is_named(tmp_path: Path) -> None:
    extra = np.ones(32, dtype=np.float32)
    path = write_tiny_gguf(
        tmp_path / "deep.gguf", raw_tensors={"blk.7.attn_norm.weight": (extra, GGMLQuantizationType.F32)}
    )
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    assert "blk.7.attn_norm.weight" in _load_failed(exc)


@pytest.mark.parametrize(
    ("qtype", "raw"),
    [
        # A norm stored as integers.
        (GGMLQuantizationType.I32, np.arange(32, dtype=np.int32)),
        # A matrix in an importance-matrix type ds4desk does not read: 64 rows of one 66-byte block.
        (GGMLQuantizationType.IQ2_XXS, np.zeros((64, 66), dtype=np.uint8)),
    ],
)
def test_a_refused_tensor_type_is_named_with_its_tensor(
    tmp_path: Path, qtype: GGMLQuantizationType, raw: np.ndarray
) -> None:
    name = "blk.0.ffn_norm.weight" if qtype == GGMLQuantizationType.I32 else "blk.0.ffn_up.weight"
    weights = hf_weights()
    weights.pop(name)
    path = write_tiny_gguf(tmp_path / "refused.gguf", weights=weights, raw_tensors={name: (raw, qtype)})
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    detail = _load_failed(exc)
    assert f"tensor '{name}'" in detail and qtype.name in detail and "not supported" in detail


def test_the_benchmarks_way_back_to_gguf_inverts_the_loading() -> None:
    """Benchmarks write ds4desk's weights back as a GGUF for llama.cpp: names and rope rows must be
    the exact inverse of what loading does."""
    weight = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    stored = permute_rope_rows(weight, 4)
    assert not np.array_equal(stored, weight)
    np.testing.assert_array_equal(stored[rope_row_order(64, 4)], weight)
    # The fake writer's own loop spells out llama.cpp's order independently.
    np.testing.assert_array_equal(stored, gguf_rows_from_hf(weight, 4))
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    assert gguf_tensor_name("model.layers.7.self_attn.k_proj.weight") == "blk.7.attn_k.weight"
    assert gguf_tensor_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_tensor_name("model.layers.2.self_attn.q_proj.bias", "qwen2") == "blk.2.attn_q.bias"
    assert gguf_tensor_name("model.layers.1.self_attn.k_norm.weight", "qwen3") == "blk.1.attn_k_norm.weight"
    gemma = "model.layers.0.post_attention_layernorm.weight"
    assert gguf_tensor_name(gemma, "gemma3") == "blk.0.post_attention_norm.weight"


# --- exactness per block type: ds4desk vs transformers on the same GGUF ---------------------------

WIDE = WideSizes()  # llama: hidden 256, ffn 512, 4 heads of 64 (2 kv), 2 layers

# (llama.cpp ftype, the GGML type llama.cpp writes for it with pure=True). MXFP4 has no dense
# ftype; MXFP4_MOE with pure=True puts every matrix in MXFP4.
PURE_TYPES = [
    ("Q4_0", "Q4_0"),
    ("Q4_1", "Q4_1"),
    ("Q5_0", "Q5_0"),
    ("Q5_1", "Q5_1"),
    ("Q8_0", "Q8_0"),
    ("Q2_K", "Q2_K"),
    ("Q3_K_M", "Q3_K"),  # llama.cpp has no plain Q3_K ftype; pure makes every matrix Q3_K
    ("Q4_K_M", "Q4_K"),
    ("Q5_K_M", "Q5_K"),
    ("Q6_K", "Q6_K"),
    ("IQ4_NL", "IQ4_NL"),
    ("IQ4_XS", "IQ4_XS"),
    ("MXFP4_MOE", "MXFP4"),
]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wide-llama")
    return write_wide_gguf(folder / "f32.gguf", "llama", wide_weights("llama", WIDE, seed=7), WIDE)


def _needs_llama_cpp() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python quantizes the test files")


@pytest.mark.slow
def test_float32_file_matches_transformers(wide_llama: Path) -> None:
    """The oracle's baseline: no quantization, only the rope row order and the model itself."""
    _compare(wide_llama, "llama F32")


@pytest.mark.slow
@pytest.mark.parametrize(("ftype", "type_name"), PURE_TYPES, ids=[t for _, t in PURE_TYPES])
def test_every_block_type_matches_transformers(wide_llama: Path, ftype: str, type_name: str) -> None:
    _needs_llama_cpp()
    path = quantize_with_llama_cpp(wide_llama, wide_llama.parent / f"{type_name}.gguf", ftype, pure=True)
    # llama.cpp keeps 1-D norms in F32 and, with pure=True, writes every matrix (the embedding
    # included) in the one type: the file really exercises that type's decoder everywhere.
    types = _file_types(path)
    assert {types[n] for n in types if "norm" in n} == {"F32"}
    assert {types[n] for n in types if "norm" not in n} == {type_name}
    source = read_source(path)
    expected_id = int(GGMLQuantizationType[type_name])
    assert set(packed_types(source).values()) == {expected_id}
    assert len(packed_types(source)) == 1 + WIDE.layers * 7
    _compare(path, f"llama {type_name}")


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_half_precision_files_match_transformers(wide_llama: Path, type_name: str) -> None:
    """F16 / BF16 matrices are plain floats: read as values into float parameters, never packed."""
    _needs_llama_cpp()
    path = quantize_with_llama_cpp(wide_llama, wide_llama.parent / f"{type_name}.gguf", type_name, pure=True)
    types = _file_types(path)
    assert {types[n] for n in types if "norm" not in n} == {type_name}
    source = read_source(path)
    assert packed_types(source) == {}
    loaded = load_model(source, CPU, torch.float32)
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    _compare(path, f"llama {type_name}")


@pytest.mark.slow
def test_mixed_q4_k_m_file_matches_transformers(wide_llama: Path) -> None:
    """llama.cpp's own mix: some v / down / embedding tensors in Q6_K, the rest Q4_K, so q/k/v of a
    layer differ in type and run as separate projections rather than one fused block."""
    _needs_llama_cpp()
    path = quantize_with_llama_cpp(wide_llama, wide_llama.parent / "Q4_K_M-mixed.gguf", "Q4_K_M", pure=False)
    types = _file_types(path)
    qkv_types = [{types[f"blk.{i}.attn_{p}.weight"] for p in "qkv"} for i in range(WIDE.layers)]
    assert any(len(kinds) > 1 for kinds in qkv_types), qkv_types
    assert {"Q4_K", "Q6_K"} <= set(types.values())
    _compare(path, "llama Q4_K_M (mixed)")


@pytest.mark.slow
def test_the_oracle_notices_a_wrong_row_order(wide_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is sharp enough to matter: with q/k rows left in the stored order (rope pairs
    instead of halves) the logits move far beyond the tolerance."""
    theirs = _transformers_logits(wide_llama)
    source = read_source(wide_llama)
    monkeypatch.setattr(loader, "rope_row_order", lambda n_rows, heads: np.arange(n_rows))
    ours = _ds4desk_logits(load_model(source, CPU, torch.float32))
    assert (ours - theirs).abs().max().item() > 100 * LOGIT_TOLERANCE


# --- architectures: qwen2 (q/k/v biases), qwen3 (q/k norms), gemma3 ((1 + w) norms, sliding window) --

# Qwen3: transformers' GGUF reader ignores attention.key_length for qwen3 and keeps Qwen3Config's
# head_dim of 128, so the fake uses 128 (as the real models do). Gemma 3: transformers' reader keeps
# query_pre_attn_scalar at Gemma3TextConfig's 256 while ds4desk takes the head width, so the fake
# uses heads of 256 (as Gemma 3 270M / 1B do); six layers give five sliding-window layers and one
# global one, and a window of 4 makes the window matter within the 15 tokens.
ARCH_CASES = {
    "qwen2": (WideSizes(), {}),
    "qwen3": (WideSizes(head_dim=128), {}),
    "gemma3": (
        WideSizes(heads=2, kv_heads=1, head_dim=256, layers=6),
        {"rope_theta": 1_000_000.0, "sliding_window": 4},
    ),
}


@pytest.fixture(scope="module")
def arch_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    folder = tmp_path_factory.mktemp("arch")
    files = {}
    for arch, (sizes, extra) in ARCH_CASES.items():
        weights = wide_weights(arch, sizes, seed=11)
        files[arch] = write_wide_gguf(folder / f"{arch}-f32.gguf", arch, weights, sizes, **extra)
    yield files


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCH_CASES))
@pytest.mark.parametrize("ftype", ["F32", "Q8_0", "Q4_K_M"])
def test_architecture_matches_transformers(arch_files: dict[str, Path], arch: str, ftype: str) -> None:
    path = arch_files[arch]
    if ftype != "F32":
        _needs_llama_cpp()
        path = quantize_with_llama_cpp(
            path, path.with_name(f"{arch}-{ftype}.gguf"), ftype, pure=ftype == "Q8_0"
        )
    source = read_source(path)
    assert source.config["vocab_size"] == len(SP_TOKENS)
    if arch == "gemma3":
        layer_types = source.config["layer_types"]
        assert layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert source.tensors["model.norm.weight"].shift == -1.0
    if arch == "qwen2":
        assert source.config["attention_bias"] is True
        assert "model.layers.0.self_attn.q_proj.bias" in source.tensors
    _compare(path, f"{arch} {ftype}")


@pytest.mark.slow
def test_the_oracle_notices_a_missing_gemma_norm_shift(arch_files: dict[str, Path]) -> None:
    """Gemma stores its norms as (1 + w): loading them without the -1 must fail the comparison."""
    path = arch_files["gemma3"]
    source = read_source(path)
    shifted = [name for name, entry in source.tensors.items() if entry.shift]
    assert len(shifted) == 1 + 6 * 6  # the final norm and six per layer (four norms, q and k norms)
    for name in shifted:
        source.tensors[name] = dataclasses.replace(source.tensors[name], shift=0.0)
    ours = _ds4desk_logits(load_model(source, CPU, torch.float32))
    assert (ours - _transformers_logits(path)).abs().max().item() > 100 * LOGIT_TOLERANCE


def test_gemma_norms_are_shifted_before_rounding_to_the_model_dtype(arch_files: dict[str, Path]) -> None:
    """A bfloat16 load must hold w rounded once, bf16(stored - 1), not bf16(stored) - 1: rounding
    (1 + w) first keeps only ~2^-8 absolute precision of w, whatever its size."""
    path = arch_files["gemma3"]
    stored = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    params = dict(load_model(read_source(path), CPU, torch.bfloat16).model.named_parameters())
    for name, gguf_name in (
        ("model.norm.weight", "output_norm.weight"),
        ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
        ("model.layers.5.self_attn.k_norm.weight", "blk.5.attn_k_norm.weight"),
    ):
        expected = torch.from_numpy(stored[gguf_name] - np.float32(1.0)).to(torch.bfloat16)
        got = params[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, expected), (
            f"{name}: max |Δ| {(got.float() - expected.float()).abs().max():.3g}"
        )


@pytest.mark.parametrize(
    ("sizes", "scalar"),
    [
        # The published configs: Gemma 3 1B scales queries by its head width, 27B by hidden / heads.
        (WideSizes(hidden=1152, ffn=256, heads=4, kv_heads=1, head_dim=256, layers=26), 256),
        (WideSizes(hidden=5376, ffn=256, heads=32, kv_heads=16, head_dim=128, layers=62), 168),
    ],
)
def test_gemma3_query_scale_follows_the_model_size(tmp_path: Path, sizes: WideSizes, scalar: int) -> None:
    """GGUF stores no query scale; the config must give what the Hugging Face config of that size has.
    Only the header is read: the file holds the embedding and the final norm, not the layers."""
    rng = np.random.default_rng(0)
    weights = {
        "token_embd.weight": rng.standard_normal((len(SP_TOKENS), sizes.hidden)).astype(np.float32),
        "output_norm.weight": np.ones(sizes.hidden, dtype=np.float32),
    }
    path = write_wide_gguf(tmp_path / "gemma.gguf", "gemma3", weights, sizes, sliding_window=512)
    config = read_source(path).config
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (sizes.head_dim, scalar)
