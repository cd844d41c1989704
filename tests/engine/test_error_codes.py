"""The error codes not covered elsewhere: a model too large for memory, a request cancelled before it
started; the engine stays usable after each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ds4desk.engine import Engine, ErrorCode, FinishReason, GenerateRequest, LoadRequest
from tests.engine.tiny_dense import save_tiny

NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def huge_model(folder: Path) -> Path:
    """A llama whose embedding alone is 256 GiB of float32: a sparse file, so it costs no disk. Its
    sizes stay within the config bounds (detect.MAX_CONFIG_SIZES): only memory refuses it."""
    folder.mkdir()
    vocab, hidden = 2**23, 2**13
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    layer = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": [vocab, hidden],
        "model.norm.weight": [hidden],
        **{f"{layer}self_attn.{p}_proj.weight": [hidden, hidden] for p in "qkvo"},
        f"{layer}mlp.gate_proj.weight": [8, hidden],
        f"{layer}mlp.up_proj.weight": [8, hidden],
        f"{layer}mlp.down_proj.weight": [hidden, 8],
        f"{layer}input_layernorm.weight": [hidden],
        f"{layer}post_attention_layernorm.weight": [hidden],
    }
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with (folder / "model.safetensors").open("wb") as file:
        file.write(len(raw).to_bytes(8, "little") + raw)
        file.truncate(8 + len(raw) + offset)
    tokenizer = {
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": {"a": 0, "<unk>": 1}, "unk_token": "<unk>"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_a_model_too_large_for_memory_is_refused_before_loading(tmp_path: Path) -> None:
    engine = Engine()
    try:
        assert engine.load(LoadRequest(context=256)).ok
        refused = engine.load(LoadRequest(path=str(huge_model(tmp_path / "huge")), context=256))
        assert refused.error is not None and refused.error.code == ErrorCode.OUT_OF_MEMORY
        assert "GiB" in refused.error.detail and "free" in refused.error.detail
        assert engine.model_info is not None and engine.model_info.name.startswith("SmolLM2")  # kept
        assert engine.generate(GenerateRequest(raw_text="Hi", max_new_tokens=2)).ok
    finally:
        engine.close()


def test_a_request_cancelled_before_it_starts() -> None:
    engine = Engine()
    try:
        assert engine.load(LoadRequest(context=256)).ok
        request = GenerateRequest(raw_text="Hi", max_new_tokens=2)
        engine.cancel(request.request_id)
        result = engine.generate(request)
        assert result.error is not None and result.error.code == ErrorCode.CANCELLED
        assert result.finish_reason == FinishReason.CANCELLED and result.tokens == []
        assert engine.generate(GenerateRequest(raw_text="Hi", max_new_tokens=2)).ok
    finally:
        engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_GPU)])
def test_a_cache_too_large_is_out_of_memory_and_the_engine_goes_on(tmp_path: Path, device: str) -> None:
    """A context of 2^34 positions: a KV cache of about 9 TB is refused before anything is allocated."""
    folder = tmp_path / "tiny"
    save_tiny("llama", folder, max_position_embeddings=2**40)
    shutil.copy(Path(__file__).with_name("tiny_tokenizer.json"), folder / "tokenizer.json")
    engine = Engine()
    try:
        assert engine.load(LoadRequest(path=str(folder), device=device, context=64)).ok
        refused = engine.load(LoadRequest(path=str(folder), device=device, context=2**34))
        assert refused.error is not None and refused.error.code == ErrorCode.OUT_OF_MEMORY
        assert "17179869184-token cache" in refused.error.detail
        assert engine.generate(GenerateRequest(prompt_tokens=[1, 2, 3], max_new_tokens=2)).ok
    finally:
        engine.close()
