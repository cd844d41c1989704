"""The dense family's config: what `DenseConfig.from_hf` reads and checks in a config.json.

Llama (and SmolLM2), Mistral, Qwen2 and Qwen3 share one layout and differ in a few switches:

- Qwen2 adds a bias to the q/k/v projections.
- Qwen3 RMS-normalises every query and key head (one weight per head dimension) before RoPE.
- Mistral (and Qwen when `use_sliding_window` is set) limits attention to a sliding window.

Anything the model cannot run is LOAD_FAILED with a message naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ds4desk.engine.models.base import config_float, config_int, load_failure
from ds4desk.engine.models.registry import families_of

# The deepest published models have under 200 layers; a config claiming more is refused before
# anything is built per layer.
MAX_LAYERS = 1024

# Hugging Face architecture name -> our family name, for the families this package runs.
DENSE_ARCHITECTURES = families_of("llama")

_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # one of _ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 0

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints have a top-level
        # `rope_theta` and an optional `rope_scaling`. Both are on the Hub, so read both.
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise load_failure(f"config.json rope parameters must be an object, got {params!r}")
        merged = {"rope_theta": config.get("rope_theta", 10000.0), **params}
        theta = config_float(merged, "rope_theta", 10000.0)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise load_failure(f"rope type '{kind}' is not supported; ds4desk runs: {', '.join(_ROPE_TYPES)}")
        if kind == "default":
            return cls(theta=theta)
        if "factor" not in params:
            raise load_failure(f"rope type '{kind}' needs a 'factor'")
        factor = config_float(params, "factor")
        if kind == "linear":
            return cls(theta=theta, kind=kind, factor=factor)
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise load_failure(f"rope type 'llama3' needs '{key}'")
        low = config_float(params, "low_freq_factor")
        high = config_float(params, "high_freq_factor")
        if high <= low:
            raise load_failure(
                f"rope 'high_freq_factor' ({high}) must be larger than 'low_freq_factor' ({low})"
            )
        original = config_int(params, "original_max_position_embeddings")
        return cls(theta, kind, factor, low, high, original)

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """The per-pair rotation speeds, float32 [head_dim // 2]."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            # Llama 3.1's long-context recipe: wavelengths longer than the original context / low
            # factor are slowed down by `factor`, shorter than original / high factor kept, and the
            # band in between blended linearly in (original / wavelength).
            wavelength = 2 * math.pi / inv
            long_edge = self.original_max_positions / self.low_freq_factor
            short_edge = self.original_max_positions / self.high_freq_factor
            blend = (self.original_max_positions / wavelength - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            blended = (1 - blend) * inv / self.factor + blend * inv
            scaled = torch.where(wavelength > long_edge, inv / self.factor, inv)
            middle = (wavelength >= short_edge) & (wavelength <= long_edge)
            return torch.where(middle, blended, scaled)
        return inv


@dataclass(slots=True, frozen=True)
class DenseConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 0
    # Per layer: attend to at most this many most recent positions (None: the whole context).
    sliding_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf(cls, config: dict[str, Any], family: str | None = None) -> DenseConfig:
        """Read and validate a Hugging Face config.json dict; LOAD_FAILED says what is wrong."""
        if not isinstance(config, dict):
            raise load_failure("config.json is not a JSON object")
        if family is None:
            architectures = config.get("architectures") or []
            arch = architectures[0] if isinstance(architectures, list) and architectures else None
            family = DENSE_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
            if family is None:
                raise load_failure(
                    f"config.json architectures {architectures!r} is not a dense family ds4desk runs"
                )
        if family not in DENSE_ARCHITECTURES.values():
            raise load_failure(f"unknown dense family '{family}'")

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
        if config.get("head_dim") is None and hidden % heads:
            raise load_failure(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        head_dim = config_int(config, "head_dim", hidden // heads)
        if head_dim % 2:
            raise load_failure(f"head_dim ({head_dim}) must be even for rotary embeddings")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise load_failure(f"hidden_act '{act}' is not supported; the dense family uses 'silu'")
        partial = config.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise load_failure(f"partial_rotary_factor {partial!r} is not supported")

        attention_bias = bool(config.get("attention_bias", False))
        if family == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v bias and never an o bias
        elif family == "mistral":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias

        return cls(
            family=family,
            vocab_size=config_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=config_int(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=family == "llama" and bool(config.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            sliding_windows=_sliding_windows(config, family, layers),
        )


def _sliding_windows(config: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if family == "llama" or window is None:
        return (None,) * layers
    window = config_int(config, "sliding_window")
    if family == "mistral":
        return (window,) * layers  # Mistral windows every layer whenever sliding_window is set
    if not config.get("use_sliding_window", False):
        return (None,) * layers  # Qwen configs carry a sliding_window they do not use
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    first = config.get("max_window_layers", 28)
    return tuple(window if i >= first else None for i in range(layers))
