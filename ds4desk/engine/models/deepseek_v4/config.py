"""DeepSeek-V4's config.json, read and checked once: transformers' keys or the official release's
legacy ones (`compress_ratios`, `qk_rope_head_dim`, a flat `rope_scaling`), with transformers'
defaults where a key is absent. Anything the model cannot run is LOAD_FAILED here, before a tensor
is read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ds4desk.engine.models.base import config_float, config_int, load_failure

# The deepest published models have under 200 layers; a config claiming more is refused before
# anything is built per layer.
MAX_LAYERS = 1024
# DeepSeek-V4 ships one MTP block; a handful is already far more than any release.
MAX_MTP_LAYERS = 16

# Attention kinds (transformers' `layer_types`) and FFN kinds (`mlp_layer_types`).
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
MOE = "moe"
_LAYER_TYPES = (SLIDING, CSA, HCA)
_MLP_TYPES = (HASH_MOE, MOE)
# The official config's per-layer `compress_ratios`.
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES = {CSA: 4, HCA: 128}
# Set by loading/gguf_deepseek4.py: the routed experts are three stacked tensors per layer (gate, up,
# down), each in the GGUF block type the file stores it in, as llama.cpp's converter writes them.
GGUF_EXPERTS_KEY = "ds4desk_gguf_experts"


@dataclass(slots=True, frozen=True)
class V4Rope:
    """One rotary kind: plain, or YaRN (only the frequencies change: V4 has no mscale)."""

    theta: float
    dim: int  # rotated dims (the trailing `dim` of each head)
    yarn_factor: float = 1.0  # 1.0: plain rope
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos/sin
    truncate: bool = True

    @classmethod
    def from_hf(cls, params: dict[str, Any], dim: int, what: str) -> V4Rope:
        kind = params.get("rope_type", params.get("type", "default"))
        theta = config_float(params, "rope_theta")
        if kind == "default":
            return cls(theta=theta, dim=dim)
        if kind != "yarn":
            raise load_failure(
                f"{what} rope type '{kind}' is not supported; DeepSeek-V4 uses 'default' or 'yarn'"
            )
        return cls(
            theta=theta,
            dim=dim,
            yarn_factor=config_float(params, "factor"),
            original_max_positions=config_int(params, "original_max_position_embeddings"),
            beta_fast=config_float(params, "beta_fast", 32.0),
            beta_slow=config_float(params, "beta_slow", 1.0),
            # transformers derives 0.1 ln(f) + 1 when a nested config lacks the key; DeepSeek's
            # reference implementation of V4 never scales cos/sin (its YaRN changes only the
            # frequencies), so we default to 1.
            attention_factor=config_float(params, "attention_factor", 1.0),
            truncate=bool(params.get("truncate", True)),
        )

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """Per-pair rotation speeds, float32 [dim // 2]."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        powers = self.theta**exponents
        plain = 1.0 / powers
        if self.yarn_factor == 1.0 and self.original_max_positions == 0:
            return plain

        # YaRN: pairs that turn fewer than beta_slow times over the original context are slowed
        # by `factor`, those turning more than beta_fast times are kept, with a linear ramp between.
        def correction(turns: float) -> float:
            ratio = self.original_max_positions / (turns * 2 * math.pi)
            return self.dim * math.log(ratio) / (2 * math.log(self.theta))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp would divide by zero
        pairs = torch.arange(self.dim // 2, dtype=torch.float32, device=device)
        ramp = ((pairs - low) / (high - low)).clamp(0, 1)
        return plain * (1 - ramp) + (1.0 / (self.yarn_factor * powers)) * ramp


@dataclass(slots=True, frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_experts: int
    experts_per_token: int
    expert_size: int  # moe_intermediate_size; the shared expert has the same width
    routed_scaling_factor: float
    swiglu_limit: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: V4Rope  # sliding layers
    compress_rope: V4Rope  # CSA/HCA layers: queries, raw keys, entries and the indexer
    tie_word_embeddings: bool = False
    # The MTP blocks the checkpoint holds (loading/deepseek_v4_names.with_mtp), one entry each: kept
    # on the model for speculative decoding, not run by the forward.
    mtp_layer_types: tuple[str, ...] = ()
    mtp_mlp_layer_types: tuple[str, ...] = ()
    # Routed experts as a GGUF stores them (GGUF_EXPERTS_KEY): gate, up and down stacked apart.
    gguf_experts: bool = False

    def rate(self, layer_type: str) -> int:
        return self.csa_rate if layer_type == CSA else self.hca_rate

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DeepseekV4Config:
        """Read and validate a DeepSeek-V4 config.json (transformers' or the official one)."""
        if not isinstance(config, dict):
            raise load_failure("config.json is not a JSON object")
        layers = config_int(config, "num_hidden_layers")
        if layers > MAX_LAYERS:  # everything per layer is sized from it: refused before
            raise load_failure(
                f"config.json num_hidden_layers {layers} is more than ds4desk loads ({MAX_LAYERS})"
            )
        hidden = config_int(config, "hidden_size")
        heads = config_int(config, "num_attention_heads")
        head_dim = config_int(config, "head_dim")
        if config_int(config, "num_key_value_heads", 1) != 1:
            raise load_failure(
                "DeepSeek-V4 has one shared K=V head; config.json says num_key_value_heads != 1"
            )
        groups = config_int(config, "o_groups")
        if heads % groups:
            raise load_failure(f"num_attention_heads ({heads}) is not a multiple of o_groups ({groups})")
        scoring = config.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise load_failure(f"scoring_func '{scoring}' is not supported; DeepSeek-V4 uses 'sqrtsoftplus'")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise load_failure(f"hidden_act '{act}' is not supported; DeepSeek-V4 uses 'silu'")
        if config_int(config, "n_shared_experts", 1) != 1:
            raise load_failure("only n_shared_experts = 1 is supported")
        experts = config_int(config, "n_routed_experts")
        per_token = config_int(config, "num_experts_per_tok")
        if per_token > experts:
            raise load_failure(f"num_experts_per_tok ({per_token}) exceeds n_routed_experts ({experts})")

        layer_types = _layer_types(config, layers)
        mlp_types = _mlp_layer_types(config, layers)
        rates = _compress_rates(config)
        main, compress = _ropes(config, head_dim)
        mtp_types, mtp_mlp_types = _mtp_layer_types(config)
        index_dim = config_int(config, "index_head_dim", 128)
        if CSA in (*layer_types, *mtp_types) and index_dim < compress.dim:
            raise load_failure(
                f"index_head_dim ({index_dim}) is smaller than the rotary dims ({compress.dim})"
            )
        return cls(
            vocab_size=config_int(config, "vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            head_dim=head_dim,
            q_lora_rank=config_int(config, "q_lora_rank"),
            o_groups=groups,
            o_lora_rank=config_int(config, "o_lora_rank"),
            sliding_window=config_int(config, "sliding_window", 128),
            hc_mult=config_int(config, "hc_mult", 4),
            hc_sinkhorn_iters=config_int(config, "hc_sinkhorn_iters", 20),
            hc_eps=config_float(config, "hc_eps", 1e-6),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            num_experts=experts,
            experts_per_token=per_token,
            expert_size=config_int(config, "moe_intermediate_size"),
            routed_scaling_factor=config_float(config, "routed_scaling_factor", 1.0),
            swiglu_limit=config_float(config, "swiglu_limit", 10.0),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            csa_rate=rates[CSA],
            hca_rate=rates[HCA],
            index_heads=config_int(config, "index_n_heads", 64),
            index_head_dim=index_dim,
            index_topk=config_int(config, "index_topk", 512),
            main_rope=main,
            compress_rope=compress,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            mtp_layer_types=mtp_types,
            mtp_mlp_layer_types=mtp_mlp_types,
            gguf_experts=config.get(GGUF_EXPERTS_KEY) is True,
        )


def _layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types` > legacy `compress_ratios` (cut to the layer count: the tail is MTP) > the
    transformers default (2 HCA, then CSA/HCA alternating)."""
    types = config.get("layer_types")
    if types is None and config.get("compress_ratios") is not None:
        ratios = config["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in _RATIO_TO_TYPE for r in ratios):
            raise load_failure(f"config.json 'compress_ratios' must list values from {list(_RATIO_TO_TYPE)}")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    if not isinstance(types, list) or len(types) < layers or any(t not in _LAYER_TYPES for t in types):
        raise load_failure(
            f"config.json layer types must list {layers} values from {list(_LAYER_TYPES)}, got {types!r}"
        )
    return tuple(types[:layers])


def _mlp_layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = config.get("mlp_layer_types")
    if types is None:
        hashed = config_int(config, "num_hash_layers", 3, minimum=0)
        types = [HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed)
    if not isinstance(types, list) or len(types) < layers or any(t not in _MLP_TYPES for t in types):
        raise load_failure(f"config.json 'mlp_layer_types' must list {layers} values from {list(_MLP_TYPES)}")
    return tuple(types[:layers])


def _mtp_layer_types(config: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The MTP blocks' attention and FFN kinds: two lists of one length, absent when there are none."""
    types = config.get("mtp_layer_types") or []
    mlp_types = config.get("mtp_mlp_layer_types") or []
    if (
        not isinstance(types, list)
        or not isinstance(mlp_types, list)
        or len(types) != len(mlp_types)
        or len(types) > MAX_MTP_LAYERS
        or any(t not in _LAYER_TYPES for t in types)
        or any(t not in _MLP_TYPES for t in mlp_types)
    ):
        raise load_failure(
            f"config.json 'mtp_layer_types' / 'mtp_mlp_layer_types' must be two lists of one length (at "
            f"most {MAX_MTP_LAYERS}) from {list(_LAYER_TYPES)} and {list(_MLP_TYPES)}"
        )
    return tuple(types), tuple(mlp_types)


def _compress_rates(config: dict[str, Any]) -> dict[str, int]:
    given = config.get("compress_rates")
    if given is not None and not isinstance(given, dict):
        raise load_failure(f"config.json 'compress_rates' must be an object, got {given!r}")
    rates = {**_DEFAULT_RATES, **(given or {})}
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if config.get(legacy) is not None:
            rates[kind] = config[legacy]
    for kind in (CSA, HCA):
        config_int(rates, kind)
    return rates


def _ropes(config: dict[str, Any], head_dim: int) -> tuple[V4Rope, V4Rope]:
    """{main, compress} rope parameters: nested `rope_parameters` verbatim, else built from
    `rope_theta`, `compress_rope_theta` and the legacy flat `rope_scaling` (as transformers does)."""
    factor = config.get("partial_rotary_factor")
    if factor is None:
        rope_dims = config.get("qk_rope_head_dim")
        legacy = isinstance(rope_dims, int) and not isinstance(rope_dims, bool)
        factor = rope_dims / head_dim if legacy else 0.125  # Flash / Pro: 64 of 512
    params = config.get("rope_parameters")
    nested = isinstance(params, dict) and all(isinstance(params.get(k), dict) for k in ("main", "compress"))
    if nested:
        main, compress = params["main"], params["compress"]
    else:
        flat = params if isinstance(params, dict) else config.get("rope_scaling")
        if flat is not None and not isinstance(flat, dict):
            raise load_failure(f"config.json 'rope_scaling' must be an object, got {flat!r}")
        main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress = {
            **{k: v for k, v in (flat or {}).items() if k not in ("main", "compress")},
            "rope_theta": config.get("compress_rope_theta", 160000.0),
        }
    ropes = []
    for what, params_of in (("main", main), ("compress", compress)):
        share = params_of.get("partial_rotary_factor", factor)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise load_failure(f"partial_rotary_factor must be in (0, 1], got {share!r}")
        dim = int(head_dim * share)
        if dim <= 0 or dim % 2:
            raise load_failure(
                f"{what} rope rotates {dim} dims of {head_dim}; it must be a positive even number"
            )
        ropes.append(V4Rope.from_hf(params_of, dim, what))
    return ropes[0], ropes[1]
