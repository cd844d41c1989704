"""make-tiny DeepSeek-V4 folders through our model: check, load, logits of the official FP8/FP4
layout against its dequantized HF-layout twin, the CLI verbs, and bad folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4desk.cli import main
from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loader import check_tensors, load_model
from ds4desk.engine.loading import deepseek_v4_names as names
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.loading.quantized import ShardReader, quantize_fp8_block128, read_tensor
from ds4desk.engine.make_tiny import TINY_CONFIG, make_tiny, write_tokenizer
from ds4desk.engine.preflight import check_model

CPU = torch.device("cpu")
IDS = torch.tensor([0, 5, 17, 42, 99, 7, 7, 250, 3, 11, 64, 128, 200, 31, 2, 9, 77, 150])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4e2e")
    make_tiny("deepseek_v4", root / "hf", seed=5)
    make_tiny("deepseek_v4", root / "official", seed=5, layout="official", fp8=True)
    # The twin: every official tensor dequantized, written under HF names with the HF config.
    source = inspect_folder(root / "official")
    twin = root / "twin"
    twin.mkdir()
    with ShardReader() as reader:
        state = {name: read_tensor(reader, name, e).contiguous() for name, e in source.tensors.items()}
    state = {k: v.to(torch.int64) if not v.is_floating_point() else v.float() for k, v in state.items()}
    save_file(state, str(twin / "model.safetensors"))
    (twin / "config.json").write_text(json.dumps(TINY_CONFIG))
    write_tokenizer(twin, TINY_CONFIG["vocab_size"])
    return {"hf": root / "hf", "official": root / "official", "twin": twin}


def _logits(folder: Path) -> torch.Tensor:
    loaded = load_model(inspect_folder(folder), CPU, torch.float32)
    model = loaded.model
    model.allocate_cache(64)
    with torch.no_grad():
        logits = model.forward(IDS, 0, "all")
    assert logits is not None
    return logits


def test_check_tensors_passes_for_both_layouts(folders: dict[str, Path]) -> None:
    for kind in ("hf", "official"):
        source = inspect_folder(folders[kind])
        check_tensors(source)
    official = inspect_folder(folders["official"])
    assert official.tensors["model.layers.0.self_attn.q_a_proj.weight"].encoding == "fp8_block128"
    assert official.config["layer_types"] == TINY_CONFIG["layer_types"]


def test_official_fp8_gives_the_logits_of_its_dequantized_twin(folders: dict[str, Path]) -> None:
    ours = _logits(folders["official"])
    twin = _logits(folders["twin"])
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, twin, rtol=0, atol=1e-5)
    # ... and the quantization did change something (the twin is not the HF original).
    assert not torch.equal(twin, _logits(folders["hf"]))


def test_cli_check_and_generate(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = str(tmp_path / "home")
    assert main(["--data-dir", home, "check", str(folders["official"])]) == 0
    out = capsys.readouterr().out
    assert "DeepseekV4ForCausalLM" in out and "DeepSeek-V4 chat format" in out
    code = main(
        [
            "--data-dir",
            home,
            "generate",
            str(folders["official"]),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--json",
        ]
    )
    assert code == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["error"] is None and answer["finish_reason"] in ("stop", "length")
    assert answer["prompt_tokens"][0] == 0 and len(answer["tokens"]) >= 1


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_wrong_shape_fails_clearly(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders["hf"], tmp_path / "shape")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.2.self_attn.kv_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(EngineFailure) as info:
        check_model(folder)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert "model.layers.2.self_attn.kv_proj.weight" in info.value.error.detail


def test_tid2eid_naming_a_missing_expert_fails_at_load(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders["official"], tmp_path / "hash")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = "layers.0.ffn.gate.tid2eid"
    file = folder / index["weight_map"][key]
    tensors = load_file(str(file))
    tensors[key][3, 1] = TINY_CONFIG["n_routed_experts"]  # one past the last expert
    save_file(tensors, str(file))
    with pytest.raises(EngineFailure) as info:
        load_model(inspect_folder(folder), CPU, torch.float32)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert "tid2eid" in info.value.error.detail


def test_hf_layout_with_fp8_weight_scale_inv(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders["hf"], tmp_path / "hf8")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    original = tensors[name]
    tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_block128(original)
    save_file(tensors, str(folder / "model.safetensors"))
    source = inspect_folder(folder)
    entry = source.tensors[name]
    assert entry.encoding == "fp8_block128" and name + "_scale_inv" not in source.tensors
    check_tensors(source)
    with ShardReader() as reader:
        got = read_tensor(reader, name, entry)
    assert bool(((got - original).abs() <= original.abs() / 16 + 2**-12).all())
    loaded = load_model(source, CPU, torch.float32)
    assert torch.equal(dict(loaded.model.named_parameters())[name], got)
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(EngineFailure) as info:
        inspect_folder(folder)
    assert name + "_scale_inv" in info.value.error.detail


def test_save_pretrained_folders_stay_plain(tmp_path: Path) -> None:
    from tests.engine.tiny_v4 import save_tiny_v4

    _, source = save_tiny_v4(tmp_path / "sp")
    source = inspect_folder(tmp_path / "sp")
    assert all(e.encoding == "plain" and e.key is None and not e.parts for e in source.tensors.values())
    check_tensors(source)


def test_reference_code_config_loads_alike(folders: dict[str, Path], tmp_path: Path) -> None:
    """A config.json in the reference code's ModelArgs spelling (dim, n_layers, ...) gives the same model."""
    folder = _copy(folders["official"], tmp_path / "args")
    back = {hf: args for args, hf in names.MODEL_ARGS_KEYS.items()}
    hf_style = json.loads((folder / "config.json").read_text())
    args = {back.get(k, k): v for k, v in hf_style.items() if k not in ("architectures", "model_type")}
    (folder / "config.json").write_text(json.dumps(args))
    source = inspect_folder(folder)
    assert source.architecture == "DeepseekV4ForCausalLM"
    assert source.config["hidden_size"] == TINY_CONFIG["hidden_size"]
    assert source.config["mlp_layer_types"] == TINY_CONFIG["mlp_layer_types"]
    torch.testing.assert_close(_logits(folder), _logits(folders["official"]), rtol=0, atol=0)


