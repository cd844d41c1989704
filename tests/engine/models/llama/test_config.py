"""The dense family's config.json reading (models/llama/config.py): what each family switches on,
and a LOAD_FAILED naming what is wrong for every config the model cannot run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.models.llama.config import DENSE_ARCHITECTURES, DenseConfig, RopeConfig
from tests.engine.tiny_dense import ARCHITECTURE, TINY_CONFIGS


def hf_config(family: str, **changes: Any) -> dict[str, Any]:
    """`family`'s tiny config.json with `changes` (a value of None removes the key)."""
    config = {**TINY_CONFIGS[family], "architectures": [ARCHITECTURE[family]]}
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


def test_the_registry_names_the_four_dense_families() -> None:
    assert {arch: family for family, arch in ARCHITECTURE.items()} == DENSE_ARCHITECTURES


def test_each_family_switches_on_what_it_adds() -> None:
    llama = DenseConfig.from_hf(hf_config("llama", attention_bias=True, mlp_bias=True))
    assert (llama.family, llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (
        "llama",
        True,
        True,
        True,
        False,
    )
    qwen2 = DenseConfig.from_hf(hf_config("qwen2", attention_bias=False))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias) == (True, False, False)  # always q/k/v bias
    mistral = DenseConfig.from_hf(hf_config("mistral", attention_bias=True))
    assert (mistral.qkv_bias, mistral.o_bias, mistral.sliding_windows) == (False, False, (8, 8))
    qwen3 = DenseConfig.from_hf(hf_config("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.num_kv_heads == 1
    assert DenseConfig.from_hf(hf_config("llama")).head_dim == 64 // 4  # hidden / heads without head_dim


def test_old_style_rope_keys_are_read() -> None:
    config = hf_config(
        "llama",
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    rope = DenseConfig.from_hf(config).rope
    assert (rope.theta, rope.kind, rope.factor, rope.original_max_positions) == (
        500000.0,
        "llama3",
        32.0,
        8192,
    )
    plain = {k: v for k, v in config.items() if k != "rope_scaling"}
    assert DenseConfig.from_hf(plain).rope.kind == "default"


def test_linear_rope_divides_every_frequency() -> None:
    rope = RopeConfig.from_hf({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}})
    plain = RopeConfig(theta=1e4)
    cpu = torch.device("cpu")
    torch.testing.assert_close(rope.inverse_frequencies(16, cpu), plain.inverse_frequencies(16, cpu) / 4.0)


def test_qwen_sliding_window_only_when_enabled() -> None:
    base = hf_config("qwen2", sliding_window=16)
    assert DenseConfig.from_hf(base).sliding_windows == (None, None)
    enabled = {**base, "use_sliding_window": True, "max_window_layers": 1}
    assert DenseConfig.from_hf(enabled).sliding_windows == (None, 16)
    typed = {**enabled, "layer_types": ["sliding_attention", "full_attention"]}
    assert DenseConfig.from_hf(typed).sliding_windows == (16, None)
    assert DenseConfig.from_hf(hf_config("llama", sliding_window=16)).sliding_windows == (None,) * 3


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "config.json has no 'hidden_size'"),
        ({"hidden_size": True}, "config.json 'hidden_size' must be a positive integer, got True"),
        ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer, got 0"),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
        ({"hidden_size": 66}, "hidden_size (66) is not a multiple of num_attention_heads (4)"),
        ({"head_dim": 15}, "head_dim (15) must be even for rotary embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
        ({"rms_norm_eps": -1.0}, "config.json 'rms_norm_eps' must be a positive number, got -1.0"),
        ({"architectures": ["GPT2LMHeadModel"]}, "is not a dense family ds4desk runs"),
        ({"rope_scaling": None, "rope_parameters": [1]}, "rope parameters must be an object"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope type 'linear' needs a 'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "'factor' must be a positive number"),
        ({"rope_scaling": LLAMA3}, "rope type 'llama3' needs 'low_freq_factor'"),
        (
            {
                "rope_scaling": {
                    **LLAMA3,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                    "original_max_position_embeddings": 32,
                }
            },
            "rope 'high_freq_factor' (1.0) must be larger than 'low_freq_factor' (4.0)",
        ),
        ({"sliding_window": -8}, "'sliding_window' must be a positive integer, got -8"),
    ],
)
def test_what_the_model_cannot_run_is_load_failed(changes: dict[str, Any], message: str) -> None:
    family = "mistral" if "sliding_window" in changes else "llama"
    with pytest.raises(EngineFailure) as info:
        DenseConfig.from_hf(hf_config(family, **changes))
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert message in info.value.error.detail


def test_an_explicit_family_must_be_dense() -> None:
    with pytest.raises(EngineFailure, match="unknown dense family 'deepseek_v4'"):
        DenseConfig.from_hf(hf_config("llama"), "deepseek_v4")
    with pytest.raises(EngineFailure, match="is not a JSON object"):
        DenseConfig.from_hf([], "llama")  # type: ignore[arg-type]
