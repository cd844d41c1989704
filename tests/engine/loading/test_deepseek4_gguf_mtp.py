"""DeepSeek-V4's MTP block from llama.cpp's own MTP file (issue 18): a tiny random V4 with an MTP
block in DeepSeek's official layout, converted twice by llama.cpp's convert_hf_to_gguf.py, once as
the model (which leaves the block out) and once with `--mtp` (the block alone, as llama.cpp's
speculative draft), the second saved as `mtp-<model file>` beside the first.

- The mapping: every parameter of the loaded block is the file tensor it comes from (eh_proj's two
  halves as e_proj and h_proj), and that tensor is the checkpoint's own within the converter's
  rounding, so no two are swapped.
- The block drafts: greedy speculation with it gives the tokens of speculation off.
- Errors: the MTP file opened alone is refused by name; an `mtp-` file that does not fit the model
  is passed over with a log line, and the model loads without a block.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading import gguf_deepseek4
from ds4desk.engine.loading.detect import inspect_folder, read_source
from ds4desk.engine.loading.gguf_header import read_gguf_header
from ds4desk.engine.models.packed import PackedLinear
from ds4desk.engine.runtime import Runtime
from tests.engine.loading import deepseek4_files as files

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
if files.llama_cpp_tree() is None:
    pytest.skip(
        "llama.cpp's converter is absent: run scripts/llama_cpp_tree.sh (or set DS4DESK_LLAMA_CPP_TREE)",
        allow_module_level=True,
    )

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek4_mtp")
    tree = files.llama_cpp_tree()
    assert tree is not None
    files.write_official(root / "official", seed=3)
    files.add_official_mtp(root / "official", seed=3)
    (root / "model").mkdir()
    model = files.convert(tree, root / "official", root / "model" / "v4.gguf")
    mtp = files.convert(tree, root / "official", root / "model" / "mtp-v4.gguf", "--mtp")
    return {"official": root / "official", "model": model, "mtp": mtp, "root": root}


def _load(path: Path) -> torch.nn.Module:
    source = read_source(path) if path.suffix == ".gguf" else inspect_folder(path)
    return load_model(source, CPU, torch.float32).model


def _file_values(path: Path, name: str) -> torch.Tensor:
    """gguf-py's dequantization of one tensor of the file (its own reader, not ds4desk's)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32))


