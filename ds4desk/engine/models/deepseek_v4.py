"""DeepSeek-V4 (Flash / Pro): hyper-connected MoE decoder with three attention kinds.

What differs from the dense family (see /work/shared/DEEPSEEK_V4.md for the math):

- The residual is `hc_mult` parallel streams mixed by manifold-constrained hyper-connections
  (mHC): each block reads a weighted sum of the streams and writes back `post * y + Cᵀ X`, with C
  made doubly stochastic by Sinkhorn iterations (float32).
- Attention has a low-rank normed query, one shared K=V head, partial interleaved RoPE on the
  trailing dims (undone on the output at the query position), a per-head sink logit and a
  grouped low-rank output projection.
- Every layer attends to the raw keys of a sliding window. CSA layers add compressed entries
  (one per 4 tokens, overlapping windows) chosen per query by a lightning indexer; HCA layers add
  every compressed entry (one per 128 tokens).
- Every FFN is a MoE: hash-routed (a token-id table) in the first layers, score-routed after.

Parameter names equal transformers' DeepseekV4ForCausalLM state-dict names, so a folder in that
layout loads by name (MTP tensors are simply not asked for). Batch is always 1: activations are
[T, hidden], streams [T, hc_mult, hidden].

The cache (`V4Cache`) is plain tensors allocated once for the context: per layer a W-slot raw ring
(slot p mod W), the compressed rows, the indexer rows and the compressors' carried state. Calls
must be contiguous (start 0, or where the last call ended), so nothing stale is ever read: every
row a query can see was written by this request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.models.llama import LogitsMode

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

# Bound on the [T, heads, entries] float32 block the indexer scores at once (256 MiB).
_INDEXER_BLOCK = 1 << 26


def _fail(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def _int(config: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        raise _fail(f"config.json has no '{key}'")
    # bool is an int subclass; `true` here is a broken config, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(f"config.json '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _float(config: dict[str, Any], key: str, default: float | None = None, positive: bool = True) -> float:
    value = config.get(key, default)
    if value is None:
        raise _fail(f"config.json has no '{key}'")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(f"config.json '{key}' must be a number, got {value!r}")
    if positive and value <= 0:
        raise _fail(f"config.json '{key}' must be positive, got {value!r}")
    return float(value)


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
        theta = _float(params, "rope_theta")
        if kind == "default":
            return cls(theta=theta, dim=dim)
        if kind != "yarn":
            raise _fail(f"{what} rope type '{kind}' is not supported; DeepSeek-V4 uses 'default' or 'yarn'")
        return cls(
            theta=theta,
            dim=dim,
            yarn_factor=_float(params, "factor"),
            original_max_positions=_int(params, "original_max_position_embeddings"),
            beta_fast=_float(params, "beta_fast", 32.0),
            beta_slow=_float(params, "beta_slow", 1.0),
            # transformers derives 0.1 ln(f) + 1 when a nested config lacks the key; the V4
            # reference never scales cos/sin, so we default to 1 (fact sheet §1).
            attention_factor=_float(params, "attention_factor", 1.0),
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

    def rate(self, layer_type: str) -> int:
        return self.csa_rate if layer_type == CSA else self.hca_rate

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DeepseekV4Config:
        """Read and validate a DeepSeek-V4 config.json (transformers' or the official one)."""
        if not isinstance(config, dict):
            raise _fail("config.json is not a JSON object")
        layers = _int(config, "num_hidden_layers")
        hidden = _int(config, "hidden_size")
        heads = _int(config, "num_attention_heads")
        head_dim = _int(config, "head_dim")
        if _int(config, "num_key_value_heads", 1) != 1:
            raise _fail("DeepSeek-V4 has one shared K=V head; config.json says num_key_value_heads != 1")
        groups = _int(config, "o_groups")
        if heads % groups:
            raise _fail(f"num_attention_heads ({heads}) is not a multiple of o_groups ({groups})")
        scoring = config.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise _fail(f"scoring_func '{scoring}' is not supported; DeepSeek-V4 uses 'sqrtsoftplus'")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise _fail(f"hidden_act '{act}' is not supported; DeepSeek-V4 uses 'silu'")
        if _int(config, "n_shared_experts", 1) != 1:
            raise _fail("only n_shared_experts = 1 is supported")
        experts = _int(config, "n_routed_experts")
        per_token = _int(config, "num_experts_per_tok")
        if per_token > experts:
            raise _fail(f"num_experts_per_tok ({per_token}) exceeds n_routed_experts ({experts})")

        layer_types = _layer_types(config, layers)
        mlp_types = _mlp_layer_types(config, layers)
        rates = _compress_rates(config)
        main, compress = _ropes(config, head_dim)
        index_dim = _int(config, "index_head_dim", 128)
        if CSA in layer_types and index_dim < compress.dim:
            raise _fail(f"index_head_dim ({index_dim}) is smaller than the rotary dims ({compress.dim})")
        return cls(
            vocab_size=_int(config, "vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            head_dim=head_dim,
            q_lora_rank=_int(config, "q_lora_rank"),
            o_groups=groups,
            o_lora_rank=_int(config, "o_lora_rank"),
            sliding_window=_int(config, "sliding_window", 128),
            hc_mult=_int(config, "hc_mult", 4),
            hc_sinkhorn_iters=_int(config, "hc_sinkhorn_iters", 20),
            hc_eps=_float(config, "hc_eps", 1e-6),
            rms_norm_eps=_float(config, "rms_norm_eps", 1e-6),
            num_experts=experts,
            experts_per_token=per_token,
            expert_size=_int(config, "moe_intermediate_size"),
            routed_scaling_factor=_float(config, "routed_scaling_factor", 1.0),
            swiglu_limit=_float(config, "swiglu_limit", 10.0),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            csa_rate=rates[CSA],
            hca_rate=rates[HCA],
            index_heads=_int(config, "index_n_heads", 64),
            index_head_dim=index_dim,
            index_topk=_int(config, "index_topk", 512),
            main_rope=main,
            compress_rope=compress,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


def _layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types` > legacy `compress_ratios` (cut to the layer count: the tail is MTP) > the
    transformers default (2 HCA, then CSA/HCA alternating)."""
    types = config.get("layer_types")
    if types is None and config.get("compress_ratios") is not None:
        ratios = config["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in _RATIO_TO_TYPE for r in ratios):
            raise _fail(f"config.json 'compress_ratios' must list values from {list(_RATIO_TO_TYPE)}")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    if not isinstance(types, list) or len(types) < layers or any(t not in _LAYER_TYPES for t in types):
        raise _fail(
            f"config.json layer types must list {layers} values from {list(_LAYER_TYPES)}, got {types!r}"
        )
    return tuple(types[:layers])


def _mlp_layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = config.get("mlp_layer_types")
    if types is None:
        hashed = _int(config, "num_hash_layers", 3, minimum=0)
        types = [HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed)
    if not isinstance(types, list) or len(types) < layers or any(t not in _MLP_TYPES for t in types):
        raise _fail(f"config.json 'mlp_layer_types' must list {layers} values from {list(_MLP_TYPES)}")
    return tuple(types[:layers])


def _compress_rates(config: dict[str, Any]) -> dict[str, int]:
    given = config.get("compress_rates")
    if given is not None and not isinstance(given, dict):
        raise _fail(f"config.json 'compress_rates' must be an object, got {given!r}")
    rates = {**_DEFAULT_RATES, **(given or {})}
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if config.get(legacy) is not None:
            rates[kind] = config[legacy]
    for kind in (CSA, HCA):
        _int(rates, kind)
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
            raise _fail(f"config.json 'rope_scaling' must be an object, got {flat!r}")
        main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress = {
            **{k: v for k, v in (flat or {}).items() if k not in ("main", "compress")},
            "rope_theta": config.get("compress_rope_theta", 160000.0),
        }
    ropes = []
    for what, params_of in (("main", main), ("compress", compress)):
        share = params_of.get("partial_rotary_factor", factor)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise _fail(f"partial_rotary_factor must be in (0, 1], got {share!r}")
        dim = int(head_dim * share)
        if dim <= 0 or dim % 2:
            raise _fail(f"{what} rope rotates {dim} dims of {head_dim}; it must be a positive even number")
        ropes.append(V4Rope.from_hf(params_of, dim, what))
    return ropes[0], ropes[1]


# --- parameters (names mirror transformers' modules) ---------------------------------------------


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class _Weight(nn.Module):
    """A `.weight` holder: linear layers and norms (the math lives in the model's functions)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(shape, dtype)


class _HyperConnection(nn.Module):
    def __init__(self, mult: int, hidden: int) -> None:
        super().__init__()
        rows = (2 + mult) * mult  # pre (m) | post (m) | comb (m x m)
        self.fn = _param((rows, mult * hidden), torch.float32)
        self.base = _param((rows,), torch.float32)
        self.scale = _param((3,), torch.float32)


class _HyperHead(nn.Module):
    def __init__(self, mult: int, hidden: int) -> None:
        super().__init__()
        self.hc_fn = _param((mult, mult * hidden), torch.float32)
        self.hc_base = _param((mult,), torch.float32)
        self.hc_scale = _param((1,), torch.float32)


class _Compressor(nn.Module):
    """Gated pooling of `rate` tokens into one entry of `dim`; `overlap` (CSA) doubles the width:
    each token feeds the next window (first half) and its own (second half)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, dtype: torch.dtype) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.kv_proj = _Weight((width, hidden), dtype)
        self.gate_proj = _Weight((width, hidden), dtype)
        self.position_bias = _param((rate, width), torch.float32)
        self.kv_norm = _Weight((dim,), torch.float32)


class _Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = _Weight((heads, hidden), dtype)


class _Indexer(_Compressor):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, dtype)
        self.q_b_proj = _Weight((cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank), dtype)
        self.scorer = _Scorer(cfg.hidden_size, cfg.index_heads, dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads, dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_a_proj = _Weight((cfg.q_lora_rank, hidden), dtype)
        self.q_a_norm = _Weight((cfg.q_lora_rank,), torch.float32)
        self.q_b_proj = _Weight((heads * dim, cfg.q_lora_rank), dtype)
        self.kv_proj = _Weight((dim, hidden), dtype)
        self.kv_norm = _Weight((dim,), torch.float32)
        self.o_a_proj = _Weight((cfg.o_groups * cfg.o_lora_rank, heads * dim // cfg.o_groups), dtype)
        self.o_b_proj = _Weight((hidden, cfg.o_groups * cfg.o_lora_rank), dtype)
        self.sinks = _param((heads,), torch.float32)
        self.compressor: _Compressor | None = None
        if layer_type != SLIDING:
            self.compressor = _Compressor(hidden, dim, cfg.rate(layer_type), layer_type == CSA, dtype)
            if layer_type == CSA:
                self.compressor.indexer = _Indexer(cfg, dtype)


class _Router(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param((cfg.num_experts, cfg.hidden_size), dtype)
        if hashed:
            # token id -> its experts; validated at finish_loading.
            self.tid2eid = _param((cfg.vocab_size, cfg.experts_per_token), torch.int64)
        else:
            # Added to the scores for choosing experts only, never to their weights.
            self.e_score_correction_bias = _param((cfg.num_experts,), torch.float32)


class _Experts(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype) -> None:
        super().__init__()
        experts, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.expert_size
        self.gate_up_proj = _param((experts, 2 * width, hidden), dtype)  # gate rows, then up rows
        self.down_proj = _param((experts, hidden, width), dtype)


class _SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _Weight((cfg.expert_size, cfg.hidden_size), dtype)
        self.up_proj = _Weight((cfg.expert_size, cfg.hidden_size), dtype)
        self.down_proj = _Weight((cfg.hidden_size, cfg.expert_size), dtype)


class _Moe(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = _Router(cfg, hashed, dtype)
        self.experts = _Experts(cfg, dtype)
        self.shared_experts = _SharedExpert(cfg, dtype)


class _Layer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg, cfg.layer_types[index], dtype)
        self.mlp = _Moe(cfg, cfg.mlp_layer_types[index] == HASH_MOE, dtype)
        self.input_layernorm = _Weight((cfg.hidden_size,), torch.float32)
        self.post_attention_layernorm = _Weight((cfg.hidden_size,), torch.float32)
        self.attn_hc = _HyperConnection(cfg.hc_mult, cfg.hidden_size)
        self.ffn_hc = _HyperConnection(cfg.hc_mult, cfg.hidden_size)


class _Backbone(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = _Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nn.ModuleList(_Layer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = _Weight((cfg.hidden_size,), torch.float32)
        self.hc_head = _HyperHead(cfg.hc_mult, cfg.hidden_size)


def check_hash_table(name: str, table: torch.Tensor, num_experts: int) -> None:
    """A hash-routing table may only name experts that exist (LOAD_FAILED otherwise)."""
    bad = (table < 0) | (table >= num_experts)
    if bool(bad.any()):
        raise _fail(
            f"tensor {name} names expert {int(table[bad][0])}; the model has experts 0..{num_experts - 1}"
        )


# --- the cache -----------------------------------------------------------------------------------


@dataclass(slots=True)
class CompressorState:
    """What a compressor carries between calls (float32, as the reference pools)."""

    kv: torch.Tensor  # [rate, width]: the open window's projections, row = position mod rate
    gate: torch.Tensor  # [rate, width]: their gates, position bias included
    prev_kv: torch.Tensor | None  # CSA: [rate, dim], the last closed window's first-half kv
    prev_gate: torch.Tensor | None  # CSA: its first-half gates (bias included)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kv, self.gate, self.prev_kv, self.prev_gate) if t is not None]


@dataclass(slots=True)
class LayerState:
    ring: torch.Tensor  # [window, head_dim]: raw K=V rows, position p in row p mod window
    entries: torch.Tensor | None  # [context // rate, head_dim]: compressed rows (CSA / HCA)
    compressor: CompressorState | None
    index_entries: torch.Tensor | None  # [context // rate, index_head_dim]: indexer keys (CSA)
    indexer: CompressorState | None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.ring]
        for part in (self.entries, self.index_entries):
            if part is not None:
                out.append(part)
        for state in (self.compressor, self.indexer):
            if state is not None:
                out.extend(state.tensors())
        return out


@dataclass(slots=True)
class V4Cache:
    """Every tensor a continuation needs, plus `length`: the positions 0..length-1 it holds."""

    layers: list[LayerState]
    length: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _compressor_state(
    rate: int, width: int, dim: int, overlap: bool, device: torch.device
) -> CompressorState:
    def zeros(cols: int) -> torch.Tensor:
        return torch.zeros((rate, cols), device=device, dtype=torch.float32)

    return CompressorState(
        kv=zeros(width),
        gate=zeros(width),
        prev_kv=zeros(dim) if overlap else None,
        prev_gate=zeros(dim) if overlap else None,
    )


# --- the model -----------------------------------------------------------------------------------


class DeepseekV4Model(nn.Module):
    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = _Backbone(config, dtype)
        self.lm_head: _Weight | None = None
        if not config.tie_word_embeddings:
            self.lm_head = _Weight((config.vocab_size, config.hidden_size), dtype)
        self._inv_freq: dict[str, torch.Tensor] = {}
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # rope kind -> (cos, sin)
        self._cache: V4Cache | None = None
        self._context = 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context(self) -> int:
        return self._context

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def cache(self) -> V4Cache | None:
        return self._cache

    # --- loading -----------------------------------------------------------------------------

    def materialize(self, device: torch.device) -> None:
        """Give every parameter real (uninitialised) storage on `device`, keeping its dtype."""
        for module in self.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    real = torch.empty(param.shape, device=device, dtype=param.dtype)
                    module._parameters[name] = nn.Parameter(real, requires_grad=False)

    def finish_loading(self) -> None:
        """After the weights are in: check the hash tables and derive the rope frequencies."""
        cfg = self.config
        for index, layer in enumerate(self.model.layers):
            table = getattr(layer.mlp.gate, "tid2eid", None)
            if table is not None:
                check_hash_table(f"model.layers.{index}.mlp.gate.tid2eid", table, cfg.num_experts)
        device = self.device
        self._inv_freq = {
            "main": cfg.main_rope.inverse_frequencies(device),
            "compress": cfg.compress_rope.inverse_frequencies(device),
        }
        if self._context:
            self.allocate_cache(self._context)

    # --- cache -------------------------------------------------------------------------------

    def allocate_cache(self, context: int) -> None:
        """Allocate every layer's state and the rope tables for `context` positions."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        if not self._inv_freq:
            raise RuntimeError("allocate_cache before finish_loading")
        cfg = self.config
        self.free_cache()
        device = self.device
        positions = torch.arange(context, device=device, dtype=torch.float32)
        for kind, rope in (("main", cfg.main_rope), ("compress", cfg.compress_rope)):
            angles = torch.outer(positions, self._inv_freq[kind])
            self._tables[kind] = (angles.cos() * rope.attention_factor, angles.sin() * rope.attention_factor)
        layers = []
        for layer_type in cfg.layer_types:
            # Zeroed, so no stale NaN can ever meet a zero softmax weight.
            ring = torch.zeros((cfg.sliding_window, cfg.head_dim), device=device, dtype=self.dtype)
            state = LayerState(ring, None, None, None, None)
            if layer_type != SLIDING:
                rate = cfg.rate(layer_type)
                overlap = layer_type == CSA
                rows = context // rate
                width = (2 if overlap else 1) * cfg.head_dim
                state.entries = torch.zeros((rows, cfg.head_dim), device=device, dtype=self.dtype)
                state.compressor = _compressor_state(rate, width, cfg.head_dim, overlap, device)
                if overlap:
                    state.index_entries = torch.zeros(
                        (rows, cfg.index_head_dim), device=device, dtype=self.dtype
                    )
                    state.indexer = _compressor_state(
                        rate, 2 * cfg.index_head_dim, cfg.index_head_dim, True, device
                    )
            layers.append(state)
        self._cache = V4Cache(layers)
        self._context = context

    def free_cache(self) -> None:
        self._cache = None
        self._tables = {}
        self._context = 0

    def cache_bytes(self) -> int:
        return 0 if self._cache is None else self._cache.nbytes()

    def cache_bytes_for(self, context: int) -> int:
        """What allocate_cache(context) will take, before taking it (the compressed and indexer rows
        grow with the context; the ring and the carry states do not)."""
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer_type in cfg.layer_types:
            total += cfg.sliding_window * cfg.head_dim * itemsize
            if layer_type != SLIDING:
                rows = context // cfg.rate(layer_type)
                total += rows * cfg.head_dim * itemsize
                if layer_type == CSA:
                    total += rows * cfg.index_head_dim * itemsize
        return total

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """The state after positions 0..length-1, as host tensors: the raw window in logical order
        (oldest position first), the closed compressed and indexer rows, the compressors' carry.
        Only the current position can be exported: older raw rows are already overwritten."""
        cache = self._cache
        assert cache is not None
        if length != cache.length:
            raise EngineFailure(
                ErrorCode.INVALID_SNAPSHOT_SLOT,
                f"DeepSeek-V4 can snapshot its current position {cache.length}, not {length}",
            )
        window = self.config.sliding_window
        logical = [p % window for p in range(max(0, length - window), length)]
        state: dict[str, torch.Tensor] = {}

        def host(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to("cpu", copy=True)  # a copy also on the CPU: the cache changes on

        for i, (layer, kind) in enumerate(zip(cache.layers, self.config.layer_types, strict=True)):
            state[f"{i}.ring"] = host(layer.ring[logical])
            if layer.entries is not None:
                rows = length // self.config.rate(kind)
                state[f"{i}.entries"] = host(layer.entries[:rows])
                if layer.index_entries is not None:
                    state[f"{i}.index_entries"] = host(layer.index_entries[:rows])
            for name, carry in (("compressor", layer.compressor), ("indexer", layer.indexer)):
                if carry is not None:
                    for j, tensor in enumerate(carry.tensors()):
                        state[f"{i}.{name}.{j}"] = host(tensor)
        return state

    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state; afterwards the model continues at `length`."""
        cache = self._cache
        assert cache is not None
        window = self.config.sliding_window
        physical = [p % window for p in range(max(0, length - window), length)]
        for i, layer in enumerate(cache.layers):
            layer.ring[physical] = state[f"{i}.ring"].to(layer.ring.device, layer.ring.dtype)
            for name in ("entries", "index_entries"):
                target = getattr(layer, name)
                if target is not None:
                    rows = state[f"{i}.{name}"]
                    target[: rows.shape[0]].copy_(rows)
            for name, carry in (("compressor", layer.compressor), ("indexer", layer.indexer)):
                if carry is not None:
                    for j, tensor in enumerate(carry.tensors()):
                        tensor.copy_(state[f"{i}.{name}.{j}"])
        cache.length = length

    # --- forward -----------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, updating the cache. start_pos is 0
        (a new request) or where the previous call ended. Returns float32 logits: [V] for "last",
        [T, V] for "all", None for "none"."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("forward before allocate_cache")
        count = input_ids.shape[0]
        end = start_pos + count
        if start_pos < 0 or count == 0 or end > self._context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW,
                f"positions {start_pos}..{end - 1} do not fit a context of {self._context}",
            )
        if start_pos not in (0, cache.length):
            raise EngineFailure(
                ErrorCode.BAD_REQUEST,
                f"DeepSeek-V4 continues at position {cache.length} or restarts at 0, not at {start_pos}",
            )
        cfg = self.config
        cache.length = 0  # until this call completes, the state is not a valid continuation
        x = F.embedding(input_ids, self.model.embed_tokens.weight)  # [T, D]
        streams = x.unsqueeze(1).expand(count, cfg.hc_mult, cfg.hidden_size).contiguous()
        for index, layer in enumerate(self.model.layers):
            streams = self._block(index, layer, streams, input_ids, start_pos)
        cache.length = end
        if logits == "none":
            return None
        if logits == "last":
            streams = streams[-1:]
        head = self.model.hc_head
        pre = _hc_mix(streams, head.hc_fn, cfg.rms_norm_eps) * head.hc_scale + head.hc_base
        h = _collapse(streams, torch.sigmoid(pre) + cfg.hc_eps)
        h = _rms_norm(h, self.model.norm.weight, cfg.rms_norm_eps)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        out = torch.mm(h, weight.t()).float()
        return out[0] if logits == "last" else out

    def _block(
        self, index: int, layer: _Layer, streams: torch.Tensor, ids: torch.Tensor, start: int
    ) -> torch.Tensor:
        cfg = self.config
        pre, post, comb = self._hc_site(streams, layer.attn_hc)
        h = _rms_norm(_collapse(streams, pre), layer.input_layernorm.weight, cfg.rms_norm_eps)
        streams = _expand(streams, self._attention(index, layer.self_attn, h, start), post, comb)
        pre, post, comb = self._hc_site(streams, layer.ffn_hc)
        h = _rms_norm(_collapse(streams, pre), layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        return _expand(streams, self._moe(layer.mlp, h, ids), post, comb)

    def _hc_site(
        self, streams: torch.Tensor, site: _HyperConnection
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 (pre [T, m], post [T, m], comb [T, m, m]) of one hyper-connection site."""
        cfg = self.config
        m, eps = cfg.hc_mult, cfg.hc_eps
        z = _hc_mix(streams, site.fn, cfg.rms_norm_eps)
        pre = torch.sigmoid(z[:, :m] * site.scale[0] + site.base[:m]) + eps
        post = 2 * torch.sigmoid(z[:, m : 2 * m] * site.scale[1] + site.base[m : 2 * m])
        logits = (z[:, 2 * m :] * site.scale[2] + site.base[2 * m :]).view(-1, m, m)
        comb = torch.softmax(logits, dim=-1) + eps
        # Sinkhorn towards a doubly stochastic matrix: columns first, then rows and columns.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb

    # --- attention ---------------------------------------------------------------------------

    def _attention(self, index: int, attn: _Attention, x: torch.Tensor, start: int) -> torch.Tensor:
        cfg, cache = self.config, self._cache
        assert cache is not None
        state = cache.layers[index]
        layer_type = cfg.layer_types[index]
        count = x.shape[0]
        heads, dim, window = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        eps = cfg.rms_norm_eps
        cos, sin = self._tables["main" if layer_type == SLIDING else "compress"]
        cos, sin = cos[start : start + count], sin[start : start + count]

        q_res = _rms_norm(x @ attn.q_a_proj.weight.t(), attn.q_a_norm.weight, eps)
        q = (q_res @ attn.q_b_proj.weight.t()).view(count, heads, dim)
        q = _rope(_rms_norm(q, None, eps), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = _rope(_rms_norm(x @ attn.kv_proj.weight.t(), attn.kv_norm.weight, eps), cos, sin)

        # Raw keys: the ring's rows before this chunk (logical order) then the chunk's own, each
        # query masked to its window [t - W + 1, t]. The chunk goes into the ring only after the
        # old rows were gathered, so early queries still see keys a wrapped chunk overwrites.
        old = min(start, window - 1)
        device = x.device
        key_pos = torch.arange(start - old, start + count, device=device)
        keys = torch.cat([state.ring.index_select(0, key_pos[:old] % window), kv])
        query_pos = torch.arange(start, start + count, device=device)
        distance = query_pos.unsqueeze(1) - key_pos.unsqueeze(0)
        allowed = (distance >= 0) & (distance < window)
        bias = torch.zeros(allowed.shape, device=device, dtype=torch.float32)
        bias.masked_fill_(~allowed, -math.inf)
        kept = min(count, window)
        state.ring.index_copy_(0, key_pos[-kept:] % window, kv[-kept:])

        scale = dim**-0.5
        q_heads = q.transpose(0, 1)  # [H, T, d]
        scores = [torch.matmul(q_heads, keys.t()).float() * scale + bias]  # [H, T, raw]
        extra: torch.Tensor | None = None
        if attn.compressor is not None:
            extra, extra_bias = self._compressed_keys(layer_type, attn.compressor, state, x, q_res, start)
            if extra.dim() == 2:  # [E, d]: every query scores the same entries (HCA)
                extra_scores = torch.matmul(q_heads, extra.t())
            else:  # [T, k, d]: each query its own indexer picks (CSA)
                extra_scores = torch.einsum("htd,tkd->htk", q_heads, extra)
            scores.append(extra_scores.float() * scale + extra_bias)

        # One softmax over raw keys, compressed keys and the per-head sink logit (no value).
        sink = attn.sinks.view(heads, 1, 1).expand(heads, count, 1)
        probs = torch.softmax(torch.cat([*scores, sink], dim=-1), dim=-1).to(keys.dtype)
        raw = keys.shape[0]
        out = torch.matmul(probs[..., :raw], keys)  # [H, T, d]
        if extra is not None:
            weights = probs[..., raw:-1]
            if extra.dim() == 2:
                out = out + torch.matmul(weights, extra)
            else:
                out = out + torch.einsum("htk,tkd->htd", weights, extra)
        out = out.transpose(0, 1)  # [T, H, d]
        # V = K carries the key's rotation; rotating back by the query's angle leaves relative ones.
        out = _rope(out, cos.unsqueeze(1), -sin.unsqueeze(1))

        groups = cfg.o_groups
        grouped = out.reshape(count, groups, -1).transpose(0, 1)  # [G, T, H d / G]
        o_a = attn.o_a_proj.weight.view(groups, cfg.o_lora_rank, -1)
        low = torch.bmm(grouped, o_a.transpose(1, 2)).transpose(0, 1).reshape(count, -1)
        return low @ attn.o_b_proj.weight.t()

    def _compressed_keys(
        self,
        layer_type: str,
        comp: _Compressor,
        state: LayerState,
        x: torch.Tensor,
        q_res: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the chunk to the layer's compressor(s) and return the compressed keys the chunk's
        queries score with their float32 bias (0 = visible, -inf = not): HCA every entry so far,
        [E, d] and [T, E]; CSA each query's indexer picks, [T, k, d] and [T, k], so attention
        never scores the thousands of entries a long context has."""
        cfg = self.config
        rate = cfg.rate(layer_type)
        assert state.entries is not None and state.compressor is not None
        self._compress(comp, state.compressor, state.entries, x, start, rate, layer_type == CSA)
        count = x.shape[0]
        available = (start + count) // rate
        entries = state.entries[:available]
        query_pos = torch.arange(start, start + count, device=x.device)
        # Entry w pools tokens up to (w + 1) rate - 1: visible from that token on.
        ready = ((query_pos + 1) // rate).unsqueeze(1)
        visible = torch.arange(available, device=x.device).unsqueeze(0) < ready
        if layer_type == CSA:
            indexer = comp.indexer
            assert isinstance(indexer, _Indexer)
            assert state.index_entries is not None and state.indexer is not None
            self._compress(indexer, state.indexer, state.index_entries, x, start, rate, True)
            if available:
                keys = state.index_entries[:available]
                picks, visible = self._index_select(indexer, keys, x, q_res, start, visible)
                entries = entries[picks]  # [T, k, d]
        bias = torch.zeros(visible.shape, device=x.device, dtype=torch.float32)
        return entries, bias.masked_fill_(~visible, -math.inf)

    def _compress(
        self,
        comp: _Compressor,
        state: CompressorState,
        rows: torch.Tensor,
        x: torch.Tensor,
        start: int,
        rate: int,
        overlap: bool,
    ) -> None:
        """Append the chunk's tokens to the open window and emit an entry for every window that
        closes (windows are anchored at multiples of `rate`, whatever the chunking). Decode and
        prefill share this path, so they pool identically."""
        count = x.shape[0]
        positions = torch.arange(start, start + count, device=x.device)
        kv = (x @ comp.kv_proj.weight.t()).float()
        gate = (x @ comp.gate_proj.weight.t()).float() + comp.position_bias[positions % rate]
        buffered = start % rate  # tokens of the open window that earlier calls saw
        kv = torch.cat([state.kv[:buffered], kv])
        gate = torch.cat([state.gate[:buffered], gate])
        closed = kv.shape[0] // rate
        used = closed * rate
        if closed:
            first = (start - buffered) // rate  # index of the first window closing now
            win_kv = kv[:used].view(closed, rate, -1)
            win_gate = gate[:used].view(closed, rate, -1)
            if overlap:
                dim = win_kv.shape[-1] // 2
                assert state.prev_kv is not None and state.prev_gate is not None
                # Entry w pools window w-1's first halves with window w's second halves.
                prev_kv = torch.cat([state.prev_kv.unsqueeze(0), win_kv[:-1, :, :dim]])
                prev_gate = torch.cat([state.prev_gate.unsqueeze(0), win_gate[:-1, :, :dim]])
                if first == 0:  # window 0 has no predecessor: weight 0
                    prev_kv[0] = 0.0
                    prev_gate[0] = -math.inf
                state.prev_kv.copy_(win_kv[-1, :, :dim])
                state.prev_gate.copy_(win_gate[-1, :, :dim])
                win_kv = torch.cat([prev_kv, win_kv[:, :, dim:]], dim=1)
                win_gate = torch.cat([prev_gate, win_gate[:, :, dim:]], dim=1)
            pooled = (win_kv * torch.softmax(win_gate, dim=1)).sum(dim=1)  # per-channel softmax
            pooled = _rms_norm(pooled.to(rows.dtype), comp.kv_norm.weight, self.config.rms_norm_eps)
            cos, sin = self._tables["compress"]
            at = torch.arange(first, first + closed, device=x.device) * rate
            rows[first : first + closed] = _rope(pooled, cos[at], sin[at])
        left = kv.shape[0] - used
        state.kv[:left] = kv[used:]
        state.gate[:left] = gate[used:]

    def _index_select(
        self,
        indexer: _Indexer,
        keys: torch.Tensor,
        x: torch.Tensor,
        q_res: torch.Tensor,
        start: int,
        visible: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer: per query, the top-k visible entries by Σ_h w_h · ReLU(q_h · k).
        Returns the picks [T, k] and whether each is visible (too few visible: some are not)."""
        cfg = self.config
        count, heads, dim = x.shape[0], cfg.index_heads, cfg.index_head_dim
        cos, sin = self._tables["compress"]
        q = (q_res @ indexer.q_b_proj.weight.t()).view(count, heads, dim)
        q = _rope(q, cos[start : start + count].unsqueeze(1), sin[start : start + count].unsqueeze(1)).float()
        weights = (x @ indexer.scorer.weights_proj.weight.t()).float() * heads**-0.5  # [T, Hi]
        keys32 = keys.float().t()
        total = keys.shape[0]
        scores = torch.zeros((count, total), device=x.device, dtype=torch.float32)
        step = max(1, _INDEXER_BLOCK // max(1, count * total))  # heads per block, to bound memory
        for h in range(0, heads, step):
            part = torch.relu(torch.matmul(q[:, h : h + step], keys32)) * dim**-0.5  # [T, h, E]
            scores += (part * weights[:, h : h + step].unsqueeze(-1)).sum(dim=1)
        scores.masked_fill_(~visible, -math.inf)
        picks = scores.topk(min(cfg.index_topk, total), dim=-1).indices
        return picks, visible.gather(1, picks)

    # --- MoE ---------------------------------------------------------------------------------

    def _moe(self, moe: _Moe, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        gate = moe.gate
        scores = F.softplus((x @ gate.weight.t()).float()).sqrt()  # [T, E]
        tid2eid = getattr(gate, "tid2eid", None)
        if tid2eid is not None:
            chosen = tid2eid[ids]
        else:
            chosen = (scores + gate.e_score_correction_bias).topk(cfg.experts_per_token, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor

        out = torch.zeros_like(x)
        experts = moe.experts
        for expert in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert)
            y = _swiglu(x[rows] @ experts.gate_up_proj[expert].t(), cfg.swiglu_limit)
            y = y @ experts.down_proj[expert].t()
            out.index_add_(0, rows, (y * weights[rows, slot].unsqueeze(1)).to(out.dtype))
        shared = moe.shared_experts
        gate_up = torch.cat([x @ shared.gate_proj.weight.t(), x @ shared.up_proj.weight.t()], dim=-1)
        return out + _swiglu(gate_up, cfg.swiglu_limit) @ shared.down_proj.weight.t()


# --- math helpers --------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; the (float32) weight multiplies before the cast back, as V4 keeps it."""
    normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = weight * normed
    return normed.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x in interleaved pairs (2i, 2i + 1), float32."""
    dims = 2 * cos.shape[-1]
    rot = x[..., -dims:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-dims], rotated.to(x.dtype)], dim=-1)


def _hc_mix(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """The hyper-connection projection of the RMS-normed flattened streams, float32 [T, rows]."""
    flat = streams.reshape(streams.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return flat @ fn.t()


def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_j pre_j X_j: the block input, [T, D]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def _expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k y + Σ_j C[j, k] X_j (Cᵀ X: C is not symmetric)."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(1, 2), streams)
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + mixed


def _swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, ±limit) of a [.., gate | up] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
