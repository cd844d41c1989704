"""Qwen3.5 GGUFs (llama.cpp's `qwen35` and `qwen35moe`) loaded in place, against transformers.

A tiny random transformers Qwen3.5, dense and MoE, is written in llama.cpp's layout by the test's own
writer (tests/engine/models/qwen3_5/gguf_writer.py: the converter's transforms, gguf-py's names and
block types); transformers then holds exactly what the file holds (the dequantized weights, mapped
back to its layout). ds4desk reads the file with its quantized weights kept packed and must give
transformers' logits (1e-4 relative), in prefill chunks and token by token. The errors a broken file
gets must name the tensor at fault."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from ds4desk.engine.api import EngineFailure, SamplingParams
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_qwen35 import GGUF_LAYOUT_KEY as LOADER_KEY
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear
from ds4desk.engine.models.qwen3_5.config import GGUF_LAYOUT_KEY, Qwen35Config
from ds4desk.engine.models.qwen3_5.model import Qwen35Model
from ds4desk.engine.runtime import Runtime
from tests.engine.models.qwen3_5.gguf_writer import MIXED, WrittenGguf, make_hf, write_qwen35_gguf
from tests.engine.models.qwen3_5.tiny import FULL, LINEAR

CPU = torch.device("cpu")
CONTEXT = 96
PROMPT = 80  # more than one 64-token chunk of the delta rule


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # As tests/engine/models/qwen3_5/conftest.py: the small ops of the delta rule gain nothing from a
    # second thread on a shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(seed))


def written(tmp: Path, moe: bool, **how) -> tuple[nn.Module, WrittenGguf]:
    """A random transformers model, its GGUF, and the model holding exactly the file's values."""
    hf = make_hf(moe)
    out = write_qwen35_gguf(tmp / ("moe.gguf" if moe else "dense.gguf"), hf, MIXED, **how)
    hf.load_state_dict(out.effective)
    return hf, out


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def pair(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, WrittenGguf]:
    return written(tmp_path_factory.mktemp("qwen35_gguf"), request.param)


def load(path: Path) -> Qwen35Model:
    model = load_model(read_source(path), CPU, torch.float32).model
    assert isinstance(model, Qwen35Model)
    model.allocate_cache(CONTEXT)
    return model


def test_the_loader_and_the_model_agree_on_the_layout_key() -> None:
    # loading/ may not import a family, so it spells the key itself.
    assert LOADER_KEY == GGUF_LAYOUT_KEY


def test_the_config_comes_from_llama_cpp_metadata(pair) -> None:
    hf, out = pair
    source = read_source(out.path)
    assert source.is_gguf and source.config[GGUF_LAYOUT_KEY] is True
    cfg = Qwen35Config.from_hf(source.config)
    assert cfg.layer_types == (LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL)
    assert cfg.rotary_dim == 8 and cfg.head_dim == 32  # a quarter of the head
    assert (cfg.linear_key_heads, cfg.linear_value_heads) == (2, 4)
    assert (cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_kernel) == (16, 16, 4)
    assert cfg.is_moe == (hf.config.model_type == "qwen3_5_moe_text")
    if cfg.is_moe:
        sizes = (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size)
        assert sizes == (8, 2, 32) and cfg.shared_expert_intermediate_size == 64
    else:
        assert cfg.intermediate_size == 96
    assert cfg.gguf_layout and not cfg.tie_word_embeddings


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_matches_transformers_on_the_files_values(pair, chunk: int) -> None:
    hf, out = pair
    model = load(out.path)
    ids = prompt(PROMPT)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0].float()
        ours = torch.cat([model.forward(ids[s : s + chunk], s, "all") for s in range(0, PROMPT, chunk)])
    assert max(relative_error(ours[i], reference[i]) for i in range(PROMPT)) < 1e-4


def test_decode_matches_transformers_cached_decode(pair) -> None:
    hf, out = pair
    model = load(out.path)
    ids = prompt(20, seed=2).tolist()
    with torch.inference_mode():
        result = hf(torch.tensor([ids]), use_cache=True)
        expected, cache = [result.logits[0, -1].float()], result.cache
        logits = model.forward(torch.tensor(ids), 0, "last")
        got, tokens = [logits], []
        for _ in range(12):
            tokens.append(int(expected[-1].argmax()))
            result = hf(torch.tensor([tokens[-1:]]), cache=cache, use_cache=True)
            expected.append(result.logits[0, -1].float())
            cache = result.cache
            got.append(model.forward(torch.tensor(tokens[-1:]), len(ids) + len(tokens) - 1, "last"))
    for ours, ref in zip(got, expected, strict=True):
        assert relative_error(ours, ref) < 1e-4
    assert [int(g.argmax()) for g in got[:-1]] == tokens


