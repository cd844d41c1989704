"""read_source / check_model: what a dropped path is, and a clear message for everything else."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.registry import ARCHITECTURES
from ds4desk.engine.preflight import check_model

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "intermediate_size": 4,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
}
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def _tensors() -> dict[str, np.ndarray]:
    """Every tensor of CONFIG's one-layer llama, up_proj in float16 to have two dtypes."""
    shapes = {
        "model.embed_tokens.weight": (16, 8),
        "model.norm.weight": (8,),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.mlp.gate_proj.weight": (4, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 4),
    }
    tensors = {name: np.full(shape, 0.5, dtype=np.float32) for name, shape in shapes.items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = np.full((4, 8), 0.5, dtype=np.float16)
    return tensors


def make_folder(root: Path, *, config: object = CONFIG, weights: bool = True, tokenizer: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    if weights:
        save_file(_tensors(), str(root / "model.safetensors"))
    if tokenizer:
        vocab = {"<unk>": 0, "hello": 1, "world": 2}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(root / "tokenizer.json"))
        (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return root


def _error(path: Path, cache: Path) -> str:
    with pytest.raises(EngineFailure) as exc:
        read_source(path)
    assert exc.value.error.code == ErrorCode.LOAD_FAILED
    return exc.value.error.detail


def test_folder_and_files_inside_it(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m")
    for dropped in (folder, folder / "config.json", folder / "model.safetensors", folder / "tokenizer.json"):
        source = read_source(dropped)
        assert source.folder == folder and source.origin == folder
        assert source.architecture == "LlamaForCausalLM" and source.config["hidden_size"] == 8
        assert set(source.tensors) == set(_tensors())
        assert source.tokenizer_file == folder / "tokenizer.json" and source.chat_template == TEMPLATE


def test_missing_path(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path / "nowhere", tmp_path / "cache")


def test_folder_without_config(tmp_path: Path) -> None:
    empty = tmp_path / "photos"
    empty.mkdir()
    assert _error(empty, tmp_path / "cache") == f"no config.json in {empty}: not a Hugging Face model folder"
    (empty / "thing.gguf").write_bytes(b"GGUF")
    assert "open that file instead" in _error(empty, tmp_path / "cache")


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ("{oops", "config.json is not valid JSON"),
        (b"\xff\xfe\x00garbage", "is not text, so it is not valid JSON"),
        ("[1, 2]", "does not hold a JSON object"),
        ({"hidden_size": 8}, "names no architecture"),
        ({"architectures": []}, "names no architecture"),
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "unknown architecture 'GPT2LMHeadModel'; ds4desk runs: LlamaForCausalLM, MistralForCausalLM, "
            "Qwen2ForCausalLM, Qwen3ForCausalLM",
        ),
    ],
)
def test_bad_configs(tmp_path: Path, config: object, problem: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    if isinstance(config, bytes):
        (folder / "config.json").write_bytes(config)
    else:
        make_folder(folder, config=config)
    assert problem in _error(folder, tmp_path / "cache")


def test_no_weights(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", weights=False)
    assert _error(folder, tmp_path / "cache") == f"no .safetensors weights in {folder}"
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    detail = _error(folder, tmp_path / "cache")
    assert "pytorch_model.bin" in detail and "pickle" in detail and ".bin/.pt" in detail


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        (
            "cat.png",
            b"\x89PNG\r\n\x1a\n" + b"\0" * 100,
            "cat.png is not a model: expected a folder with config.json or a .gguf file",
        ),
        (
            "notes.txt",
            b"just some text\n",
            "notes.txt is not a model: expected a folder with config.json or a .gguf file",
        ),
        ("weights.pt", b"\x80\x04", "weights.pt is a PyTorch pickle file"),
        ("model.gguf", b"hello, not gguf at all" * 4, "model.gguf is not a valid GGUF file"),
    ],
)
def test_dropped_foreign_files(tmp_path: Path, name: str, content: bytes, problem: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    assert problem in _error(path, tmp_path / "cache")


def test_truncated_weights_in_a_folder(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-20])
    assert "model.safetensors is truncated: header promises" in _error(folder, tmp_path / "cache")


def _shard(folder: Path, index: dict[str, str]) -> None:
    tensors = _tensors()
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[2:]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def test_sharded_folder(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", weights=False)
    names = list(_tensors())
    index = {n: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    _shard(folder, index)
    source = read_source(folder)
    assert set(source.tensors) == set(names)
    assert source.tensors[names[2]].file.name == "model-00002-of-00002.safetensors"


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (
            lambda idx: idx.update({"extra.weight": "model-00003-of-00003.safetensors"}),
            "which is missing from",
        ),
        (lambda idx: idx.update({"ghost.weight": "model-00001-of-00002.safetensors"}), "does not contain it"),
        (lambda idx: idx.update({"evil.weight": "../secret.safetensors"}), "is not a file name in"),
    ],
)
def test_bad_shard_index(tmp_path: Path, mutate, problem: str) -> None:  # type: ignore[no-untyped-def]
    folder = make_folder(tmp_path / "m", weights=False)
    names = list(_tensors())
    index = {n: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    mutate(index)
    _shard(folder, index)
    assert problem in _error(folder, tmp_path / "cache")


def test_chat_template_sources(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m")
    assert read_source(folder).chat_template == TEMPLATE
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert read_source(folder).chat_template == "D"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert read_source(folder).chat_template == "J"
    (folder / "chat_template.jinja").write_text("JINJA")
    assert read_source(folder).chat_template == "JINJA"
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert read_source(folder).chat_template is None


def test_check_model_report_for_a_folder(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m")
    report = check_model(folder)
    assert (report.family, report.architecture) == ("llama", "LlamaForCausalLM")
    assert report.parameters == 440 and report.tensor_count == 11
    assert report.dtype == "F32" and report.dtypes == {"F32": 408, "F16": 32}
    assert report.weight_bytes == 408 * 4 + 32 * 2
    assert report.tokenizer == "WordLevel, 3 tokens" and report.has_chat_template
    assert report.context_length == 256
    text = report.describe()
    assert "LlamaForCausalLM (llama family)" in text and "context:       256 tokens" in text


def test_check_model_compares_shapes_with_the_config(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "m", config={**CONFIG, "hidden_size": 12})
    with pytest.raises(EngineFailure) as exc:
        check_model(folder)
    assert exc.value.error.code == ErrorCode.LOAD_FAILED
    assert "model.embed_tokens.weight has shape [16, 8], config says [16, 12]" in exc.value.error.detail


@pytest.mark.slow
def test_check_model_on_the_default_gguf() -> None:
    report = check_model(default_model_path(), "cpu", None, 4096)
    assert report.path == default_model_path() and report.folder == default_model_path().parent
    assert report.parameters == 134_515_008 and report.dtype == "Q4_1"
    assert (
        report.tokenizer == "BPE, 49152 tokens" and report.has_chat_template and report.context_length == 8192
    )
    assert report.memory is not None and report.memory.weight_bytes == sum(report.stored.values())
    text = report.describe()
    assert "134.5M" in text and "Q4_1 66.4 MB, Q8_0 30.1 MB" in text and "BPE, 49152 tokens" in text
    assert "memory:        285.3 MB on cpu: 96.6 MB weights + 188.7 MB cache for 4096 tokens" in text


def test_supported_architectures_are_the_dense_families_gemma3_qwen3_5_and_deepseek_v4() -> None:
    assert {family for family, _ in ARCHITECTURES.values()} == {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3",
        "qwen3_5",
        "deepseek_v4",
    }
