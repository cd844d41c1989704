"""DeepSeek-V4 against transformers on a tiny random checkpoint with every layer kind: the raw ring
wraps after 8 tokens, CSA/HCA windows close every 4/8 tokens (also mid-chunk), and long prompts
have more CSA rows than `index_topk`."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.loader import check_tensors, load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.llama.config import DenseConfig
from ds4desk.engine.runtime import Runtime
from tests.engine.tiny_dense import source_from_folder
from tests.engine.tiny_v4 import TINY_V4_CONFIG, save_tiny_v4

CPU = torch.device("cpu")
VOCAB = TINY_V4_CONFIG["vocab_size"]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, ModelSource]:
    return save_tiny_v4(tmp_path_factory.mktemp("v4"))


@pytest.fixture(scope="module")
def reference_300(tiny) -> tuple[list[int], torch.Tensor]:
    hf, _ = tiny
    ids = prompt(300)
    with torch.inference_mode():
        return ids, hf(torch.tensor([ids])).logits[0].float()


def load(source: ModelSource, context: int = 512) -> DeepseekV4Model:
    model = load_model(source, CPU, torch.float32).model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(context)
    return model


def run_chunked(model: DeepseekV4Model, ids: list[int], chunk: int) -> torch.Tensor:
    parts = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            parts.append(model.forward(torch.tensor(ids[start : start + chunk]), start, "all"))
    return torch.cat(parts)


# --- config --------------------------------------------------------------------------------------


def test_config_reads_the_saved_transformers_config(tiny) -> None:
    _, source = tiny
    cfg = DeepseekV4Config.from_hf(source.config)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == (HASH_MOE, HASH_MOE, MOE, MOE)
    assert (cfg.csa_rate, cfg.hca_rate, cfg.sliding_window) == (4, 8, 8)
    assert cfg.main_rope.yarn_factor == 1.0 and cfg.main_rope.theta == 10000.0
    assert cfg.compress_rope.yarn_factor == 4.0 and cfg.compress_rope.theta == 160000.0
    assert cfg.compress_rope.attention_factor == 1.0 and cfg.compress_rope.dim == 16


def test_config_accepts_the_official_legacy_keys() -> None:
    legacy = {k: v for k, v in TINY_V4_CONFIG.items() if k not in ("layer_types", "mlp_layer_types")}
    legacy.pop("partial_rotary_factor")
    legacy.pop("compress_rates")
    legacy.update(
        compress_ratios=[0, 4, 128, 4, 0, 0],  # cut to the 4 layers: the tail is MTP / padding
        num_hash_layers=1,
        qk_rope_head_dim=8,
        compress_rate_hca=16,
    )
    cfg = DeepseekV4Config.from_hf(legacy)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert (cfg.csa_rate, cfg.hca_rate) == (4, 16)
    assert cfg.main_rope.dim == cfg.compress_rope.dim == 8
    assert cfg.compress_rope.yarn_factor == 4.0 and cfg.compress_rope.original_max_positions == 4096
    assert cfg.compress_rope.theta == 160000.0 and cfg.main_rope.theta == 10000.0
    # Without rope_scaling there is no YaRN at all.
    del legacy["rope_scaling"]
    assert DeepseekV4Config.from_hf(legacy).compress_rope.yarn_factor == 1.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"layer_types": ["sliding_attention", "nope", "sliding_attention", "sliding_attention"]}, "layer"),
        ({"layer_types": ["sliding_attention"]}, "layer"),
        ({"compress_ratios": [0, 3, 0, 0], "layer_types": None}, "compress_ratios"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_key_value_heads": 2}, "K=V"),
        ({"rope_scaling": {"type": "llama3", "factor": 2.0}}, "rope type"),
        ({"o_groups": 3}, "o_groups"),
    ],
)
def test_bad_configs_fail_to_load(change: dict, message: str) -> None:
    config = {**TINY_V4_CONFIG, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(EngineFailure) as info:
        DeepseekV4Config.from_hf(config)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert message in info.value.error.detail


# The official V4-Flash config.json's keys (legacy spelling), shapes from its checkpoint.
FLASH_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}


def test_flash_config_builds_the_checkpoint_shapes() -> None:
    cfg = DeepseekV4Config.from_hf(FLASH_CONFIG)
    assert cfg.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and cfg.layer_types[-1] == CSA
    assert cfg.mlp_layer_types[2:4] == (HASH_MOE, MOE)
    # YaRN over 32 pairs: 0..15 keep their speed, 25..31 are slowed 16x, a ramp between.
    rope = cfg.compress_rope
    assert rope.dim == 64 and cfg.main_rope.yarn_factor == 1.0
    inv = rope.inverse_frequencies(CPU)
    unscaled = DeepseekV4Config.from_hf({**FLASH_CONFIG, "rope_scaling": None}).compress_rope
    plain = unscaled.inverse_frequencies(CPU)
    assert torch.equal(inv[:16], plain[:16]) and torch.allclose(inv[25:], plain[25:] / 16)
    assert bool((inv[16:25] < plain[16:25]).all() and (inv[16:25] > plain[16:25] / 16).all())
    with torch.device("meta"):
        model = DeepseekV4Model(cfg, torch.bfloat16)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    layer = "model.layers.2.self_attn."
    expected = {
        layer + "q_a_proj.weight": (1024, 4096),
        layer + "q_b_proj.weight": (32768, 1024),
        layer + "kv_proj.weight": (512, 4096),
        layer + "o_a_proj.weight": (8192, 4096),
        layer + "o_b_proj.weight": (4096, 8192),
        layer + "sinks": (64,),
        layer + "compressor.kv_proj.weight": (1024, 4096),
        layer + "compressor.position_bias": (4, 1024),
        layer + "compressor.indexer.q_b_proj.weight": (8192, 1024),
        layer + "compressor.indexer.kv_proj.weight": (256, 4096),
        layer + "compressor.indexer.position_bias": (4, 256),
        layer + "compressor.indexer.kv_norm.weight": (128,),
        layer + "compressor.indexer.scorer.weights_proj.weight": (64, 4096),
        "model.layers.3.self_attn.compressor.kv_proj.weight": (512, 4096),
        "model.layers.3.self_attn.compressor.position_bias": (128, 512),
        "model.layers.2.mlp.gate.tid2eid": (129280, 6),
        "model.layers.3.mlp.gate.e_score_correction_bias": (256,),
        "model.layers.3.mlp.experts.gate_up_proj": (256, 4096, 4096),
        "model.layers.3.mlp.experts.down_proj": (256, 4096, 2048),
        "model.layers.3.mlp.shared_experts.down_proj.weight": (4096, 2048),
        "model.layers.0.attn_hc.fn": (24, 16384),
        "model.hc_head.hc_fn": (4, 16384),
        "lm_head.weight": (129280, 4096),
    }
    for name, shape in expected.items():
        assert shapes[name] == shape, name
    assert "model.layers.0.self_attn.compressor.kv_proj.weight" not in shapes  # sliding layer
    assert "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight" not in shapes  # HCA layer


def test_dense_family_does_not_accept_deepseek_v4() -> None:
    with pytest.raises(EngineFailure):
        DenseConfig.from_hf(dict(TINY_V4_CONFIG))


# --- against transformers ------------------------------------------------------------------------


def test_parameter_names_are_transformers_state_dict_names(tiny) -> None:
    hf, source = tiny
    model = load(source)
    ours = dict(model.named_parameters())
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert ours["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64


@pytest.mark.parametrize("length", [1, 2, 5, 9, 17, 37, 300])
def test_logits_match_transformers(tiny, reference_300, length: int) -> None:
    hf, source = tiny
    model = load(source)
    ids = reference_300[0][:length] if length == 300 else prompt(length, seed=length)
    with torch.inference_mode():
        ref = reference_300[1] if length == 300 else hf(torch.tensor([ids])).logits[0].float()
        ours = model.forward(torch.tensor(ids), 0, "all")
        last = model.forward(torch.tensor(ids), 0, "last")
        assert model.forward(torch.tensor(ids), 0, "none") is None
    assert ours.dtype == torch.float32 and ours.shape == (length, VOCAB)
    assert relative_error(ours, ref) < 1e-4
    assert relative_error(last, ref[-1]) < 1e-4


def test_bfloat16_load_runs_close_to_float32(tiny, reference_300) -> None:
    _, source = tiny
    model = load_model(source, CPU, torch.bfloat16).model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].attn_hc.fn.dtype == torch.float32  # kept in float32, as V4 does
    model.allocate_cache(128)
    ids, ref = reference_300
    with torch.inference_mode():
        ours = model.forward(torch.tensor(ids[:100]), 0, "all")
    assert ours.dtype == torch.float32
    # Loose: bf16 noise flips discrete choices (expert and indexer top-k) on random weights;
    # transformers' own bf16 run is 0.11 away from its float32 logits here.
    assert relative_error(ours, ref[:100]) < 0.25
    assert relative_error(ours[:10], ref[:10]) < 0.05


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 512])
def test_chunk_size_does_not_change_logits(tiny, reference_300, chunk: int) -> None:
    _, source = tiny
    ids, ref = reference_300
    if chunk < 7:  # the slow ones stop at 120 tokens: still 30 CSA rows, 15 HCA rows, 15 ring wraps
        ids, ref = ids[:120], ref[:120]
    model = load(source)
    ours = run_chunked(model, ids, chunk)
    assert relative_error(ours, ref) < 1e-4
    # Row by row too: a wrong row early on would hide in the norm of 300 rows.
    rows = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rows.max()) < 1e-4


def test_decode_after_prefill_equals_a_full_reprefill(tiny) -> None:
    _, source = tiny
    model = load(source)
    ids = prompt(70, seed=3)
    with torch.inference_mode():
        full = model.forward(torch.tensor(ids), 0, "all")
        model.forward(torch.tensor(ids[:45]), 0, "none")
        steps = [model.forward(torch.tensor([token]), 45 + i, "last") for i, token in enumerate(ids[45:])]
    assert relative_error(torch.stack(steps), full[45:]) < 1e-5


def test_a_new_request_sees_no_state_of_the_last_one(tiny) -> None:
    _, source = tiny
    used = load(source)
    fresh = load(source)
    ids = prompt(23, seed=4)
    with torch.inference_mode():
        run_chunked(used, prompt(61, seed=5), 13)
        again = run_chunked(used, ids, 5)
        clean = run_chunked(fresh, ids, 5)
    assert torch.equal(again, clean)


def test_forward_must_continue_where_the_cache_ends(tiny) -> None:
    _, source = tiny
    model = load(source, context=64)
    with torch.inference_mode():
        model.forward(torch.tensor(prompt(10)), 0, "none")
        with pytest.raises(EngineFailure) as info:
            model.forward(torch.tensor([3]), 5, "last")
        assert info.value.error.code == ErrorCode.BAD_REQUEST
        with pytest.raises(EngineFailure) as info:
            model.forward(torch.tensor(prompt(60)), 10, "last")
        assert info.value.error.code == ErrorCode.CONTEXT_OVERFLOW
    assert model.cache_bytes() > 0
    model.free_cache()
    assert model.cache_bytes() == 0


def _cache_of(out) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The keyword that hands a forward's cache to the next: `cache` in newer transformers,
    `past_key_values` before it (5.17 on the GPU machine)."""
    if hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def test_64_greedy_tokens_match_transformers(tiny) -> None:
    hf, source = tiny
    model = load(source, context=256)
    ids = prompt(20, seed=6)
    expected: list[int] = []
    with torch.inference_mode():
        # Greedy by hand (generate() with min_new_tokens would mask EOS), on transformers' own cache.
        out = hf(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(64):
            expected.append(int(out.logits[0, -1].argmax()))
            out = hf(input_ids=torch.tensor([expected[-1:]]), use_cache=True, **_cache_of(out))
    runtime = Runtime(model, CPU, context=256, chunk=7)
    out = runtime.generate(ids, SamplingParams(), 64, set(), lambda _t: None, lambda: False)
    assert out.tokens == expected


# --- loading failures ----------------------------------------------------------------------------


def _copy_with(source: ModelSource, folder: Path, name: str, tensor: torch.Tensor) -> ModelSource:
    folder.mkdir()
    shutil.copy(source.folder / "config.json", folder / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors")
    return source_from_folder(folder)


def test_a_wrong_shape_fails_to_load(tiny, tmp_path: Path) -> None:
    _, source = tiny
    name = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"
    bad = _copy_with(source, tmp_path / "bad", name, torch.zeros(8, 8))
    with pytest.raises(EngineFailure) as info:
        check_tensors(bad)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert name in info.value.error.detail and "shape" in info.value.error.detail


def test_a_hash_table_naming_a_missing_expert_fails_to_load(tiny, tmp_path: Path) -> None:
    hf, source = tiny
    name = "model.layers.1.mlp.gate.tid2eid"
    table = hf.state_dict()[name].clone()
    table[17, 1] = 8  # experts are 0..7
    bad = _copy_with(source, tmp_path / "bad", name, table)
    with pytest.raises(EngineFailure) as info:
        load_model(bad, CPU, torch.float32)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert "tid2eid" in info.value.error.detail and "expert 8" in info.value.error.detail


def test_missing_tensors_and_mtp_extras(tiny, tmp_path: Path) -> None:
    _, source = tiny
    extra = _copy_with(source, tmp_path / "mtp", "mtp.0.e_proj.weight", torch.zeros(32, 32))
    load_model(extra, CPU, torch.float32)  # MTP tensors are not asked for
    missing = dataclasses.replace(source, tensors=dict(source.tensors))
    del missing.tensors["model.layers.2.self_attn.compressor.position_bias"]
    with pytest.raises(EngineFailure) as info:
        check_tensors(missing)
    assert "position_bias" in info.value.error.detail


# --- through the engine --------------------------------------------------------------------------


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "t0", "eos_token": "t1"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_the_engine_generates_with_deepseek_v4(tiny, tmp_path: Path) -> None:
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    _, source = tiny
    folder = tmp_path / "tiny-v4"
    shutil.copytree(source.folder, folder)
    _write_tokenizer(folder)
    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(path=str(folder), context=256, chunk=16))
        assert loaded.ok, loaded.error
        assert engine.model_info is not None and engine.model_info.family == "deepseek_v4"
        result = engine.generate(GenerateRequest(prompt_tokens=prompt(30, seed=8), max_new_tokens=8))
        assert result.ok, result.error
        assert 0 < len(result.tokens) <= 8
    finally:
        engine.close()