def test_quantized_weights_stay_packed_in_the_files_types(pair) -> None:
    _, out = pair
    model = load(out.path)
    backbone = model.model
    assert isinstance(backbone.embed_tokens, PackedEmbedding) and backbone.embed_tokens.type_id == Q.Q8_0
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.type_id == Q.Q8_0
    linear, full = backbone.layers[0], backbone.layers[2]
    expected = {
        linear.linear_attn.in_proj_qkv: out.types["blk.0.attn_qkv.weight"],
        linear.linear_attn.in_proj_z: out.types["blk.0.attn_gate.weight"],
        linear.linear_attn.in_proj_b: out.types["blk.0.ssm_beta.weight"],
        linear.linear_attn.out_proj: out.types["blk.0.ssm_out.weight"],
        full.self_attn.q_proj: out.types["blk.2.attn_q.weight"],
        full.self_attn.k_proj: out.types["blk.2.attn_k.weight"],
        full.self_attn.v_proj: out.types["blk.2.attn_v.weight"],
        full.self_attn.o_proj: out.types["blk.2.attn_output.weight"],
    }
    if model.config.is_moe:
        mlp = linear.mlp
        expected |= {
            mlp.shared_expert.down_proj: out.types["blk.0.ffn_down_shexp.weight"],
            **{e.gate_proj: out.types["blk.0.ffn_gate_exps.weight"] for e in mlp.experts},
            **{e.up_proj: out.types["blk.0.ffn_up_exps.weight"] for e in mlp.experts},
            **{e.down_proj: out.types["blk.0.ffn_down_exps.weight"] for e in mlp.experts},
        }
        assert isinstance(mlp.gate, nn.Linear)  # the router is stored float32
    else:
        expected[linear.mlp.gate_proj] = out.types["blk.0.ffn_gate.weight"]
    assert len({int(t) for t in expected.values()}) >= 4  # several block types in play
    for module, qtype in expected.items():
        assert isinstance(module, PackedLinear), module
        assert module.type_id == qtype and module.weight.dtype == torch.uint8
    # Float tensors of the file stay float: the F16 alpha, the convolution, the rate.
    assert isinstance(linear.linear_attn.in_proj_a, nn.Linear)
    assert linear.linear_attn.in_proj_a.weight.dtype == torch.float32
    assert linear.linear_attn.conv1d.weight.shape == (128, 1, 4)
    assert not hasattr(linear.linear_attn, "A_log") and bool((linear.linear_attn.neg_rate < 0).all())
    packed_bytes = sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8)
    quantized = sum(1 for q in out.types.values() if q not in (Q.F32, Q.F16))
    assert packed_bytes > 0 and quantized > 0


def test_fused_expert_gate_up_loads_as_apart(tmp_path: Path) -> None:
    """`ffn_gate_up_exps` (gate and up rows of each expert in one tensor) splits into each expert's
    gate and up weights, still packed."""
    hf, out = written(tmp_path, True, fused_gate_up=True)
    assert "blk.0.ffn_gate_up_exps.weight" in out.types and "blk.0.ffn_gate_exps.weight" not in out.types
    model = load(out.path)
    assert isinstance(model.model.layers[0].mlp.experts[3].up_proj, PackedLinear)
    ids = prompt(24, seed=3)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0].float()
        ours = model.forward(ids, 0, "all")
    assert max(relative_error(ours[i], reference[i]) for i in range(24)) < 1e-4


def test_a_tied_packed_head_matches_transformers(tmp_path: Path) -> None:
    """Small Qwen3.5 models tie the head to the embedding: no output.weight, the packed Q8_0
    embedding serves both."""
    hf = make_hf(False, seed=3, tie_word_embeddings=True)
    out = write_qwen35_gguf(tmp_path / "tied.gguf", hf, MIXED)
    assert "output.weight" not in out.types and out.types["token_embd.weight"] == Q.Q8_0
    hf.load_state_dict(out.effective)
    model = load(out.path)
    assert model.lm_head is None and isinstance(model.model.embed_tokens, PackedEmbedding)
    ids = prompt(30, seed=6)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0].float()
        ours = model.forward(ids, 0, "all")
    assert max(relative_error(ours[i], reference[i]) for i in range(30)) < 1e-4


def test_per_layer_recurrent_flags_give_the_layer_kinds(tmp_path: Path) -> None:
    """Layer kinds no interval describes, given as llama.cpp's per-layer `attention.recurrent_layers`."""
    kinds = [LINEAR, FULL, LINEAR, LINEAR, LINEAR, FULL]
    hf = make_hf(False, seed=5, layer_types=kinds)
    out = write_qwen35_gguf(tmp_path / "flags.gguf", hf, MIXED, recurrent_flags=True)
    hf.load_state_dict(out.effective)
    assert Qwen35Config.from_hf(read_source(out.path).config).layer_types == tuple(kinds)
    model = load(out.path)
    ids = prompt(30, seed=7)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0].float()
        ours = model.forward(ids, 0, "all")
    assert max(relative_error(ours[i], reference[i]) for i in range(30)) < 1e-4


