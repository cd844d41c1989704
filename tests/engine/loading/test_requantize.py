"""Quantize on load (`weights` q8 / q4): a float checkpoint's weights become GGUF blocks while they are
copied, and the model on them equals transformers on the same blocks dequantized."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import LoadRequest
from ds4desk.engine.engine import Engine
from ds4desk.engine.kernels.quant.gguf import dequantize
from ds4desk.engine.loader import fill, plan_load
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear
from ds4desk.engine.preflight import preview_model
from tests.engine.tiny_dense import save_tiny

Q8_0, Q4_K = 8, 12
# Wide enough for Q4_K's 256-value blocks in every linear.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPT = [5, 17, 200, 3, 99, 42, 7, 180, 64, 11]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("qwen2")
    model, _ = save_tiny("qwen2", folder, seed=4, **WIDE)
    shutil.copy(Path(__file__).parents[1] / "tiny_tokenizer.json", folder / "tokenizer.json")
    return model, folder


def _packed_modules(model: torch.nn.Module) -> dict[str, PackedLinear | PackedEmbedding]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))}


@pytest.mark.parametrize(("weights", "linear_type"), [("q8", Q8_0), ("q4", Q4_K)])
def test_quantized_on_load_equals_transformers_on_the_dequantized_blocks(
    qwen2: tuple[torch.nn.Module, Path], weights: str, linear_type: int
) -> None:
    reference, folder = qwen2
    from ds4desk.engine.loading.detect import read_source

    plan = plan_load(read_source(folder), torch.device("cpu"), torch.float32, 64, weights=weights)
    model = fill(plan).model
    packed = _packed_modules(model)
    # Every linear and the embedding (and untied head) are blocks now; norms and biases stay float.
    assert len(packed) == 2 * 7 + 2
    assert packed["model.layers.1.mlp.down_proj"].type_id == linear_type
    assert packed["model.embed_tokens"].type_id == Q8_0 and packed["lm_head"].type_id == Q8_0
    float_bytes = sum(p.numel() * 4 for p in reference.parameters())
    assert plan.memory.weight_bytes < float_bytes / (3 if weights == "q8" else 4)

    # The oracle: transformers in float32 with each weight replaced by its blocks, dequantized.
    oracle = reference.__class__(reference.config).eval()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    for name, module in packed.items():
        cols = module.in_features if isinstance(module, PackedLinear) else module.embedding_dim
        rows = module.weight.shape[0]
        state[f"{name}.weight"] = dequantize(module.weight, module.type_id, (rows, cols))
    oracle.load_state_dict(state)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = oracle(ids[None]).logits[0]
    model.allocate_cache(64)
    got = model.forward(ids, 0, "all")
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    # And quantizing really changed the weights: the float model's logits are elsewhere.
    with torch.no_grad():
        unquantized = reference(ids[None]).logits[0]
    assert (unquantized - got).abs().max() > 10 * (expected - got).abs().max()


def test_the_engine_loads_q4_and_the_preview_says_so(qwen2: tuple[torch.nn.Module, Path]) -> None:
    _, folder = qwen2
    preview = preview_model(folder, "cpu", None, 64, weights="q4")
    stored = preview_model(folder, "cpu", None, 64)
    assert preview.ok and stored.ok and preview.weight_bytes < stored.weight_bytes / 4
    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(path=str(folder), context=64, weights="q4"))
        assert loaded.ok, loaded.error
        assert engine.resident_bytes()[1] < stored.weight_bytes / 2
    finally:
        engine.close()


def test_a_gguf_stays_as_stored_whatever_weights_says() -> None:
    from ds4desk.engine.loading.default_model import default_model_path
    from ds4desk.engine.loading.detect import read_source

    source = read_source(default_model_path())
    as_stored = plan_load(source, torch.device("cpu"), torch.float32, 64)
    q4 = plan_load(source, torch.device("cpu"), torch.float32, 64, weights="q4")
    assert q4.requantized == {} and q4.memory.weight_bytes == as_stored.memory.weight_bytes
