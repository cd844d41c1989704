"""DeepSeek-V4 in every safetensors name layout (issue 18): one transformers checkpoint saved three
ways (its module names; what `save_pretrained` writes by default, sharded; DeepSeek's official
flat names, sharded) loads to the same logits, equal to transformers' own; a missing tensor is
named in the recognised layout's spelling; MTP blocks are loaded and kept on the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loader import check_tensors, load_model
from ds4desk.engine.loading import deepseek_v4_names as names
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.loading.quantized import quantize_fp8_block128
from ds4desk.engine.make_tiny import TINY_CONFIG, make_tiny
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.split import model_bytes
from tests.engine.tiny_v4 import TINY_V4_CONFIG, make_hf_v4

pytest.importorskip("transformers")

CPU = torch.device("cpu")
# Long enough for CSA (every 4) and HCA (every 8) windows to close and the raw ring (8) to wrap.
IDS = torch.randint(0, TINY_V4_CONFIG["vocab_size"], (40,), generator=torch.Generator().manual_seed(3))

# DeepSeek's release spells the names outside the layers its own way, and transformers writes the
# attention's `kv_norm` back as `norm`; everything else is save_pretrained's names without `model.`.
OFFICIAL_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "head.weight": "head.weight",
}


def _official_key(saved: str) -> str:
    if saved in OFFICIAL_TOP_LEVEL:
        return OFFICIAL_TOP_LEVEL[saved]
    assert saved.startswith("model.layers."), saved
    return saved.removeprefix("model.").replace(".attn.norm.weight", ".attn.kv_norm.weight")


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state |= load_file(str(file))
    return state


def _write_sharded(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards (layers 0-1, the rest) and their index, as the official release is laid out."""
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for key, value in tensors.items():
        first = key.startswith(("layers.0.", "layers.1.", "model.layers.0.", "model.layers.1."))
        shards[0 if first else 1][key] = value.contiguous()
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(folder / file), {"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("v4layouts")
    hf = make_hf_v4(seed=7)
    with torch.inference_mode():
        reference = hf(IDS.unsqueeze(0)).logits[0].float()
    hf.save_pretrained(root / "modules", save_original_format=False)
    # transformers' default: DeepSeek's layer names under `model.`; small shards, so an index too.
    hf.save_pretrained(root / "saved", max_shard_size="300KB")
    official = root / "official"
    official.mkdir()
    shutil.copy(root / "saved" / "config.json", official / "config.json")
    _write_sharded(official, {_official_key(k): v for k, v in _read_all(root / "saved").items()})
    stacked = {k: v.detach().clone() for k, v in hf.state_dict().items() if ".experts." in k}
    return {"root": root, "reference": reference, "stacked": stacked}


def _folder(saved: dict[str, object], layout: str) -> Path:
    return saved["root"] / layout  # type: ignore[operator]


def _logits(folder: Path, quantized: bool = False) -> tuple[torch.Tensor, DeepseekV4Model, int]:
    loaded = load_model(inspect_folder(folder), CPU, torch.float32, quantized=quantized)
    model = loaded.model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(64)
    with torch.inference_mode():
        logits = model.forward(IDS, 0, "all")
    assert logits is not None
    return logits, model, loaded.weight_bytes


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _edit(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Rewrite the folder's checkpoint with tensors added, replaced or (None) dropped."""
    state = _read_all(folder)
    for key, value in change.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    if (folder / "model.safetensors.index.json").is_file():
        _write_sharded(folder, state)
    else:
        save_file(state, str(folder / "model.safetensors"), {"format": "pt"})


def _load_failure(folder: Path) -> str:
    with pytest.raises(EngineFailure) as info:
        check_tensors(inspect_folder(folder))
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    return info.value.error.detail


# --- the three layouts ---------------------------------------------------------------------------


def test_each_layout_is_recognised_from_its_names(saved: dict[str, object]) -> None:
    files = {
        layout: sorted(p.name for p in _folder(saved, layout).iterdir()) for layout in ("saved", "official")
    }
    assert all("model.safetensors.index.json" in listing for listing in files.values()), files
    expected = {
        "modules": names.MODULE_NAMES,
        "saved": names.SAVE_PRETRAINED,
        "official": names.OFFICIAL,
    }
    shapes = {}
    for layout, name in expected.items():
        source = inspect_folder(_folder(saved, layout))
        assert source.layout is not None and source.layout.name == name
        assert source.config["mtp_layer_types"] == []  # transformers writes no MTP block
        shapes[layout] = {k: tuple(e.shape) for k, e in source.tensors.items()}
    assert shapes["saved"] == shapes["official"] == shapes["modules"]


def test_one_checkpoint_saved_three_ways_gives_transformers_logits(saved: dict[str, object]) -> None:
    reference = saved["reference"]
    assert isinstance(reference, torch.Tensor)
    logits = {layout: _logits(_folder(saved, layout))[0] for layout in ("modules", "saved", "official")}
    # The same float32 values in the same model: bit-identical whatever the names.
    assert torch.equal(logits["saved"], logits["modules"])
    assert torch.equal(logits["official"], logits["modules"])
    error = float((logits["modules"] - reference).norm() / reference.norm())
    assert error < 1e-4, error  # test_model.py's bound against transformers
    assert torch.equal(logits["modules"].argmax(-1), reference.argmax(-1))


# --- missing tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "dropped", "named"),
    [
        (
            "official",
            ["layers.0.attn.attn_sink"],
            "DeepSeek official checkpoint has no tensor 'layers.0.attn.attn_sink'",
        ),
        (
            "saved",
            ["model.layers.0.attn.attn_sink"],
            "transformers save_pretrained checkpoint has no tensor 'model.layers.0.attn.attn_sink'",
        ),
        (
            "saved",
            ["model.layers.1.attn.norm.weight"],  # transformers' spelling of the attention's kv_norm
            "transformers save_pretrained checkpoint has no tensor 'model.layers.1.attn.norm.weight'",
        ),
        (
            "modules",
            ["model.layers.0.self_attn.sinks"],
            "transformers module-name checkpoint has no tensor 'model.layers.0.self_attn.sinks'",
        ),
        ("official", ["head.weight"], "DeepSeek official checkpoint has no tensor 'head.weight'"),
        (
            "saved",
            ["model.hc_head.hc_fn"],
            "transformers save_pretrained checkpoint has no tensor 'model.hc_head.hc_fn'",
        ),
    ],
)
def test_a_missing_tensor_is_named_in_the_recognised_layout(
    saved: dict[str, object], tmp_path: Path, layout: str, dropped: list[str], named: str
) -> None:
    folder = _copy(_folder(saved, layout), tmp_path / layout)
    _edit(folder, dict.fromkeys(dropped))
    assert named in _load_failure(folder)


def test_a_layer_without_its_routed_experts_names_the_first_one(
    saved: dict[str, object], tmp_path: Path
) -> None:
    folder = _copy(_folder(saved, "saved"), tmp_path / "noexperts")
    experts = [k for k in _read_all(folder) if k.startswith("model.layers.2.ffn.experts.")]
    assert experts
    _edit(folder, dict.fromkeys(experts))
    detail = _load_failure(folder)
    assert "save_pretrained checkpoint has no tensor 'model.layers.2.ffn.experts.0.w1.weight'" in detail


def test_an_unknown_name_in_the_save_pretrained_layout_is_refused(
    saved: dict[str, object], tmp_path: Path
) -> None:
    folder = _copy(_folder(saved, "saved"), tmp_path / "unknown")
    _edit(folder, {"model.layers.0.attn.mystery": torch.zeros(2)})
    with pytest.raises(EngineFailure) as info:
        inspect_folder(folder)
    detail = info.value.error.detail
    assert "transformers save_pretrained checkpoint" in detail and "model.layers.0.attn.mystery" in detail


# --- MTP blocks ------------------------------------------------------------------------------------


def _mtp_block(
    layer: dict[str, torch.Tensor],
    prefix: str,
    hidden: int = TINY_V4_CONFIG["hidden_size"],
    quantize: bool = False,
) -> dict[str, torch.Tensor]:
    """An MTP block in the official names: `layer`'s tensors (official names inside the layer),
    plus the block's own projections, norms and stream head (random)."""
    mult = TINY_V4_CONFIG["hc_mult"]
    g = torch.Generator().manual_seed(11)
    block = {prefix + rest: value.clone() for rest, value in layer.items()}
    for proj in ("e_proj", "h_proj"):
        weight = torch.randn(hidden, hidden, generator=g) * 0.1
        if quantize:
            block[f"{prefix}{proj}.weight"], block[f"{prefix}{proj}.scale"] = quantize_fp8_block128(weight)
        else:
            block[f"{prefix}{proj}.weight"] = weight
    for norm in ("enorm", "hnorm", "norm"):
        block[f"{prefix}{norm}.weight"] = torch.rand(hidden, generator=g) + 0.5
    block[prefix + "hc_head_fn"] = torch.randn(mult, mult * hidden, generator=g) * 0.1
    block[prefix + "hc_head_base"] = torch.randn(mult, generator=g)
    block[prefix + "hc_head_scale"] = torch.rand(1, generator=g) + 0.5
    return block


@pytest.mark.parametrize(("layout", "prefix"), [("official", "mtp.0."), ("saved", "model.mtp.0.")])
def test_mtp_blocks_are_loaded_and_kept(
    saved: dict[str, object], tmp_path: Path, layout: str, prefix: str
) -> None:
    folder = _copy(_folder(saved, layout), tmp_path / f"mtp-{layout}")
    state = _read_all(folder)
    layer_prefix = "layers.2." if layout == "official" else "model.layers.2."  # HCA, score-routed
    layer = {k.removeprefix(layer_prefix): v for k, v in state.items() if k.startswith(layer_prefix)}
    block = _mtp_block(layer, prefix)
    _edit(folder, dict(block))

    source = inspect_folder(folder)
    assert source.config["mtp_layer_types"] == ["heavily_compressed_attention"]
    assert source.config["mtp_mlp_layer_types"] == ["moe"]
    with_mtp, model, with_bytes = _logits(folder)
    without, plain, without_bytes = _logits(_folder(saved, layout))

    # Kept on the model, and counted: the block's bytes are all float32 here, as stored; a split
    # plan puts them with the head, on the last device.
    assert len(model.mtp) == 1 and len(plain.mtp) == 0
    block_bytes = sum(v.numel() * v.element_size() for v in block.values())
    assert with_bytes - without_bytes == block_bytes
    assert model_bytes(model, 64)[2] - model_bytes(plain, 64)[2] == block_bytes
    mtp = model.mtp[0]
    assert torch.equal(mtp.e_proj.weight, block[prefix + "e_proj.weight"])
    assert torch.equal(mtp.hc_head.hc_fn, block[prefix + "hc_head_fn"])
    assert torch.equal(mtp.self_attn.sinks, layer["attn.attn_sink"])
    assert torch.equal(
        mtp.self_attn.kv_norm.weight,
        layer["attn.kv_norm.weight" if layout == "official" else "attn.norm.weight"],
    )
    # The per-expert matrices stacked as transformers stacks them (its own layer 2 is the oracle).
    stacked = saved["stacked"]
    assert isinstance(stacked, dict)
    assert torch.equal(mtp.mlp.experts.gate_up_proj, stacked["model.layers.2.mlp.experts.gate_up_proj"])
    assert torch.equal(mtp.mlp.experts.down_proj, stacked["model.layers.2.mlp.experts.down_proj"])
    # Not run: the main model's logits are unchanged.
    assert torch.equal(with_mtp, without)


def test_an_incomplete_mtp_block_names_its_first_missing_tensor(
    saved: dict[str, object], tmp_path: Path
) -> None:
    folder = _copy(_folder(saved, "official"), tmp_path / "mtp-partial")
    _edit(folder, {"mtp.0.norm.weight": torch.ones(TINY_V4_CONFIG["hidden_size"])})
    detail = _load_failure(folder)
    # The block's attention comes first; named as the release spells it, with our name beside it.
    assert "DeepSeek official checkpoint has no tensor 'mtp.0.attn." in detail
    assert "(the model's mtp.0.self_attn." in detail


def test_mtp_blocks_must_be_numbered_from_zero(saved: dict[str, object], tmp_path: Path) -> None:
    folder = _copy(_folder(saved, "official"), tmp_path / "mtp-gap")
    _edit(folder, {"mtp.1.norm.weight": torch.ones(TINY_V4_CONFIG["hidden_size"])})
    with pytest.raises(EngineFailure) as info:
        inspect_folder(folder)
    assert "MTP blocks are numbered [1]" in info.value.error.detail


def test_a_quantized_mtp_block_stays_packed(tmp_path: Path) -> None:
    """In the official FP8/FP4 format a kept-quantized model keeps the MTP block packed too (a
    dequantized one would cost Flash four times the bytes of its experts)."""
    folder = tmp_path / "mtp-fp8"
    make_tiny("deepseek_v4", folder, seed=2, layout="official", fp8=True)  # FP4-sized widths
    state = _read_all(folder)
    layer = {k.removeprefix("layers.2."): v for k, v in state.items() if k.startswith("layers.2.")}
    assert "ffn.experts.0.w1.scale" in layer and "attn.wq_a.scale" in layer
    block = _mtp_block(layer, "mtp.0.", TINY_CONFIG["hidden_size"], quantize=True)
    _edit(folder, dict(block))
    loaded = load_model(inspect_folder(folder), CPU, torch.bfloat16, quantized=True)
    model = loaded.model
    assert isinstance(model, DeepseekV4Model)
    mtp = model.mtp[0]
    for linear in (mtp.e_proj, mtp.self_attn.q_a_proj):
        assert linear.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(mtp.e_proj.weight.view(torch.uint8), block["mtp.0.e_proj.weight"].view(torch.uint8))
    experts = mtp.mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8
    # Expert 0's stored FP4 bytes are the first rows of the stacked tensor: w1, then w3.
    w1, w3 = block["mtp.0.ffn.experts.0.w1.weight"], block["mtp.0.ffn.experts.0.w3.weight"]
    assert torch.equal(experts.gate_up_proj[0], torch.cat([w1, w3]).view(torch.uint8))
    scales = torch.cat([block["mtp.0.ffn.experts.0.w1.scale"], block["mtp.0.ffn.experts.0.w3.scale"]])
    assert torch.equal(experts.gate_up_proj_scale[0], scales.view(torch.uint8))