def test_the_runtime_generates_transformers_greedy_tokens(pair) -> None:
    hf, out = pair
    runtime = Runtime(load(out.path), CPU, context=CONTEXT, chunk=7)
    ids = prompt(20, seed=8).tolist()
    outcome = runtime.generate(ids, SamplingParams(), 16, set(), lambda _t: None, lambda: False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert outcome.tokens == ref[0, len(ids) :].tolist()


def test_the_oracle_notices_grouped_value_heads(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the file as if its value heads were in Hugging Face's grouped order (the one thing the
    model follows rather than undoes) must break the comparison: the check has teeth."""
    hf, out = pair
    model = load(out.path)
    model.config = dataclasses.replace(model.config, gguf_layout=False)
    ids = prompt(24, seed=4)
    with torch.inference_mode():
        reference = hf(ids[None]).logits[0].float()
        ours = model.forward(ids, 0, "all")
    assert max(relative_error(ours[i], reference[i]) for i in range(24)) > 1e-2


# --- what a broken file gets -------------------------------------------------------------------------


def _refusal(path: Path) -> str:
    with pytest.raises(EngineFailure) as exc:
        load(path)
    return str(exc.value)


@pytest.mark.parametrize(
    ("moe", "dropped"),
    [
        (False, "blk.0.ssm_a"),
        (False, "blk.3.ssm_dt.bias"),
        (False, "blk.2.attn_q_norm.weight"),
        (True, "blk.4.ffn_up_exps.weight"),
        (True, "blk.1.ffn_gate_inp_shexp.weight"),
    ],
)
def test_a_missing_tensor_is_named_as_the_file_names_it(tmp_path: Path, moe: bool, dropped: str) -> None:
    out = write_qwen35_gguf(tmp_path / "cut.gguf", make_hf(moe), MIXED, drop=(dropped,))
    assert dropped in _refusal(out.path)


def test_a_refused_block_type_is_named_with_its_tensor(tmp_path: Path) -> None:
    # Q8_1 (GGML type 9) is an activation type llama.cpp never stores weights in: ds4desk refuses it.
    name = "blk.1.attn_gate.weight"
    blocks = np.zeros((64, 2 * 40), dtype=np.uint8)  # 64 rows of two 40-byte Q8_1 blocks
    out = write_qwen35_gguf(
        tmp_path / "q81.gguf", make_hf(False), None, drop=(name,), raw={name: (blocks, Q.Q8_1)}
    )
    message = _refusal(out.path)
    assert name in message and "Q8_1" in message


def test_a_tensor_in_the_wrong_kind_of_layer_is_named(tmp_path: Path) -> None:
    # Layer 2 is full attention by the metadata; a linear layer's rate there is a contradiction.
    rate = np.full(4, -1.0, dtype=np.float32)
    out = write_qwen35_gguf(tmp_path / "odd.gguf", make_hf(False), None, raw={"blk.2.ssm_a": (rate, Q.F32)})
    message = _refusal(out.path)
    assert "blk.2.ssm_a" in message and "layer 2" in message


def test_a_dense_file_with_experts_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    experts = np.zeros((8, 32, 64), dtype=np.float32)
    out = write_qwen35_gguf(
        tmp_path / "mixed.gguf", make_hf(False), None, raw={"blk.0.ffn_gate_exps.weight": (experts, Q.F32)}
    )
    assert "blk.0.ffn_gate_exps.weight" in _refusal(out.path)


def test_multi_token_prediction_layers_are_left_out(tmp_path: Path) -> None:
    """A file counting an MTP block in block_count (nextn_predict_layers) loads its trunk only."""
    hf = make_hf(False)
    layers = hf.config.num_hidden_layers
    mtp = {
        f"blk.{layers}.attn_norm.weight": (np.ones(64, dtype=np.float32), Q.F32),
        f"blk.{layers}.nextn.eh_proj.weight": (np.zeros((64, 128), dtype=np.float32), Q.F32),
    }
    out = write_qwen35_gguf(tmp_path / "mtp.gguf", hf, None, raw=mtp, mtp_layers=1)
    source = read_source(out.path)
    assert source.config["num_hidden_layers"] == layers
    assert not any(name.startswith(f"model.layers.{layers}.") for name in source.tensors)
    hf.load_state_dict(out.effective)
    model = load(out.path)
    ids = prompt(12, seed=5)
    with torch.inference_mode():
        assert relative_error(model.forward(ids, 0, "all"), hf(ids[None]).logits[0]) < 1e-4
