"""Qwen3.5 text's config (dense and MoE): what `Qwen35Config.from_hf` reads and checks in a config.json.

Qwen3.5 interleaves two kinds of layers, listed in `layer_types` (or, in configs without it, every
`full_attention_interval`-th layer is full attention, the rest linear):

- "linear_attention": Gated DeltaNet. A short causal convolution over the q/k/v channels, then a
  per-head recurrent matrix updated by the gated delta rule; its state has a fixed size.
- "full_attention": softmax attention whose output is gated by a sigmoid of a second half of the
  query projection, with RoPE on the first `partial_rotary_factor` of each head only.

The MoE variant (transformers' `qwen3_5_moe`) replaces every layer's MLP by a sparse block: a
router over `num_experts` experts of width `moe_intermediate_size`, of which each token takes the
top `num_experts_per_tok`, plus one always-on shared expert (`shared_expert_intermediate_size`)
scaled by a sigmoid gate. It has no dense `intermediate_size`.

Published checkpoints are vision-language models (`Qwen3_5ForConditionalGeneration`) whose text
settings sit in `text_config`; a text-only save (`Qwen3_5ForCausalLM`) has them at the top. Both
spellings are read here. Anything the model cannot run is LOAD_FAILED with a message naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds4desk.engine.models.base import config_float, config_int, load_failure
from ds4desk.engine.models.llama.config import RopeConfig

# The deepest published models have under 200 layers; a config claiming more is refused before
# anything is built per layer.
MAX_LAYERS = 1024
# Published MoE variants have 256 or 512 experts; every expert is a module (or rows of one), so a
# config claiming far more is refused before anything is built.
MAX_EXPERTS = 4096

LINEAR, FULL = "linear_attention", "full_attention"
TEXT_ARCHITECTURE = "Qwen3_5ForCausalLM"
VISION_LANGUAGE_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
MOE_TEXT_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MOE_VISION_LANGUAGE_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
# Set (true) in the config by whoever reads the checkpoint's names (loading/detect.py) when the experts
# are stored stacked, three-dimensional: `mlp.experts.gate_up_proj` [E, 2I, hidden] and
# `mlp.experts.down_proj` [E, hidden, I], as transformers holds them in memory (and, by all accounts,
# the published checkpoints store them). Absent: one 2-D weight per expert and projection, what
# transformers' save_pretrained writes. The model names its parameters after the layout it loads.
STACKED_EXPERTS_KEY = "ds4desk_stacked_experts"
# Set (true) in the config loading/gguf_qwen35.py builds for a GGUF in llama.cpp's layout. Two things
# then differ from a Hugging Face checkpoint, and the model follows the file rather than converting it:
# - a linear layer stores -exp(A_log) (the decay rate itself), so its parameter is `neg_rate`;
# - with more value heads than key heads, the value heads are stored tiled over the key heads
#   (value head h reads key head h % key_heads) rather than grouped (h // (value / key heads)). Every
#   per-value-head row, channel and column of the file is in that order, so the layer computes in it.
GGUF_LAYOUT_KEY = "ds4desk_gguf_layout"
_DEFAULT_INTERVAL = 4  # transformers' default: every fourth layer full attention
_DEFAULT_PARTIAL_ROTARY = 0.25


@dataclass(slots=True, frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # LINEAR or FULL, per layer
    rms_norm_eps: float
    # Full attention layers.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dimensions of each head that RoPE turns; the rest pass through
    rope: RopeConfig
    # Linear attention (Gated DeltaNet) layers.
    conv_kernel: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0
    # The MoE variant (num_experts > 0): every layer's MLP is the sparse block (moe.py); the dense
    # intermediate_size is then 0.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    stacked_experts: bool = False  # STACKED_EXPERTS_KEY
    gguf_layout: bool = False  # GGUF_LAYOUT_KEY: llama.cpp's tensor layout (neg_rate, tiled value heads)
    # Where the text model's weights live in the checkpoint: "model" for a text-only save,
    # "model.language_model" inside a vision-language one.
    weight_prefix: str = "model"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @property
    def conv_channels(self) -> int:
        """The convolved channels: queries, keys and values of every linear head."""
        return (
            2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
        )

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Qwen35Config:
        """Read and validate a Qwen3.5 config.json dict (text-only or vision-language)."""
        if not isinstance(config, dict):
            raise load_failure("config.json is not a JSON object")
        text, prefix, tie_default = config, "model", False
        if "text_config" in config:
            text = config["text_config"]
            if not isinstance(text, dict):
                raise load_failure("config.json 'text_config' must be an object")
            # transformers ties a vision-language model's head by the top-level flag.
            prefix, tie_default = "model.language_model", bool(text.get("tie_word_embeddings", False))
        tie = config.get("tie_word_embeddings", tie_default)
        moe = _moe_sizes({**text, STACKED_EXPERTS_KEY: config.get(STACKED_EXPERTS_KEY)})
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise load_failure(f"hidden_act '{act}' is not supported; Qwen3.5 uses silu")
        layers = config_int(text, "num_hidden_layers")
        if layers > MAX_LAYERS:
            raise load_failure(
                f"config.json num_hidden_layers {layers} is more than ds4desk loads ({MAX_LAYERS})"
            )
        heads = config_int(text, "num_attention_heads")
        kv_heads = config_int(text, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise load_failure(
                f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = config_int(text, "head_dim", 256)  # transformers' default, not hidden // heads
        key_heads = config_int(text, "linear_num_key_heads", 16)
        value_heads = config_int(text, "linear_num_value_heads", 32)
        if value_heads % key_heads:
            raise load_failure(
                f"linear_num_value_heads ({value_heads}) is not a multiple of "
                f"linear_num_key_heads ({key_heads})"
            )
        kernel = config_int(text, "linear_conv_kernel_dim", 4)
        if kernel < 2:
            # A kernel of 1 keeps no window; nothing published has one, and snapshots expect one.
            raise load_failure(f"config.json linear_conv_kernel_dim must be at least 2, got {kernel}")
        return cls(
            vocab_size=config_int(text, "vocab_size"),
            hidden_size=config_int(text, "hidden_size"),
            intermediate_size=0 if moe else config_int(text, "intermediate_size"),
            num_layers=layers,
            layer_types=_layer_types(text, layers),
            rms_norm_eps=config_float(text, "rms_norm_eps", 1e-6),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=_rotary_dim(text, head_dim),
            rope=_rope(text),
            conv_kernel=kernel,
            linear_key_heads=key_heads,
            linear_value_heads=value_heads,
            linear_key_dim=config_int(text, "linear_key_head_dim", 128),
            linear_value_dim=config_int(text, "linear_value_head_dim", 128),
            attention_bias=bool(text.get("attention_bias", False)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings") or 0),
            weight_prefix=prefix,
            gguf_layout=config.get(GGUF_LAYOUT_KEY) is True,
            **moe,
        )


def _moe_sizes(config: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields (empty for a dense config). transformers' Qwen3.5 MoE has no per-layer choice
    (no `mlp_only_layers`, `decoder_sparse_step`) and always renormalises the top-k weights (no
    `norm_topk_prob`): a config asking otherwise is refused rather than run differently."""
    if not config.get("num_experts") and not config.get("num_experts_per_tok"):
        return {}
    experts = config_int(config, "num_experts")
    if experts > MAX_EXPERTS:
        raise load_failure(f"config.json num_experts {experts} is more than ds4desk loads ({MAX_EXPERTS})")
    top_k = config_int(config, "num_experts_per_tok")
    if top_k > experts:
        raise load_failure(f"config.json num_experts_per_tok ({top_k}) is more than num_experts ({experts})")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise load_failure("Qwen3.5 MoE configs with dense layers (mlp_only_layers) are not supported")
    if config.get("norm_topk_prob", True) is not True:
        raise load_failure(
            "Qwen3.5 MoE renormalises its top-k weights; norm_topk_prob false is not supported"
        )
    return {
        "stacked_experts": config.get(STACKED_EXPERTS_KEY) is True,
        "num_experts": experts,
        "experts_per_token": top_k,
        "moe_intermediate_size": config_int(config, "moe_intermediate_size"),
        "shared_expert_intermediate_size": config_int(config, "shared_expert_intermediate_size"),
    }