def test_thinking_mode_through_the_engine(folders: dict[str, Path], tmp_path: Path) -> None:
    """A request in thinking mode (or with a budget) opens the thinking part in the prompt; chat mode
    closes it, as DeepSeek-V4's chat format does."""
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest, ThinkingBudget
    from ds4desk.engine.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer.from_folder(folders["hf"], None)
    think, close = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    engine = Engine()
    try:
        assert engine.load(LoadRequest(path=str(folders["hf"]), context=128)).ok
        chat = [{"role": "user", "content": "hello"}]
        plain = engine.generate(GenerateRequest(messages=chat, max_new_tokens=2))
        thinking = engine.generate(GenerateRequest(messages=chat, max_new_tokens=2, thinking=True))
        budget = ThinkingBudget(max_tokens=1, close_tokens=[close])
        budgeted = engine.generate(
            GenerateRequest(messages=chat, max_new_tokens=4, thinking_budget=budget, stop_tokens=[])
        )
    finally:
        engine.close()
    assert plain.ok and plain.prompt_tokens[-1] == close
    assert thinking.ok and thinking.prompt_tokens[-1] == think
    assert budgeted.ok and budgeted.prompt_tokens[-1] == think
    assert budgeted.budget_forced_close or close in budgeted.tokens[:2]


def test_mtp_tensors_are_kept_with_a_log_line(
    folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MTP tensors are loaded and kept (issue 18; tests/engine/loading/test_deepseek_v4_layouts.py
    loads whole blocks): a block holding only its norm is incomplete, and says what it lacks."""
    folder = Path(shutil.copytree(folders["official"], tmp_path / "with-mtp"))
    shard = "model-00002-of-00002.safetensors"
    weights = load_file(str(folder / shard))
    weights["mtp.0.norm.weight"] = torch.ones(TINY_CONFIG["hidden_size"])
    save_file(weights, str(folder / shard))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.0.norm.weight"] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level("INFO"):
        source = inspect_folder(folder)
    assert "mtp.0.norm.weight" in source.tensors
    assert "keeping 1 MTP tensors" in caplog.text
    with pytest.raises(EngineFailure) as info:
        check_tensors(source)
    assert "DeepSeek official checkpoint has no tensor 'mtp.0." in info.value.error.detail
