"""DeepSeek-V4 with FP8 linears and packed FP4 experts kept quantized (what lets full-size Flash fit on
two GPUs): the same logits as the dense model holding the dequantized weights, unsplit and split into
shards, for prefill, eager decode and the shard-by-shard decode step the per-shard graphs replay."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4desk.engine import Engine, ErrorCode, GenerateRequest, LoadRequest, loader
from ds4desk.engine.api import EngineFailure
from ds4desk.engine.loader import keeps_quantized, load_model
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.loading.quantized import ShardReader, dequantize_fp8_block128
from ds4desk.engine.make_tiny import TINY_CONFIG, make_tiny
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.synthetic import build_quantized, copy_dequantized, dense_layer
from ds4desk.engine.split import ShardPlan

# Tiny, but FP8 blocks partial (64 is not a multiple of 128) and FP4 rows whole (multiples of 32).
CONFIG = DeepseekV4Config.from_hf(TINY_CONFIG)
CONTEXT = 64


def quantized(plan: ShardPlan | None = None) -> DeepseekV4Model:
    model = build_quantized(CONFIG, torch.device("cpu"), plan, dtype=torch.float32, seed=3)
    model.allocate_cache(CONTEXT)
    return model


def dense_twin(model: DeepseekV4Model) -> DeepseekV4Model:
    with torch.device("meta"):
        dense = DeepseekV4Model(CONFIG, torch.float32)
    dense.materialize(torch.device("cpu"))
    with torch.inference_mode():
        copy_dequantized(model, dense, torch.float32)
    dense.finish_loading()
    dense.allocate_cache(CONTEXT)
    return dense


def ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (count,), generator=torch.Generator().manual_seed(seed))


def run(model: DeepseekV4Model, prompt: torch.Tensor, steps: int, graphable: bool) -> list[torch.Tensor]:
    """Prefill in two chunks, then decode `steps` tokens greedily; every logits vector on the way."""
    with torch.inference_mode():
        out = [model.forward(prompt[:5], 0, "all"), model.forward(prompt[5:], 5, "all")]
        token, pos = int(out[-1][-1].argmax()), prompt.shape[0]
        for _ in range(steps):
            if graphable:
                logits = model.decode_graphable(torch.tensor([token]), torch.tensor([pos]), CONTEXT)
                model.set_length(pos + 1)
            else:
                logits = model.forward(torch.tensor([token]), pos, "last")
            out.append(logits)
            token, pos = int(logits.argmax()), pos + 1
    return out


def test_the_quantized_model_keeps_fp8_and_packed_fp4_weights() -> None:
    model = quantized()
    attn = model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    # q_b_proj is [8 heads x 32, 32]: two 128-row blocks, one (partial) column block.
    assert attn.q_b_proj.weight_scale_inv.shape == (2, 1)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8
    assert experts.gate_up_proj.shape == (8, 64, 32) and experts.gate_up_proj_scale.shape == (8, 64, 2)
    # The bytes are random (every code used), the exponents near 2^-7 (a 0.02 spread).
    assert experts.gate_up_proj.unique().numel() > 200
    assert set(experts.down_proj_scale.unique().tolist()) <= {119, 120, 121}
    table = model.model.layers[0].mlp.gate.tid2eid
    assert all(len(set(row)) == len(row) for row in table.tolist()[:50])


@pytest.mark.parametrize("length", [13, 48])
def test_quantized_logits_equal_the_dense_model_with_the_dequantized_weights(length: int) -> None:
    model = quantized()
    dense = dense_twin(model)
    prompt = ids(length, seed=1)
    got, want = run(model, prompt, 6, graphable=False), run(dense, prompt, 6, graphable=False)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert got[0].std() > 0.1  # the weights mattered


@pytest.mark.parametrize("layers", [(2, 2), (1, 2, 1)])
def test_a_split_quantized_model_equals_the_unsplit_one_and_decodes_shard_by_shard(
    layers: tuple[int, ...],
) -> None:
    whole = quantized()
    split = quantized(ShardPlan(("cpu",) * len(layers), layers))
    assert split.decode_devices() == [torch.device("cpu")] * len(layers)
    prompt = ids(11, seed=2)
    # Eager decode, and decode_graphable (which runs decode_shard after decode_shard when split).
    for graphable in (False, True):
        want = run(whole, prompt, 5, graphable)
        got = run(split, prompt, 5, graphable)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_one_dequantized_layer_reproduces_that_layers_block() -> None:
    """The two-GPU test's reference: dense_layer(i) run on layer i's input gives layer i's output."""
    model = quantized()
    captured: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    block = model._block

    def recording(index, layer, streams, ids_, start):  # type: ignore[no-untyped-def]
        out = block(index, layer, streams, ids_, start)
        captured.append((index, streams.clone(), out.clone()))
        return out

    model._block = recording  # type: ignore[method-assign]
    prompt = ids(9, seed=4)
    with torch.inference_mode():
        model.forward(prompt, 0, "none")
        assert [c[0] for c in captured] == [0, 1, 2, 3]
        for index, streams, out in captured:
            reference = dense_layer(model, index, torch.float32)
            reference.allocate_cache(CONTEXT)
            again = reference._block(0, reference.model.layers[0], streams, prompt, 0)
            torch.testing.assert_close(again, out, rtol=1e-4, atol=1e-5)
            assert (out - streams).abs().max() > 1e-3  # the layer changed the streams


# --- an official FP8 / FP4 checkpoint loaded packed ---------------------------------------------


