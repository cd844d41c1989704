"""DeepSeek-V4 checkpoints: make-tiny's writer, the official layout's names, FP8/FP4 dequantization
and the clear errors for broken folders. (Model-level checks live in test_deepseek_v4_e2e.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4desk.cli import main
from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading import deepseek_v4_names as names
from ds4desk.engine.loading.detect import inspect_folder, read_weight_headers
from ds4desk.engine.loading.quantized import (
    ShardReader,
    quantize_fp4_block32,
    quantize_fp8_block128,
    read_tensor,
)
from ds4desk.engine.make_tiny import TINY_CONFIG, make_tiny, official_config, random_state, tensor_shapes

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("v4twins")
    state = make_tiny("deepseek_v4", root / "hf", seed=3)
    make_tiny("deepseek_v4", root / "official", seed=3, layout="official", fp8=True)
    return root / "hf", root / "official", state


def _fail_code(info: pytest.ExceptionInfo[EngineFailure]) -> str:
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    return info.value.error.detail


# --- the writer against transformers' model -------------------------------------------------------


def test_writer_shapes_equal_transformers_state_dict() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV4Config(**TINY_CONFIG)
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert tensor_shapes(TINY_CONFIG) == expected
    types = set(TINY_CONFIG["layer_types"]) | set(TINY_CONFIG["mlp_layer_types"])
    assert types == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"} | {
        "hash_moe",
        "moe",
    }


def test_random_state_has_no_zero_tables_and_valid_experts() -> None:
    state = random_state(TINY_CONFIG, seed=1)
    experts = TINY_CONFIG["n_routed_experts"]
    for name, value in state.items():
        if name.endswith("tid2eid"):
            assert value.dtype == torch.int64 and int(value.min()) >= 0 and int(value.max()) < experts
            assert all(len(set(row.tolist())) == row.numel() for row in value)  # distinct per token
        else:
            assert bool((value != 0).all()), name  # biases and sinks included


def test_official_config_folds_back_to_the_hf_keys() -> None:
    folded = names.normalize_config(official_config(TINY_CONFIG, fp8=True))
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor"):
        assert folded[key] == TINY_CONFIG[key], key
    assert (
        len(official_config(TINY_CONFIG, fp8=False)["compress_ratios"])
        == TINY_CONFIG["num_hidden_layers"] + 1
    )
    bad = {**official_config(TINY_CONFIG, fp8=False), "compress_ratios": [0, 4, 7, 4, 0]}
    with pytest.raises(EngineFailure) as info:
        names.normalize_config(bad)
    assert "compress_ratios" in _fail_code(info)


def test_name_table_round_trips() -> None:
    for name in tensor_shapes(TINY_CONFIG):
        if ".experts." in name and "shared" not in name:
            continue  # merged from per-expert tensors, not renamed
        official = names.official_name(name)
        assert official is not None and not official.startswith("model."), name
        assert names.hf_name(official) == name


# --- official FP8/FP4 twin ---------------------------------------------------------------------------


def test_hf_folder_stays_plain(twins: tuple[Path, Path, dict[str, torch.Tensor]]) -> None:
    hf, _, _ = twins
    tensors = read_weight_headers(hf)
    assert not names.is_official_layout(tensors)
    assert all(e.encoding == "plain" and e.key is None and not e.parts for e in tensors.values())


def test_official_entries_match_hf_names_and_shapes(
    twins: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    hf, official, _ = twins
    plain = read_weight_headers(hf)
    raw = read_weight_headers(official)
    assert names.is_official_layout(raw)
    mapped = names.official_tensors(raw)
    assert {k: e.shape for k, e in mapped.items()} == {k: e.shape for k, e in plain.items()}
    encodings = {e.encoding for e in mapped.values()}
    assert encodings == {"plain", "fp8_block128", "fp4_block32"}
    gate_up = mapped["model.layers.1.mlp.experts.gate_up_proj"]
    assert len(gate_up.parts) == 2 * TINY_CONFIG["n_routed_experts"]
    assert gate_up.parts[1].key == "layers.1.ffn.experts.0.w3.weight"


def _ref_e4m3(byte: int) -> float:
    """e4m3fn decoded by hand: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _reference_dequant(stored: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """An independent decode of the stored bytes (lookup tables, explicit index arithmetic)."""
    exps = scale.view(torch.uint8).to(torch.int64)
    factor = torch.pow(2.0, (exps - 127).to(torch.float64))
    data = stored.view(torch.uint8).to(torch.int64)
    if encoding == "fp8_block128":
        table = torch.tensor([_ref_e4m3(b) for b in range(256)], dtype=torch.float64)
        rows, cols = data.shape
        i = torch.arange(rows).unsqueeze(1) // 128
        j = torch.arange(cols).unsqueeze(0) // 128
        return table[data] * factor[i, j]
    low, high = data & 0xF, data >> 4
    codes = torch.empty(data.shape[0], data.shape[1] * 2, dtype=torch.int64)
    codes[:, 0::2], codes[:, 1::2] = low, high
    signed = torch.tensor(E2M1, dtype=torch.float64)[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    j = torch.arange(codes.shape[1]).unsqueeze(0) // 32
    return signed * factor[torch.arange(codes.shape[0]).unsqueeze(1), j]


def test_dequantized_official_equals_hf_up_to_quantization(
    twins: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    _, official, state = twins
    mapped = names.official_tensors(read_weight_headers(official))
    raw = {}
    for file in sorted(official.glob("*.safetensors")):
        raw |= load_file(str(file))
    with ShardReader() as reader:
        for name, entry in mapped.items():
            got = read_tensor(reader, name, entry)
            want = state[name]
            assert tuple(got.shape) == tuple(want.shape), name
            parts = entry.parts or (entry,)
            if entry.encoding == "plain":
                # Stored as the official dtype (BF16 or F32; int32 hash tables).
                assert torch.equal(got, want.to(raw[parts[0].key].dtype)), name
                continue
            # 1. Our decode equals an independent decode of the same bytes.
            ref = torch.cat(
                [_reference_dequant(raw[p.key], raw[p.scale.key], p.encoding).reshape(-1) for p in parts]
            ).view(got.shape)
            assert torch.equal(got.double(), ref), name
            # 2. The bytes are the HF values quantized: error within half a step of each format.
            err = (got - want).abs()
            if entry.encoding == "fp8_block128":
                block = want.abs().max()
                scale = 2.0 ** math.ceil(math.log2(float(block) / 448))
                assert bool((err <= want.abs() / 16 + scale * 2**-9).all()), name
            else:
                flat = want.reshape(-1, 32).abs().amax(dim=1, keepdim=True)
                step = torch.pow(2.0, torch.ceil(torch.log2(flat / 6)))
                assert bool((err.reshape(-1, 32) <= step * 1.0 + 1e-12).all()), name


def test_fp8_round_trip_on_partial_blocks() -> None:
    weight = torch.randn(300, 200) * torch.logspace(-3, 2, 200)
    q, scale = quantize_fp8_block128(weight)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (3, 2)
    back = _reference_dequant(q, scale, "fp8_block128")
    assert bool(((back - weight.double()).abs() <= weight.double().abs() / 16 + 2**-9 * 2.0**8).all())
    packed, s4 = quantize_fp4_block32(torch.randn(4, 64))
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (4, 32) and tuple(s4.shape) == (4, 2)


# --- broken official folders -------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_missing_shard(twins: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    folder = _copy(twins[1], tmp_path / "m")
    (folder / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(EngineFailure) as info:
        read_weight_headers(folder)
    assert "model-00001-of-00002.safetensors" in _fail_code(info)


def _rewrite(folder: Path, key: str, value: torch.Tensor | None) -> None:
    """Replace (or with None drop) one tensor of the shard holding it, keeping the index right."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = folder / index["weight_map"][key]
    tensors = load_file(str(file))
    if value is None:
        del tensors[key], index["weight_map"][key]
        index_path.write_text(json.dumps(index))
    else:
        tensors[key] = value
    save_file(tensors, str(file))


def test_fp8_scale_with_wrong_shape(
    twins: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder = _copy(twins[1], tmp_path / "s")
    key = "layers.1.attn.wq_b.scale"
    _rewrite(folder, key, torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with pytest.raises(EngineFailure) as info:
        names.official_tensors(read_weight_headers(folder))
    detail = _fail_code(info)
    assert key in detail and "[1, 1]" in detail and "[2, 1]" in detail


def test_fp8_weight_without_scale_and_stray_scale(
    twins: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder = _copy(twins[1], tmp_path / "n")
    _rewrite(folder, "layers.0.attn.wo_a.scale", None)
    with pytest.raises(EngineFailure) as info:
        names.official_tensors(read_weight_headers(folder))
    assert "layers.0.attn.wo_a.weight" in _fail_code(info)
    folder = _copy(twins[1], tmp_path / "o")
    _rewrite(folder, "layers.0.attn.wo_a.weight", None)
    with pytest.raises(EngineFailure) as info:
        names.official_tensors(read_weight_headers(folder))
    assert "layers.0.attn.wo_a.scale" in _fail_code(info)


def test_missing_expert_and_unknown_tensor(
    twins: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder = _copy(twins[1], tmp_path / "e")
    _rewrite(folder, "layers.2.ffn.experts.3.w2.weight", None)
    _rewrite(folder, "layers.2.ffn.experts.3.w2.scale", None)
    with pytest.raises(EngineFailure) as info:
        names.official_tensors(read_weight_headers(folder))
    assert "layers.2.ffn.experts.3.w2.weight" in _fail_code(info)
    folder = _copy(twins[1], tmp_path / "u")
    _rewrite(folder, "layers.0.attn.wq_a.weight", None)
    tensors = read_weight_headers(folder)
    file = next(iter(tensors.values())).file
    extra = load_file(str(file)) | {"layers.0.attn.mystery": torch.zeros(2)}
    save_file(extra, str(file))
    with pytest.raises(EngineFailure) as info:
        names.official_tensors(read_weight_headers(folder))
    assert "layers.0.attn" in _fail_code(info)


def test_nan_scale_byte_fails_at_read(
    twins: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder = _copy(twins[1], tmp_path / "x")
    key = "layers.0.attn.wq_a.scale"
    _rewrite(folder, key, torch.full((1, 1), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    mapped = names.official_tensors(read_weight_headers(folder))
    with ShardReader() as reader, pytest.raises(EngineFailure) as info:
        read_tensor(
            reader,
            "model.layers.0.self_attn.q_a_proj.weight",
            mapped["model.layers.0.self_attn.q_a_proj.weight"],
        )
    assert "layers.0.attn.wq_a" in _fail_code(info) and "0xFF" in _fail_code(info)


# --- the CLI verb -------------------------------------------------------------------------------------


def test_make_tiny_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t"
    assert main(["make-tiny", "deepseek_v4", str(out), "--seed", "2", "--data-dir", str(tmp_path / "d")]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    rc = main(["make-tiny", "deepseek_v4", str(tmp_path / "u"), "--fp8", "--data-dir", str(tmp_path / "d")])
    assert rc == 2 and "--format official" in capsys.readouterr().err


def test_config_naming_only_the_model_type(
    twins: tuple[Path, Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder = _copy(twins[1], tmp_path / "mt")
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    source = inspect_folder(folder)
    assert source.architecture == "DeepseekV4ForCausalLM"
    assert source.tensors["lm_head.weight"].key == "head.weight"


def test_help_lists_make_tiny(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--data-dir", str(tmp_path), "--help"])
    assert "make-tiny" in capsys.readouterr().out


def test_reference_code_yarn_becomes_rope_scaling() -> None:
    args = {
        "dim": 64,
        "n_layers": 2,
        "compress_ratios": [0, 4, 0],
        "rope_factor": 16,
        "original_seq_len": 65536,
    }
    assert names.is_model_args_config(args)
    hf = names.model_args_to_hf(args)
    assert hf["hidden_size"] == 64 and hf["num_hidden_layers"] == 2
    assert hf["rope_scaling"] == {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    assert not names.is_model_args_config(TINY_CONFIG)