def _block_values(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's parameters; the linears it holds in the file's blocks (PackedLinear) dequantized."""
    values = dict(block.named_parameters())
    for name, module in block.named_modules():
        if isinstance(module, PackedLinear):
            shape = (module.out_features, module.in_features)
            values[f"{name}.weight"] = gguf.dequantize(module.weight, module.type_id, shape)
    return values


def test_the_mtp_file_beside_the_model_is_its_block(made: dict[str, Path]) -> None:
    model = _load(made["model"])
    assert model.has_mtp and model.config.mtp_layer_types == ("sliding_attention",)
    assert isinstance(model.mtp[0].self_attn.kv_proj, PackedLinear)  # Q8_0 in the file: kept so
    block = _block_values(model.mtp[0])
    hidden = model.config.hidden_size
    eh = _file_values(made["mtp"], "blk.4.nextn.eh_proj.weight")
    assert tuple(eh.shape) == (hidden, 2 * hidden)
    from_file = {
        "e_proj.weight": eh[:, :hidden],
        "h_proj.weight": eh[:, hidden:],
        "enorm.weight": _file_values(made["mtp"], "blk.4.nextn.enorm.weight"),
        "hnorm.weight": _file_values(made["mtp"], "blk.4.nextn.hnorm.weight"),
        "norm.weight": _file_values(made["mtp"], "blk.4.nextn.shared_head_norm.weight"),
        "hc_head.hc_fn": _file_values(made["mtp"], "output_hc_fn.weight"),
        "self_attn.kv_proj.weight": _file_values(made["mtp"], "blk.4.attn_kv.weight"),
        "mlp.gate.weight": _file_values(made["mtp"], "blk.4.ffn_gate_inp.weight"),
    }
    for name, values in from_file.items():
        assert torch.equal(block[name].float(), values.view(block[name].shape)), name

    # Each is the checkpoint's own tensor, within the converter's Q8_0 rounding of FP8 weights: the
    # official checkpoint's block, loaded by ds4desk, holds the same values.
    official = dict(_load(made["official"]).mtp[0].named_parameters())
    # The experts stay in the file's blocks (MXFP4, stacked per projection): read back through
    # ds4desk's dequantization, they are the checkpoint's FP4 values exactly.
    experts, width = model.mtp[0].mlp.experts, model.config.expert_size
    gate_up = official.pop("mlp.experts.gate_up_proj")
    for part, want in (
        ("gate_proj", gate_up[:, :width]),
        ("up_proj", gate_up[:, width:]),
        ("down_proj", official.pop("mlp.experts.down_proj")),
    ):
        packed = block.pop(f"mlp.experts.{part}")
        assert packed.dtype == torch.uint8 and experts.type_ids[part] == 39  # GGML's MXFP4
        assert torch.equal(gguf.dequantize(packed, experts.type_ids[part], want.shape), want.float()), part
    assert set(official) == set(block)
    for name, ours in block.items():
        want = official[name].float()
        if ours.is_floating_point():
            scale = want.abs().max().clamp_min(1e-6)
            assert (ours.float() - want).abs().max() <= 0.02 * scale, name
        else:
            assert torch.equal(ours, official[name]), name


def test_speculation_with_the_files_block_keeps_the_tokens(made: dict[str, Path]) -> None:
    model = _load(made["model"])
    runtime = Runtime(model, CPU, context=96, chunk=16)
    prompt = [int(t) for t in torch.randint(1000, 100_000, (20,), generator=torch.Generator().manual_seed(4))]
    off = runtime.generate(prompt, GREEDY, 16, set(), lambda _t: None, lambda: False)
    on = runtime.generate(prompt, GREEDY, 16, set(), lambda _t: None, lambda: False, speculative="mtp")
    assert on.tokens == off.tokens
    assert on.stats.speculative == "mtp" and on.stats.drafted_tokens > 0


def test_the_mtp_file_alone_is_refused(made: dict[str, Path]) -> None:
    assert read_gguf_header(made["mtp"]).metadata["deepseek4.nextn_predict_layers"] == 1
    with pytest.raises(EngineFailure) as info:
        read_source(made["mtp"])
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    detail = info.value.error.detail
    assert "mtp-v4.gguf" in detail and "multi-token-prediction" in detail


def test_an_mtp_file_that_does_not_fit_is_passed_over(
    made: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "other"
    folder.mkdir()
    shutil.copy(made["model"], folder / "v4.gguf")
    shutil.copy(made["model"], folder / "mtp-v4.gguf")  # a model, not an MTP block
    with caplog.at_level(logging.WARNING):
        source = read_source(folder / "v4.gguf")
    assert not any(name.startswith("mtp.") for name in source.tensors)
    assert "not loading mtp-v4.gguf as the MTP block of v4.gguf" in caplog.text
    assert not load_model(source, CPU, torch.float32).model.has_mtp


def test_a_block_of_other_shapes_is_refused(made: dict[str, Path]) -> None:
    """An MTP file whose layer tensors are not the model's shapes (another model of the same width
    and layer count) is refused before any of it is loaded: `_mtp_beside` then passes it over."""
    source = read_source(made["model"])
    mtp = gguf_deepseek4.mtp_entries(made["mtp"], source.config)
    assert gguf_deepseek4._fitting(made["mtp"], mtp, source.tensors) is mtp
    narrower = dict(source.tensors)
    kv = narrower["model.layers.0.self_attn.kv_proj.weight"]
    narrower["model.layers.0.self_attn.kv_proj.weight"] = dataclasses.replace(kv, shape=(32, kv.shape[1]))
    with pytest.raises(EngineFailure) as info:
        gguf_deepseek4._fitting(made["mtp"], mtp, narrower)
    assert "self_attn.kv_proj.weight" in info.value.error.detail