@pytest.fixture(scope="module")
def official(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("v4packed") / "official"
    make_tiny("deepseek_v4", folder, seed=5, layout="official", fp8=True)
    return folder


def test_packed_loading_is_for_hopper_gpus_unless_forced(
    official: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = inspect_folder(official)
    assert not keeps_quantized(source, [torch.device("cpu")])  # the CPU dequantizes at load
    monkeypatch.setattr(loader, "KEEP_QUANTIZED", True)
    assert keeps_quantized(source, [torch.device("cpu")])
    # A bf16 checkpoint has nothing packed to keep, whatever is forced.
    make_tiny("deepseek_v4", tmp_path / "hf", seed=5)
    assert not keeps_quantized(inspect_folder(tmp_path / "hf"), [torch.device("cpu")])


def test_an_official_checkpoint_loads_packed_with_the_logits_of_the_dequantized_load(official: Path) -> None:
    source = inspect_folder(official)
    packed = load_model(source, torch.device("cpu"), torch.float32, quantized=True)
    plain = load_model(source, torch.device("cpu"), torch.float32)
    experts = packed.model.model.layers[2].mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8
    assert packed.model.model.layers[2].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    # The stored bytes as they are: expert 3's w3 (its up rows) straight from the file.
    width = CONFIG.expert_size
    with ShardReader() as reader:
        entry = source.tensors["model.layers.2.mlp.experts.gate_up_proj"]
        w3 = entry.parts[2 * 3 + 1]
        stored = reader.get(w3.file, w3.key).view(torch.uint8)
        stored_scale = reader.get(w3.scale.file, w3.scale.key).view(torch.uint8)
    assert torch.equal(experts.gate_up_proj[3, width:], stored)
    assert torch.equal(experts.gate_up_proj_scale[3, width:], stored_scale)
    assert packed.weight_bytes < plain.weight_bytes / 2
    prompt = ids(12, seed=6)
    for model in (packed.model, plain.model):
        model.allocate_cache(CONTEXT)
    got, want = run(packed.model, prompt, 4, graphable=True), run(plain.model, prompt, 4, graphable=False)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_with_o_a_widened_to_bf16_loads_dequantized(
    official: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The official inference converter widens wo_a to bf16. The packed model keeps o_a in FP8, so
    such a file is not stored packed: it loads with every weight dequantized (nothing refused,
    nothing rounded again), with the FP8 file's logits."""
    widened = tmp_path / "widened"
    shutil.copytree(official, widened)
    for shard in widened.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if "layers.0.attn.wo_a.weight" in tensors:
            scale = tensors.pop("layers.0.attn.wo_a.scale")
            weight = dequantize_fp8_block128(tensors["layers.0.attn.wo_a.weight"], scale)
            tensors["layers.0.attn.wo_a.weight"] = weight.to(torch.bfloat16)
            save_file(tensors, str(shard), {"format": "pt"})
    index = widened / "model.safetensors.index.json"
    entries = json.loads(index.read_text())
    del entries["weight_map"]["layers.0.attn.wo_a.scale"]
    index.write_text(json.dumps(entries))
    monkeypatch.setattr(loader, "KEEP_QUANTIZED", True)
    source = inspect_folder(widened)
    assert keeps_quantized(inspect_folder(official), [torch.device("cpu")])
    assert not keeps_quantized(source, [torch.device("cpu")])
    loaded = load_model(source, torch.device("cpu"), torch.float32)
    reference = load_model(inspect_folder(official), torch.device("cpu"), torch.float32, quantized=True)
    assert reference.model.model.layers[0].self_attn.o_a_proj.weight.dtype == torch.float8_e4m3fn
    prompt = ids(10, seed=8)
    for model in (loaded.model, reference.model):
        model.allocate_cache(CONTEXT)
    got, want = (
        run(loaded.model, prompt, 2, graphable=False),
        run(reference.model, prompt, 2, graphable=False),
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_nan_scale_byte_fails_the_packed_load_clearly(official: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(official, broken)
    source = inspect_folder(broken)
    entry = source.tensors["model.layers.1.self_attn.q_b_proj.weight"]
    assert entry.scale is not None
    shard = entry.scale.file
    tensors = load_file(str(shard))
    scale = tensors[entry.scale.key].view(torch.uint8).clone()
    scale[0, 0] = 0xFF
    tensors[entry.scale.key] = scale.view(torch.float8_e8m0fnu)
    save_file(tensors, str(shard), {"format": "pt"})
    with pytest.raises(EngineFailure) as info:
        load_model(inspect_folder(broken), torch.device("cpu"), torch.float32, quantized=True)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert "NaN byte" in info.value.error.detail


def test_the_engine_loads_packed_and_sizes_the_packed_weights(
    official: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(loader, "KEEP_QUANTIZED", True)
    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(path=str(official), device="cpu", context=128))
        assert loaded.ok, loaded.error
        assert loaded.info is not None
        packed_bytes = loaded.info.weight_bytes
        result = engine.generate(
            GenerateRequest(prompt_tokens=[5, 9, 11, 40], max_new_tokens=6, stop_tokens=[])
        )
        assert result.ok and len(result.tokens) == 6
        monkeypatch.setattr(loader, "KEEP_QUANTIZED", False)
        plain = engine.load(LoadRequest(path=str(official), device="cpu", context=128))
        assert plain.ok and plain.info is not None
        again = engine.generate(
            GenerateRequest(prompt_tokens=[5, 9, 11, 40], max_new_tokens=6, stop_tokens=[])
        )
        assert again.tokens == result.tokens
        assert plain.info.weight_bytes > 2 * packed_bytes
    finally:
        engine.close()