def _layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:
        interval = config_int(config, "full_attention_interval", _DEFAULT_INTERVAL)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise load_failure(f"config.json 'layer_types' must list {layers} layer types")
    unknown = sorted({str(t) for t in types} - {LINEAR, FULL})
    if unknown:
        raise load_failure(
            f"config.json 'layer_types' has unknown types {unknown}; Qwen3.5 has {LINEAR}, {FULL}"
        )
    return tuple(types)


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise load_failure(f"config.json rope parameters must be an object, got {params!r}")
    return params


def _rotary_dim(config: dict[str, Any], head_dim: int) -> int:
    params = _rope_parameters(config)
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))
    factor = config_float({"partial_rotary_factor": factor}, "partial_rotary_factor")
    rotary = int(head_dim * factor)
    if factor > 1 or rotary < 2 or rotary % 2:
        raise load_failure(
            f"partial_rotary_factor {factor} of head_dim {head_dim} must turn an even number of dimensions"
        )
    return rotary


def _rope(config: dict[str, Any]) -> RopeConfig:
    """The RoPE speeds. Text positions are the same on all three multimodal axes, so the
    interleaved `mrope_section` layout turns every pair by the plain RoPE angle: ignored here."""
    params = {
        k: v
        for k, v in _rope_parameters(config).items()
        if k not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor")
    }
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise load_failure(
            f"rope type '{params.get('rope_type')}' is not supported for Qwen3.5 (only default)"
        )
    return RopeConfig.from_hf({"rope_theta": config.get("rope_theta", 10_000.0), "rope_parameters": params})
