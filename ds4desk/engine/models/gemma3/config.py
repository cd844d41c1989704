"""Gemma 3 text's config: what `Gemma3Config.from_hf` reads and checks in a config.json.

Gemma 3 interleaves local layers (attention over the last `sliding_window` positions, their own
RoPE base) with global ones (the whole context, a larger base and, in the bigger models, linear
RoPE scaling). Checkpoints on the Hub spell the two RoPE settings in two ways, both read here:

- transformers >= 5 writes `rope_parameters: {"sliding_attention": {...}, "full_attention": {...}}`;
- older config.json files have `rope_theta` (global), `rope_local_base_freq` (local) and an
  optional `rope_scaling`, which applies to the global layers only.

Anything the model cannot run is LOAD_FAILED with a message naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds4desk.engine.models.base import config_float, config_int, load_failure
from ds4desk.engine.models.llama.config import RopeConfig

# The deepest published models have under 200 layers; a config claiming more is refused before
# anything is built per layer.
MAX_LAYERS = 1024

LOCAL, GLOBAL = "sliding_attention", "full_attention"
# transformers' defaults for a key a config.json leaves out.
_DEFAULT_THETA = {GLOBAL: 1_000_000.0, LOCAL: 10_000.0}
_DEFAULT_PATTERN = 6  # every sixth layer global
# hidden_activation -> F.gelu's `approximate`.
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(slots=True, frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_scale: float  # query_pre_attn_scalar ** -0.5
    local_rope: RopeConfig
    global_rope: RopeConfig
    # Per layer: attend to at most this many most recent positions, the current one included
    # (None: a global layer, the whole context).
    sliding_windows: tuple[int | None, ...]
    gelu_approximate: str = "tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 0

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Gemma3Config:
        """Read and validate a Gemma 3 text config.json dict; LOAD_FAILED says what is wrong."""
        if not isinstance(config, dict):
            raise load_failure("config.json is not a JSON object")
        hidden = config_int(config, "hidden_size")
        heads = config_int(config, "num_attention_heads")
        kv_heads = config_int(config, "num_key_value_heads", heads)
        layers = config_int(config, "num_hidden_layers")
        if layers > MAX_LAYERS:  # everything per layer is sized from it: refused before
            raise load_failure(
                f"config.json num_hidden_layers {layers} is more than ds4desk loads ({MAX_LAYERS})"
            )
        if heads % kv_heads:
            raise load_failure(
                f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = config_int(config, "head_dim", 256)  # transformers' default, not hidden // heads
        if head_dim % 2:
            raise load_failure(f"head_dim ({head_dim}) must be even for rotary embeddings")
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise load_failure(
                f"hidden_activation '{act}' is not supported; Gemma 3 uses one of {', '.join(_ACTIVATIONS)}"
            )
        if config.get("attn_logit_softcapping") is not None:
            # Gemma 2's; Gemma 3 replaced it by q/k norms. No checkpoint sets it and transformers'
            # Gemma 3 attention never applies it, so a config that does has no agreed meaning.
            raise load_failure("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it null)")
        if config.get("use_bidirectional_attention"):
            raise load_failure("use_bidirectional_attention (an embedding model) is not supported")
        softcap = config.get("final_logit_softcapping")
        local_rope, global_rope = _ropes(config)
        return cls(
            vocab_size=config_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=config_int(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            attention_scale=config_float(config, "query_pre_attn_scalar", 256) ** -0.5,
            local_rope=local_rope,
            global_rope=global_rope,
            sliding_windows=_sliding_windows(config, layers),
            gelu_approximate=_ACTIVATIONS[act],
            attention_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            final_logit_softcapping=None
            if softcap is None
            else config_float(config, "final_logit_softcapping"),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
        )


def _sliding_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    window = config_int(config, "sliding_window", 4096)
    types = config.get("layer_types")
    if types is None:
        # Older configs: every `sliding_window_pattern`-th layer is global, as transformers derives it.
        pattern = config_int(config, "sliding_window_pattern", _DEFAULT_PATTERN)
        types = [LOCAL if (i + 1) % pattern else GLOBAL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise load_failure(f"config.json 'layer_types' must list {layers} layer types")
    unknown = sorted({str(t) for t in types} - {LOCAL, GLOBAL})
    if unknown:
        raise load_failure(
            f"config.json 'layer_types' has unknown types {unknown}; Gemma 3 has {LOCAL}, {GLOBAL}"
        )
    return tuple(window if kind == LOCAL else None for kind in types)


def _ropes(config: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(local, global) RoPE settings, from either spelling (see the module docstring)."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise load_failure(f"config.json rope_parameters must be an object, got {params!r}")
    if params and (LOCAL in params or GLOBAL in params):
        per_type = {kind: params.get(kind) or {} for kind in (LOCAL, GLOBAL)}
    else:
        # The older spelling; a flat rope_parameters / rope_scaling applies to the global layers.
        scaling = params or config.get("rope_scaling") or {}
        per_type = {
            LOCAL: {"rope_theta": config.get("rope_local_base_freq", _DEFAULT_THETA[LOCAL])},
            GLOBAL: {"rope_theta": config.get("rope_theta", _DEFAULT_THETA[GLOBAL]), **scaling},
        }
    ropes = []
    for kind in (LOCAL, GLOBAL):
        entry = per_type[kind]
        if not isinstance(entry, dict):
            raise load_failure(f"config.json rope parameters for {kind} must be an object, got {entry!r}")
        # RopeConfig reads theta and the scaling type from one flat dict, as a dense config has them.
        ropes.append(RopeConfig.from_hf({"rope_theta": _DEFAULT_THETA[kind], "rope_parameters": entry}))
    return ropes[0], ropes[1]
