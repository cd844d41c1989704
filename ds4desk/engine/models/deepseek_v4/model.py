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
from ds4desk.engine.formats import FP4_BLOCK, FP8_BLOCK
from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from ds4desk.engine.kernels.deepseek_v4 import route as v4_route
from ds4desk.engine.kernels.deepseek_v4.decode_attention import decode_attention
from ds4desk.engine.kernels.deepseek_v4.hc_kernel import hc_weights
from ds4desk.engine.kernels.deepseek_v4.norm_rope import norm_rope
from ds4desk.engine.kernels.deepseek_v4.prefill_attention import prefill_attention
from ds4desk.engine.kernels.dense import gemv as decode_kernels
from ds4desk.engine.kernels.quant.fp8_fp4 import (
    fp4_experts_gemv,
    fp4_grouped_matmul,
    fp8_linear,
    fp8_row_,
    fp8_row_fits,
)
from ds4desk.engine.models.llama.model import LogitsMode
from ds4desk.engine.split import ShardPlan, check_placement, materialize_parameters

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


class _Fp8Weight(nn.Module):
    """A linear weight kept in FP8 e4m3 with a float32 multiplier per 128 x 128 block (the official
    checkpoints' format, fact sheet §8): half the bytes of bf16 per decode step, and Hopper's FP8
    matrix units for prefill (quant_kernels.fp8_linear)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        rows, cols = shape
        self.weight = _param(shape, torch.float8_e4m3fn)
        self.weight_scale_inv = _param((-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), torch.float32)


def _linear_weight(shape: tuple[int, int], dtype: torch.dtype, fp8: bool) -> nn.Module:
    return _Fp8Weight(shape) if fp8 else _Weight(shape, dtype)


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
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, dtype)
        self.q_b_proj = _linear_weight((cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank), dtype, fp8)
        self.scorer = _Scorer(cfg.hidden_size, cfg.index_heads, dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_type: str, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__()
        hidden, heads, dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_a_proj = _linear_weight((cfg.q_lora_rank, hidden), dtype, fp8)
        self.q_a_norm = _Weight((cfg.q_lora_rank,), torch.float32)
        self.q_b_proj = _linear_weight((heads * dim, cfg.q_lora_rank), dtype, fp8)
        self.kv_proj = _linear_weight((dim, hidden), dtype, fp8)
        self.kv_norm = _Weight((dim,), torch.float32)
        # Grouped (a batched matmul): bf16 even in quantized models, as the official converter leaves it.
        self.o_a_proj = _Weight((cfg.o_groups * cfg.o_lora_rank, heads * dim // cfg.o_groups), dtype)
        self.o_b_proj = _linear_weight((hidden, cfg.o_groups * cfg.o_lora_rank), dtype, fp8)
        self.sinks = _param((heads,), torch.float32)
        self.compressor: _Compressor | None = None
        if layer_type != SLIDING:
            self.compressor = _Compressor(hidden, dim, cfg.rate(layer_type), layer_type == CSA, dtype)
            if layer_type == CSA:
                self.compressor.indexer = _Indexer(cfg, dtype, fp8)


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
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, fp4: bool) -> None:
        super().__init__()
        experts, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.expert_size
        if not fp4:
            self.gate_up_proj = _param((experts, 2 * width, hidden), dtype)  # gate rows, then up rows
            self.down_proj = _param((experts, hidden, width), dtype)
            return
        # Packed FP4 as the official checkpoint stores them (two values a byte, a UE8M0 exponent
        # byte per 32): a quarter of bf16's bytes, which is what lets Flash fit on two GPUs.
        self.gate_up_proj = _param((experts, 2 * width, hidden // 2), torch.uint8)
        self.gate_up_proj_scale = _param((experts, 2 * width, hidden // FP4_BLOCK), torch.uint8)
        self.down_proj = _param((experts, hidden, width // 2), torch.uint8)
        self.down_proj_scale = _param((experts, hidden, width // FP4_BLOCK), torch.uint8)


class _SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__()
        self.gate_proj = _linear_weight((cfg.expert_size, cfg.hidden_size), dtype, fp8)
        self.up_proj = _linear_weight((cfg.expert_size, cfg.hidden_size), dtype, fp8)
        self.down_proj = _linear_weight((cfg.hidden_size, cfg.expert_size), dtype, fp8)


class _Moe(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype, quantized: bool) -> None:
        super().__init__()
        self.gate = _Router(cfg, hashed, dtype)
        self.experts = _Experts(cfg, dtype, quantized)
        self.shared_experts = _SharedExpert(cfg, dtype, quantized)


class _Layer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, index: int, dtype: torch.dtype, quantized: bool) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg, cfg.layer_types[index], dtype, quantized)
        self.mlp = _Moe(cfg, cfg.mlp_layer_types[index] == HASH_MOE, dtype, quantized)
        self.input_layernorm = _Weight((cfg.hidden_size,), torch.float32)
        self.post_attention_layernorm = _Weight((cfg.hidden_size,), torch.float32)
        self.attn_hc = _HyperConnection(cfg.hc_mult, cfg.hidden_size)
        self.ffn_hc = _HyperConnection(cfg.hc_mult, cfg.hidden_size)


class _Backbone(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, quantized: bool) -> None:
        super().__init__()
        self.embed_tokens = _Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nn.ModuleList(_Layer(cfg, i, dtype, quantized) for i in range(cfg.num_layers))
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
    # decode_graphable is CUDA-graph capturable (no host syncs, shapes fixed by the span).
    supports_graphs = True
    # Graphable MoE: None picks by cost (see _decode_moe); True / False force all experts / a gather.
    graph_dense_moe: bool | None = None

    def __init__(
        self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, quantized: bool = False
    ) -> None:
        """`quantized`: the linears the official checkpoint stores in FP8 stay FP8 (_Fp8Weight) and
        the routed experts packed FP4; everything else, and all activations, in `dtype`."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.quantized = quantized
        self.model = _Backbone(config, dtype, quantized)
        self.lm_head: _Weight | None = None
        if not config.tie_word_embeddings:
            self.lm_head = _Weight((config.vocab_size, config.hidden_size), dtype)
        self._inv_freq: dict[str, torch.Tensor] = {}
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # rope kind -> (cos, sin)
        self._cache: V4Cache | None = None
        self._context = 0
        # 0, 1, 2, ...: the index constants the graphable decode slices (never built inside a capture).
        self._steps: torch.Tensor | None = None
        # A layer split (ds4desk.engine.split): the first layer of every later shard -> its device,
        # and per device the rope tables and steps its layers read (copies of the first device's).
        self._split: ShardPlan | None = None
        self._boundaries: dict[int, torch.device] = {}
        self._per_device: dict[
            torch.device, tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
        ] = {}
        self._tied_head: torch.Tensor | None = None  # a tied head's copy on the last shard's device

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
    def split(self) -> ShardPlan | None:
        """The layer split set by place(); None: every layer on `device`."""
        return self._split

    @property
    def cache(self) -> V4Cache | None:
        return self._cache

    # --- loading -----------------------------------------------------------------------------

    def place(self, plan: ShardPlan) -> None:
        """Split the layers over the plan's devices; before materialize (which then ignores its
        device): layer i's weights and cache go to its shard's device, the embedding to the first,
        the final norm, hyper-connection head and head to the last."""
        check_placement(plan, self.config.num_layers, self.parameters())
        self._split = plan

    def materialize(self, device: torch.device) -> None:
        """Give every parameter real (uninitialised) storage on `device` (or where the split puts
        it), keeping its dtype."""
        split = self._split
        # The compressors the loader fills: kv_proj and gate_proj become the row halves of one
        # tensor, so a decode step projects once (v4_compress_step.projections).
        fresh = [m for m in self.modules() if isinstance(m, _Compressor) and m.kv_proj.weight.is_meta]
        materialize_parameters(self, device, split)
        for comp in fresh:
            v4_compress_step.fuse_projections(comp)

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
        self._boundaries = {}
        if self._split is not None:
            for start, _stop in self._split.bounds()[1:]:
                self._boundaries[start] = self.model.layers[start].input_layernorm.weight.device
        last = self.model.norm.weight.device
        self._tied_head = None
        if self.lm_head is None and last != device:
            self._tied_head = self.model.embed_tokens.weight.to(last, copy=True)
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
        for layer_type, layer in zip(cfg.layer_types, self.model.layers, strict=True):
            device = layer.input_layernorm.weight.device  # its shard's (the only one, unsplit)
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
        longest = max(context, cfg.sliding_window, cfg.csa_rate, cfg.hca_rate)
        self._steps = torch.arange(longest, device=self.device)
        # Other devices read copies of the first device's tables: bit-identical angles everywhere.
        self._per_device = {self.device: (self._tables, self._steps)}
        for shard_device in self._boundaries.values():
            if shard_device not in self._per_device:
                tables = {
                    k: (c.to(shard_device, copy=True), s.to(shard_device, copy=True))
                    for k, (c, s) in self._tables.items()
                }
                self._per_device[shard_device] = (tables, self._steps.to(shard_device, copy=True))

    def free_cache(self) -> None:
        self._cache = None
        self._tables = {}
        self._per_device = {}
        self._context = 0
        self._steps = None

    def _use_device(self, device: torch.device) -> None:
        """Point the rope tables and steps the layer code reads at `device`'s copies (a split's
        shard boundary; the layer code itself stays device-agnostic)."""
        self._tables, self._steps = self._per_device[device]

    def _head_weight(self) -> torch.Tensor:
        if self._tied_head is not None:
            return self._tied_head
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def cache_bytes(self) -> int:
        return 0 if self._cache is None else self._cache.nbytes()

    def cache_bytes_for(self, context: int) -> int:
        """What allocate_cache(context) will take, before taking it (the compressed and indexer rows
        grow with the context; the ring and the carry states do not)."""
        return sum(self.layer_cache_bytes_for(context))

    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """cache_bytes_for per layer (a split plan places each with its layer)."""
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        out = []
        for layer_type in cfg.layer_types:
            total = cfg.sliding_window * cfg.head_dim * itemsize
            if layer_type != SLIDING:
                rows = context // cfg.rate(layer_type)
                total += rows * cfg.head_dim * itemsize
                if layer_type == CSA:
                    total += rows * cfg.index_head_dim * itemsize
            out.append(total)
        return out

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
        ids = input_ids.to(self.device)  # the caller's device may be another shard's
        x = F.embedding(ids, self.model.embed_tokens.weight)  # [T, D]
        streams = x.unsqueeze(1).expand(count, cfg.hc_mult, cfg.hidden_size).contiguous()
        if self._boundaries:
            self._use_device(self.device)
        # Fused sites (v4_hc_fused): a block's expand happens inside the next site, so `last` holds
        # the previous block's (y, post, comb) until then.
        fused = v4_hc_fused.enabled(streams, cfg.hc_mult)
        last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        for index, layer in enumerate(self.model.layers):
            if index in self._boundaries:
                # A shard boundary: the next layers need the streams and the token ids (hash
                # routing); positions are host ints here. Copies, never aliases.
                if last is not None:
                    streams, last = _expand(streams, *last), None
                device = self._boundaries[index]
                streams, ids = _hand_over(streams, device), _hand_over(ids, device)
                self._use_device(device)
            if fused:
                streams, last = self._block_fused(index, layer, streams, last, ids, start_pos)
            else:
                streams = self._block(index, layer, streams, ids, start_pos)
        if self._boundaries:
            self._use_device(self.device)
        cache.length = end
        if logits == "none":
            return None
        if logits == "last":
            streams = streams[-1:]
            last = None if last is None else (last[0][-1:], last[1][-1:], last[2][-1:])
        h = self._hc_head(streams) if last is None else self._hc_head_fused(streams, last)
        out = torch.mm(h, self._head_weight().t()).float()
        if out.device != input_ids.device:  # split: the logits come back to where the ids came from
            out = out.to(input_ids.device)
        return out[0] if logits == "last" else out

    def _block(
        self, index: int, layer: _Layer, streams: torch.Tensor, ids: torch.Tensor, start: int
    ) -> torch.Tensor:
        h, post, comb = self._hc_site(streams, layer.attn_hc, layer.input_layernorm.weight)
        streams = _expand(streams, self._attention(index, layer.self_attn, h, start), post, comb)
        h, post, comb = self._hc_site(streams, layer.ffn_hc, layer.post_attention_layernorm.weight)
        return _expand(streams, self._moe(layer.mlp, h, ids), post, comb)

    def _block_fused(
        self,
        index: int,
        layer: _Layer,
        streams: torch.Tensor,
        last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        ids: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """_block with fused sites: expands `last` (the previous block's (y, post, comb)) first and
        returns the streams before its own expand, with its own (y, post, comb)."""
        streams, h, post, comb = self._hc_site_fused(streams, last, layer.attn_hc, layer.input_layernorm)
        y = self._attention(index, layer.self_attn, h, start)
        streams, h, post, comb = self._hc_site_fused(
            streams, (y, post, comb), layer.ffn_hc, layer.post_attention_layernorm
        )
        return streams, (self._moe(layer.mlp, h, ids), post, comb)

    def _hc_site(
        self, streams: torch.Tensor, site: _HyperConnection, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One hyper-connection site: the block input Σ_j pre_j X_j RMS-normed with `norm`'s weight
        [T, D] in the streams' dtype, and the float32 post [T, m] and comb [T, m, m] for _expand."""
        cfg = self.config
        m = cfg.hc_mult
        z, streams32 = _hc_mix(streams, site.fn, cfg.rms_norm_eps)
        gates, comb = hc_weights(z, site.scale, site.base, m, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        h = _rms_norm(_collapse(streams32, gates[:, :m]), norm, cfg.rms_norm_eps, streams.dtype)
        return h, gates[:, m:], comb

    def _hc_head(self, streams: torch.Tensor) -> torch.Tensor:
        """The final collapse of the streams and the norm: the head's input [T, D]."""
        cfg, head = self.config, self.model.hc_head
        z, streams32 = _hc_mix(streams, head.hc_fn, cfg.rms_norm_eps)
        pre = torch.sigmoid(torch.addcmul(head.hc_base, z, head.hc_scale)) + cfg.hc_eps
        return _rms_norm(_collapse(streams32, pre), self.model.norm.weight, cfg.rms_norm_eps, streams.dtype)

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
        turn = _turn(cos[start : start + count], sin[start : start + count])  # [T, r / 2]

        if v4_norm_rope.enabled(x):
            # One kernel each, without float32 copies of the [T, H, d] query.
            at, rope = _position(start, x.device), 2 * cos.shape[-1]
            q_a = _linear(x, attn.q_a_proj)
            q_res = norm_rope(q_a, attn.q_a_norm.weight, eps, cos, sin, at, 0, q_a.dtype)
            q = _linear(q_res, attn.q_b_proj).view(count * heads, dim)
            q = norm_rope(q, None, eps, cos, sin, at, rope, q.dtype, heads).view(count, heads, dim)
            kv = _linear(x, attn.kv_proj)
            kv = norm_rope(kv, attn.kv_norm.weight, eps, cos, sin, at, rope, kv.dtype, 1)
        else:
            q_res = _rms_norm(_linear(x, attn.q_a_proj), attn.q_a_norm.weight, eps)
            q = _linear(q_res, attn.q_b_proj).view(count, heads, dim)
            q = _norm_rope(q, None, eps, turn.unsqueeze(1))
            kv = _norm_rope(_linear(x, attn.kv_proj), attn.kv_norm.weight, eps, turn)

        # Raw keys: each query t sees exactly the W positions t - W + 1 .. t, so every query gets
        # a window of its own, rows t .. t + W - 1 of [padding | ring rows before this chunk, in
        # logical order | the chunk's keys]: W scores a query instead of the chunk's whole length.
        # The chunk goes into the ring only after the old rows were gathered, so early queries
        # still see keys a wrapped chunk overwrites.
        old = min(start, window - 1)
        pad = window - 1 - old  # slots before position 0: never visible
        device = x.device
        ring_rows = state.ring.index_select(0, torch.arange(start - old, start, device=device) % window)
        keys = torch.cat([kv.new_zeros((pad, dim)), ring_rows, kv])  # [W - 1 + T, d]
        kept = min(count, window)
        state.ring.index_copy_(
            0, torch.arange(start + count - kept, start + count, device=device) % window, kv[-kept:]
        )

        entries: torch.Tensor | None = None
        picks: torch.Tensor | None = None
        extra_bias: torch.Tensor | None = None
        if attn.compressor is not None:
            entries, picks, extra_bias = self._compressed_keys(
                layer_type, attn.compressor, state, x, q_res, start
            )
        # One softmax over raw keys, compressed keys and the per-head sink logit (no value); fused
        # on NVIDIA GPUs (v4_prefill_attention), where picked entries are read in place.
        out = prefill_attention(q, keys, pad, entries, picks, extra_bias, attn.sinks, dim**-0.5)
        # V = K carries the key's rotation; rotating back by the query's angle leaves relative ones.
        out = _rope_(out, torch.conj_physical(turn).unsqueeze(1))

        groups = cfg.o_groups
        grouped = out.reshape(count, groups, -1).transpose(0, 1)  # [G, T, H d / G]
        o_a = attn.o_a_proj.weight.view(groups, cfg.o_lora_rank, -1)
        low = torch.bmm(grouped, o_a.transpose(1, 2)).transpose(0, 1).reshape(count, -1)
        return _linear(low, attn.o_b_proj)

    def _compressed_keys(
        self,
        layer_type: str,
        comp: _Compressor,
        state: LayerState,
        x: torch.Tensor,
        q_res: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Feed the chunk to the layer's compressor(s) and return the compressed keys the chunk's
        queries score, the picks among them and the float32 bias (0 = visible, -inf = not): HCA
        every entry so far, [E, d], None and [T, E]; CSA the entries [E, d] with each query's
        indexer picks [T, k] and [T, k], so attention never scores the thousands of entries a long
        context has (no picks while no entry exists)."""
        cfg = self.config
        rate = cfg.rate(layer_type)
        assert state.entries is not None and state.compressor is not None
        self._compress(comp, state.compressor, state.entries, x, start, rate, layer_type == CSA)
        count = x.shape[0]
        available = (start + count) // rate
        entries = state.entries[:available]
        # Entry w pools tokens up to (w + 1) rate - 1: visible from that token on.
        visible = v4_index_scores.visible_entries(count, available, start, rate, x.device)
        picks: torch.Tensor | None = None
        if layer_type == CSA:
            indexer = comp.indexer
            assert isinstance(indexer, _Indexer)
            assert state.index_entries is not None and state.indexer is not None
            self._compress(indexer, state.indexer, state.index_entries, x, start, rate, True)
            if available:
                keys = state.index_entries[:available]
                picks, visible = self._index_select(indexer, keys, x, q_res, start, visible)
        bias = torch.zeros(visible.shape, device=x.device, dtype=torch.float32)
        return entries, picks, bias.masked_fill_(~visible, -math.inf)

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
            cos, sin = self._tables["compress"]
            at = torch.arange(first, first + closed, device=x.device) * rate
            turn = _turn(cos[at], sin[at])
            rows[first : first + closed] = _norm_rope(
                pooled, comp.kv_norm.weight, self.config.rms_norm_eps, turn
            )
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
        q = _linear(q_res, indexer.q_b_proj)
        if v4_norm_rope.enabled(q):  # rotated in float32, cast once to the keys' dtype, as below
            at, rope = _position(start, x.device), 2 * cos.shape[-1]
            q = norm_rope(q.view(count * heads, dim), None, None, cos, sin, at, rope, keys.dtype, heads)
            q = q.view(count, heads, dim)
        else:
            q = q.view(count, heads, dim)
            q = _rope_(q.float(), _turn(cos[start : start + count], sin[start : start + count]).unsqueeze(1))
        weights = _index_weights(x, indexer, heads, dim)  # [T, Hi]
        # The q·k products in the model's dtype (tensor cores for bf16), summed in float32; -inf
        # where `visible` is False (visible_entries' rule, from the positions).
        q, total = q.to(keys.dtype), keys.shape[0]
        if v4_index_scores.enabled(q):
            scores = v4_index_scores.index_scores(q, keys, weights, start, cfg.rate(CSA))
        else:
            scores = v4_index_scores.reference(q, keys, weights, start, cfg.rate(CSA))
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

        # Grouped by expert: the (token, slot) pairs sorted by expert and one host read of the group
        # sizes; no per-token work.
        count, k = chosen.shape
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # pair indices, by expert
        sizes = torch.bincount(flat, minlength=cfg.num_experts)
        host_sizes = sizes.tolist()
        experts, limit = moe.experts, cfg.swiglu_limit
        largest, width = max(host_sizes), x.shape[1]
        if cfg.num_experts * largest <= 2 * count * k and experts.gate_up_proj.dtype != torch.uint8:
            # Balanced enough (so most experts have tokens: their weights are read anyway): two
            # batched GEMMs over all experts, each group padded to the largest, at most twice the
            # rows (and memory) of the pairs themselves. The padded rows are gathered straight
            # from x (a padding row repeats token 0: its output is never read), and each pair's
            # output straight from the result: one pass over the rows each way.
            ranked = flat.index_select(0, order)  # the expert of each sorted pair
            starts = (torch.cumsum(sizes, 0) - sizes).index_select(0, ranked)
            offset = torch.arange(count * k, device=x.device) - starts  # rank within its group
            slots = ranked * largest + offset  # each sorted pair's row in the padded [E, largest] layout
            sources = order.new_zeros(cfg.num_experts * largest).index_copy_(0, slots, order // k)
            padded = x.index_select(0, sources).view(cfg.num_experts, largest, width)
            hidden = _swiglu(*torch.bmm(padded, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1), limit)
            ys = torch.bmm(hidden, experts.down_proj.transpose(1, 2)).view(-1, width)
            by_pair = ys.index_select(0, torch.empty_like(slots).index_copy_(0, order, slots))
        else:
            inputs = x.index_select(0, order // k)  # [T k, D], by expert
            if experts.gate_up_proj.dtype == torch.uint8:
                # Packed FP4: one grouped kernel a projection widens the weight tiles in registers
                # (no bf16 copy of an expert, one launch for all of them).
                scales = experts.gate_up_proj_scale
                gate_up = fp4_grouped_matmul(inputs, host_sizes, experts.gate_up_proj, scales)
                hidden = _swiglu(*gate_up.chunk(2, dim=-1), limit)
                grouped = fp4_grouped_matmul(hidden, host_sizes, experts.down_proj, experts.down_proj_scale)
            else:  # one GEMM pair per expert that has tokens
                parts, first = [], 0
                for expert, size in enumerate(host_sizes):
                    if size:
                        gate_up = inputs[first : first + size] @ experts.gate_up_proj[expert].t()
                        parts.append(
                            _swiglu(*gate_up.chunk(2, dim=-1), limit) @ experts.down_proj[expert].t()
                        )
                        first += size
                grouped = torch.cat(parts)
            by_pair = torch.empty_like(inputs).index_copy_(0, order, grouped)  # back to (token, slot) order
        return v4_route.mix(weights, by_pair) + _shared_expert(moe.shared_experts, x, limit)

    # --- graphable decode (one token, CUDA-graph capturable) -------------------------------------
    #
    # The same math as forward(token, pos, "last") with every position-dependent choice made by
    # tensor ops on `pos`, so one captured graph serves every position below its span: the ring row
    # is pos mod W, a compressor writes every step but only changes an entry when its window closes,
    # and the compressed rows a query may see are a mask over the static span // rate rows. Nothing
    # here reads a device value on the host or sizes a tensor by one.

    def decode_graphable(self, token: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One decode step for the token in `token` (int64 [1]) at the position in `pos` (int64 [1]),
        both on the model's device. `span` (static, pos < span <= context) bounds the positions the
        step may attend to. Writes the position's state as forward(token, pos, "last") does and
        returns float32 logits [V].

        The cache's host-side length cannot follow `pos` without a sync: it is left invalid, and the
        caller reports the new length with set_length(pos + 1) after the step (or replay)."""
        carry: tuple[torch.Tensor, ...] = (token, pos)
        for shard, device in enumerate(self.decode_devices()):
            if shard:
                carry = tuple(_hand_over(t, device) for t in carry)
            carry = self.decode_shard(shard, carry, span)
        logits = carry[0]
        return logits if logits.device == token.device else logits.to(token.device)

    def decode_devices(self) -> list[torch.device]:
        """The device of every shard a decode step runs through, in order (one when unsplit)."""
        return [self.device, *self._boundaries.values()]

    def decode_shard(
        self, shard: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `shard`'s part of decode_graphable, all on its own device (so each shard can be a
        graph of its own): the first shard takes (token, pos), every later one the previous one's
        (streams, token, pos) copied to its device (the token for hash routing); the last returns
        (logits,), the others (streams, token, pos)."""
        cache = self._cache
        if cache is None or self._steps is None:
            raise RuntimeError("decode_graphable before allocate_cache")
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        cfg = self.config
        starts = [0, *self._boundaries]
        first = starts[shard]
        stop = starts[shard + 1] if shard + 1 < len(starts) else cfg.num_layers
        if shard == 0:
            token, pos = inputs
            cache.length = 0  # until set_length: forward and export_state refuse to continue from here
            x = F.embedding(token, self.model.embed_tokens.weight)  # [1, D]
            streams = x.unsqueeze(1).expand(1, cfg.hc_mult, cfg.hidden_size).contiguous()
        else:
            streams, token, pos = inputs
        if self._boundaries:
            self._use_device(streams.device)
        turns: dict[str, torch.Tensor] = {}  # the rotation at pos, per table: the same in every layer
        if v4_hc_fused.enabled(streams, cfg.hc_mult):
            streams, last = self._decode_layers_fused(first, stop, streams, token, pos, span, turns)
        else:
            last = None
            for index in range(first, stop):
                layer = self.model.layers[index]
                h, post, comb = self._hc_site(streams, layer.attn_hc, layer.input_layernorm.weight)
                y = self._decode_attention(index, layer.self_attn, h, pos, span, turns)
                streams = _expand(streams, y, post, comb)
                h, post, comb = self._hc_site(streams, layer.ffn_hc, layer.post_attention_layernorm.weight)
                streams = _expand(streams, self._decode_moe(layer.mlp, h, token), post, comb)
        if self._boundaries:
            self._use_device(self.device)
        if stop < cfg.num_layers:
            return (streams if last is None else _expand(streams, *last)), token, pos
        h = self._hc_head(streams) if last is None else self._hc_head_fused(streams, last)
        head = self._head_weight()
        if decode_kernels.one_row(h, head):
            return (decode_kernels.gemv(h, head, h.new_empty((1, head.shape[0]), dtype=torch.float32))[0],)
        return (torch.mm(h, head.t()).float()[0],)

    def _decode_layers_fused(
        self,
        first: int,
        stop: int,
        streams: torch.Tensor,
        token: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turns: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """decode_shard's layers with each hyper-connection site as two kernels (v4_hc_fused): a block's
        expand happens inside the next site, so this returns the streams before the last block's
        expand and that block's (y, post, comb) (None when there were no layers)."""
        last = None
        for index in range(first, stop):
            layer = self.model.layers[index]
            streams, h, post, comb = self._hc_site_fused(streams, last, layer.attn_hc, layer.input_layernorm)
            y = self._decode_attention(index, layer.self_attn, h, pos, span, turns)
            streams, h, post, comb = self._hc_site_fused(
                streams, (y, post, comb), layer.ffn_hc, layer.post_attention_layernorm
            )
            last = (self._decode_moe(layer.mlp, h, token), post, comb)
        return streams, last

    def _hc_site_fused(
        self,
        streams: torch.Tensor,
        previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        site: _HyperConnection,
        norm: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """_expand of `previous` (when given) then _hc_site, fused: (streams, h, post, comb)."""
        cfg = self.config
        return v4_hc_fused.site(
            streams,
            previous,
            site.fn,
            site.scale,
            site.base,
            norm.weight,
            cfg.hc_mult,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )

    def _hc_head_fused(
        self, streams: torch.Tensor, previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """_expand of the last block then _hc_head, with the fused expand + mix and collapse + norm."""
        cfg, head = self.config, self.model.hc_head
        streams, z = v4_hc_fused.expand_mix(streams, *previous, head.hc_fn, cfg.rms_norm_eps)
        pre = torch.sigmoid(torch.addcmul(head.hc_base, z, head.hc_scale)) + cfg.hc_eps
        weight = self.model.norm.weight
        return v4_hc_fused.collapse_norm(streams, pre, weight, cfg.rms_norm_eps, streams.dtype)

    def set_length(self, length: int) -> None:
        """After decode_graphable steps: the cache now holds positions 0..length-1."""
        cache = self._cache
        if cache is None:
            raise RuntimeError("set_length before allocate_cache")
        if not 0 < length <= self._context:
            raise ValueError(f"length must be in 1..{self._context}, got {length}")
        cache.length = length

    def _decode_attention(
        self,
        index: int,
        attn: _Attention,
        x: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turns: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        cfg, cache, steps = self.config, self._cache, self._steps
        assert cache is not None and steps is not None
        state = cache.layers[index]
        layer_type = cfg.layer_types[index]
        heads, dim, window, eps = cfg.num_heads, cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps
        table = "main" if layer_type == SLIDING else "compress"
        cos, sin = self._tables[table]
        if table not in turns:
            turns[table] = _turn(cos.index_select(0, pos), sin.index_select(0, pos))  # [1, r / 2]
        turn = turns[table]

        if v4_norm_rope.enabled(x):
            # One kernel each, reading the table rows at pos itself (turn is for attention's rotation).
            rope = 2 * cos.shape[-1]
            q_a = _linear(x, attn.q_a_proj)
            q_res = norm_rope(q_a, attn.q_a_norm.weight, eps, cos, sin, pos, 0, q_a.dtype)
            q = _linear(q_res, attn.q_b_proj).view(heads, dim)
            q = norm_rope(q, None, eps, cos, sin, pos, rope, q.dtype)  # [H, d]
            kv = _linear(x, attn.kv_proj)
            kv = norm_rope(kv, attn.kv_norm.weight, eps, cos, sin, pos, rope, kv.dtype)
        else:
            q_res = _rms_norm(_linear(x, attn.q_a_proj), attn.q_a_norm.weight, eps)
            q = _linear(q_res, attn.q_b_proj).view(heads, dim)
            q = _norm_rope(q, None, eps, turn)  # [H, d]
            kv = _norm_rope(_linear(x, attn.kv_proj), attn.kv_norm.weight, eps, turn)

        # Write first, then attend over the whole ring in physical order: slot s holds the latest
        # position ≡ s (mod W), which is in this query's window, or was never written by this
        # request while pos < W - 1 (slots above pos: masked).
        ring = state.ring
        ring.index_copy_(0, pos % window, kv)
        extra = extra_ready = picks = None
        if attn.compressor is not None:
            extra, extra_ready, picks = self._decode_compressed(
                layer_type, attn.compressor, state, x, q_res, pos, span, turn
            )
        # One softmax over raw and compressed keys (each with the position from which it is
        # visible) and the per-head sink logit (no value), the rope dims rotated back: [H, d].
        out = decode_attention(
            q, ring, steps[:window], extra, extra_ready, picks, attn.sinks, pos, dim**-0.5, turn
        )

        groups = cfg.o_groups
        o_a = attn.o_a_proj.weight.view(groups, cfg.o_lora_rank, -1)
        low = torch.bmm(out.view(groups, 1, -1), o_a.transpose(1, 2)).view(1, -1)  # heads are grouped
        return _linear(low, attn.o_b_proj)

    def _decode_compressed(
        self,
        layer_type: str,
        comp: _Compressor,
        state: LayerState,
        x: torch.Tensor,
        q_res: torch.Tensor,
        pos: torch.Tensor,
        span: int,
        turn: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Feed the token to the compressor(s) and return the compressed keys with the positions
        from which each is visible, the first span // rate rows [rows, d] and [rows], and which of
        them attention scores: HCA every one (None), CSA the indexer's picks [k] (indices: the
        attention kernel gathers the rows itself). (None, None, None) when the span holds no whole
        window."""
        cfg, steps = self.config, self._steps
        assert steps is not None
        assert state.entries is not None and state.compressor is not None
        rate = cfg.rate(layer_type)
        csa = layer_type == CSA
        # The compressor and the indexer's (CSA) share the window arithmetic: same rate, same rows.
        at = self._window_step(pos, rate, state.entries.shape[0], csa)
        self._decode_compress(comp, state.compressor, state.entries, x, at, csa)
        indexer = comp.indexer if csa else None
        if isinstance(indexer, _Indexer):
            assert state.index_entries is not None and state.indexer is not None
            self._decode_compress(indexer, state.indexer, state.index_entries, x, at, True)
        rows = span // rate
        if rows == 0:  # pos < span <= rate - 1: no window has closed yet
            return None, None, None
        # Entry w pools tokens up to (w + 1) rate - 1: visible from that token on.
        ready = steps[rate - 1 : rows * rate : rate]  # [rows]
        entries = state.entries[:rows]
        if isinstance(indexer, _Indexer):
            assert state.index_entries is not None
            picks = self._decode_index(indexer, state.index_entries[:rows], x, q_res, pos, turn, ready <= pos)
            return entries, ready, picks
        return entries, ready, None

    def _window_step(self, pos: torch.Tensor, rate: int, rows: int, overlap: bool) -> _WindowStep:
        steps = self._steps
        assert steps is not None
        if v4_compress_step.use_fused(pos):
            return _WindowStep(pos)  # the fused step derives its window from pos on the device
        slot = pos % rate  # [1]
        step = _WindowStep(pos, slot, (steps[:rate] == slot).unsqueeze(1), slot == rate - 1)
        if rows:
            # Closing implies pos // rate < rows; otherwise the clamped row is rewritten unchanged.
            step.window = torch.clamp(torch.div(pos, rate, rounding_mode="floor"), max=rows - 1)
            step.first = pos < rate if overlap else None
            cos, sin = self._tables["compress"]
            start = pos - slot  # window * rate (when clamped, the entry is not written)
            step.turn = _turn(cos.index_select(0, start), sin.index_select(0, start))
        return step

    def _decode_compress(
        self,
        comp: _Compressor,
        state: CompressorState,
        rows: torch.Tensor,
        x: torch.Tensor,
        at: _WindowStep,
        overlap: bool,
    ) -> None:
        """_compress for one token without branches: the entry of the window holding pos is pooled
        every step and written back unchanged unless pos closes it; the open window takes the token
        unless it closes (as _compress, which keeps only a closed window's first halves, for CSA).
        Fused (v4_compress_step): the two projections, then one op for all the rest."""
        if at.slot is None or at.here is None or at.closing is None:
            cos, sin = self._tables["compress"]
            v4_compress_step.compress_step(
                *v4_compress_step.projections(comp, x),
                comp.position_bias,
                comp.kv_norm.weight,
                state.kv,
                state.gate,
                state.prev_kv,
                state.prev_gate,
                rows,
                at.pos,
                cos,
                sin,
                self.config.rms_norm_eps,
            )
            return
        kv = (x @ comp.kv_proj.weight.t()).float()  # [1, width]
        bias = comp.position_bias.index_select(0, at.slot)
        gate = torch.add(bias, x @ comp.gate_proj.weight.t())  # float32, as the bias
        win_kv = torch.where(at.here, kv, state.kv)  # the window holding pos, pos included: [rate, width]
        win_gate = torch.where(at.here, gate, state.gate)
        closing = at.closing
        dim = win_kv.shape[-1] // 2
        if at.window is not None and at.turn is not None:  # some rows exist
            pool_kv, pool_gate = win_kv, win_gate
            if overlap:
                # Entry w pools window w-1's first halves with window w's second halves; window 0
                # has no predecessor (weight 0: its carried kv is finite, so 0 * kv adds nothing).
                assert state.prev_kv is not None and state.prev_gate is not None and at.first is not None
                prev_gate = torch.where(at.first, -math.inf, state.prev_gate)
                pool_kv = torch.cat([state.prev_kv, win_kv[:, dim:]])  # [2 rate, dim]
                pool_gate = torch.cat([prev_gate, win_gate[:, dim:]])
            # Softmax over the last dim: over dim 0 CUDA runs a kernel 10x slower for this shape.
            pooled = (pool_kv.t() * torch.softmax(pool_gate.t(), dim=-1)).sum(dim=-1).unsqueeze(0)
            entry = _norm_rope(pooled, comp.kv_norm.weight, self.config.rms_norm_eps, at.turn, rows.dtype)
            window = at.window
            rows.index_copy_(0, window, torch.where(closing, entry, rows.index_select(0, window)))
        # In place (out= the tensor it keeps): one kernel each, no copy.
        if overlap:
            assert state.prev_kv is not None and state.prev_gate is not None
            torch.where(closing, win_kv[:, :dim], state.prev_kv, out=state.prev_kv)
            torch.where(closing, win_gate[:, :dim], state.prev_gate, out=state.prev_gate)
        torch.where(closing, state.kv, win_kv, out=state.kv)
        torch.where(closing, state.gate, win_gate, out=state.gate)

    def _decode_index(
        self,
        indexer: _Indexer,
        keys: torch.Tensor,
        x: torch.Tensor,
        q_res: torch.Tensor,
        pos: torch.Tensor,
        turn: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """_index_select for one query over a fixed candidate count: the top min(index_topk, rows)
        by score [k], invisible candidates scored -inf (fewer visible than k: the rest are not,
        and attention masks them). `turn` is the compress table's rotation at `pos`."""
        cfg = self.config
        heads, dim = cfg.index_heads, cfg.index_head_dim
        q = _linear(q_res, indexer.q_b_proj).view(heads, dim)
        if v4_norm_rope.enabled(q):  # the rotation as one kernel, float32 out
            cos, sin = self._tables["compress"]
            q = norm_rope(q, None, None, cos, sin, pos, 2 * turn.shape[-1], torch.float32)  # [Hi, di]
        else:
            q = _rope_(q.float(), turn)  # [Hi, di]
        weights = _index_weights(x, indexer, heads, dim)  # [1, Hi]
        # The q·k products in the keys' dtype, summed in float32, as in prefill (_index_select).
        part = torch.relu_(torch.mm(q.to(keys.dtype), keys.t()).float())  # [Hi, rows]
        scores = torch.where(visible, torch.mm(weights, part), -math.inf)  # [1, rows]
        return scores.topk(min(cfg.index_topk, keys.shape[0]), dim=-1).indices.view(-1)

    def _decode_moe(self, moe: _Moe, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """_moe for one token without a host sync: the router is one op (v4_route), the picked
        experts are read by id on the device (packed FP4, or bf16 on the GEMV kernels), their
        outputs mixed in one op and the shared expert added in its down projection. Without those
        kernels the routed experts' weights are gathered by index (what scales to 256 experts), or,
        when the active experts are a large share of all (a gather is a copy plus a read of k
        experts), every expert runs and the unchosen ones weigh zero."""
        cfg = self.config
        gate = moe.gate
        tid2eid = getattr(gate, "tid2eid", None)
        bias = None if tid2eid is not None else gate.e_score_correction_bias
        picked, weights = v4_route.route(
            _linear(x, gate), bias, tid2eid, token, cfg.experts_per_token, cfg.routed_scaling_factor
        )  # [k], float32 [k]
        experts, limit = moe.experts, cfg.swiglu_limit
        if experts.gate_up_proj.dtype == torch.uint8:  # packed FP4: the kernel reads the picked experts
            gate_up = fp4_experts_gemv(x, picked, experts.gate_up_proj, experts.gate_up_proj_scale)
            # [k, D], the clamped SwiGLU of gate_up [k, 2I] taken inside the down projection.
            y = fp4_experts_gemv(gate_up, picked, experts.down_proj, experts.down_proj_scale, limit)
            return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))
        if decode_kernels.one_row(x, experts.gate_up_proj.flatten(0, 1)) and decode_kernels.fits(
            experts.down_proj.flatten(0, 1)
        ):
            # Only the picked experts' rows are read, and the clamped SwiGLU is the down
            # projection's input: two kernels.
            gate_up = x.new_empty((picked.numel(), experts.gate_up_proj.shape[1]))
            decode_kernels.experts_gemv(x, experts.gate_up_proj, picked, gate_up)
            y = x.new_empty((picked.numel(), experts.down_proj.shape[1]))
            decode_kernels.experts_gemv(gate_up, experts.down_proj, picked, y, limit)
            return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))
        dense = self.graph_dense_moe
        if dense is None:
            dense = cfg.num_experts <= 3 * cfg.experts_per_token
        vector = x.view(-1)
        if dense:
            gate_up, down = experts.gate_up_proj, experts.down_proj
            weights = x.new_zeros((cfg.num_experts,), dtype=torch.float32).scatter_(0, picked, weights)
        else:
            gate_up = experts.gate_up_proj.index_select(0, picked)  # [k, 2I, D]
            down = experts.down_proj.index_select(0, picked)  # [k, D, I]
        hidden = _swiglu(*torch.matmul(gate_up, vector).chunk(2, dim=-1), limit)  # [E or k, I]
        y = torch.bmm(down, hidden.unsqueeze(-1)).squeeze(-1)  # [E or k, D]
        return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))

    def _add_shared_expert(
        self, shared: _SharedExpert, x: torch.Tensor, routed: torch.Tensor
    ) -> torch.Tensor:
        """routed [1, D] plus the shared expert's output for x; on the GEMV kernels (bf16, or FP8 on
        the one-row FP8 kernel) three kernels, the SwiGLU and the sum inside the down projection."""
        limit = self.config.swiglu_limit
        gate, up, down = shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight
        if gate.dtype == torch.float8_e4m3fn:
            scales = [m.weight_scale_inv for m in (shared.gate_proj, shared.up_proj, shared.down_proj)]
            width = gate.shape[0]
            if (
                fp8_row_fits(x, gate, scales[0])
                and fp8_row_fits(x, up, scales[1])
                and fp8_row_fits(x, down, scales[2])
                and routed.is_contiguous()
                and routed.dtype == x.dtype
            ):
                gate_up = x.new_empty((1, 2 * width))
                fp8_row_(x, gate, scales[0], gate_up[:, :width])
                fp8_row_(x, up, scales[1], gate_up[:, width:])
                return fp8_row_(gate_up, down, scales[2], routed, swiglu_limit=limit, residual=True)
        if decode_kernels.one_row(x, gate) and decode_kernels.one_row(x, up) and decode_kernels.fits(down):
            width = gate.shape[0]
            gate_up = x.new_empty((1, 2 * width))
            decode_kernels.gemv(x, gate, gate_up[:, :width])
            decode_kernels.gemv(x, up, gate_up[:, width:])
            return decode_kernels.gemv_add_(routed, gate_up, down, None, silu=True, swiglu_limit=limit)
        return routed + _shared_expert(shared, x, limit)


@dataclass(slots=True)
class _WindowStep:
    """A decode step's place in its compression window (shared by a layer's compressors)."""

    pos: torch.Tensor  # [1]: the step's position (all that the fused compressor step reads)
    # The rest only for the eager step (None when v4_compress_step fuses it):
    slot: torch.Tensor | None = None  # [1]: pos mod rate
    here: torch.Tensor | None = None  # [rate, 1]: the open window's row that pos fills
    closing: torch.Tensor | None = None  # [1]: pos ends its window
    window: torch.Tensor | None = None  # [1]: the row of pos's window (clamped to the last); None: no rows
    first: torch.Tensor | None = None  # [1]: pos is in window 0 (CSA: the overlap's predecessor)
    turn: torch.Tensor | None = None  # [1, r / 2]: the rotation at the window's start


def _index_weights(x: torch.Tensor, indexer: _Indexer, heads: int, dim: int) -> torch.Tensor:
    """The indexer's per-head weights with both scales folded in, float32 [T, Hi]: the score is
    Σ_h w_h Hi^-½ ReLU(q_h · k) di^-½ = Σ_h (w_h Hi^-½ di^-½) ReLU(q_h · k)."""
    return decode_kernels.linear(x, indexer.scorer.weights_proj.weight).float() * (heads**-0.5 * dim**-0.5)


# --- math helpers --------------------------------------------------------------------------------


def _position(start: int, device: torch.device) -> torch.Tensor:
    """A chunk's first position as the int64 [1] device tensor norm_rope reads (a fill, no copy)."""
    return torch.full((1,), start, dtype=torch.int64, device=device)


def _hand_over(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What crosses into the next shard: a synchronous copy into that shard's own tensor, never an
    alias of one the previous shard may still write."""
    return x.to(device, non_blocking=False, copy=True)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm in float32; the (float32) weight multiplies before the cast to `dtype` (x's by
    default), as V4 keeps it. F.rms_norm is one fused kernel on CUDA (spelled out it is seven)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(dtype or x.dtype)


def _turn(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation e^{iφ} of each rotary pair (complex64 [.., r / 2]) from a table's rows."""
    return torch.complex(cos, sin)


def _norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    turn: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """_rms_norm then _rope_, both in float32, cast once at the end (to x's dtype by default)."""
    return _rope_(F.rms_norm(x.float(), (x.shape[-1],), weight, eps), turn).to(dtype or x.dtype)


def _rope_(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * turn.shape[-1] dims of x in interleaved pairs (2i, 2i + 1) by `turn`
    (see _turn; its conjugate rotates back), in float32 (one complex product), in place: x is
    always a fresh activation. Returns x."""
    dims = 2 * turn.shape[-1]
    rot = x[..., -dims:]
    pairs = torch.view_as_complex(rot.float().unflatten(-1, (-1, 2)))
    rot.copy_(torch.view_as_real(pairs * turn).flatten(-2))
    return x


def _hc_mix(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The hyper-connection projection of the RMS-normed flattened streams, float32 [T, rows], and
    the float32 streams [T, m, D] (which the collapse reuses)."""
    flat = streams.reshape(streams.shape[0], -1).float()
    mixed = torch.mm(F.rms_norm(flat, (flat.shape[-1],), None, eps), fn.t())
    return mixed, flat.view(streams.shape)


def _collapse(streams32: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_j pre_j X_j: the block input, float32 [T, D] (normed before it is cast: one rounding)."""
    return torch.bmm(pre.unsqueeze(1), streams32).squeeze(1)


def _expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k y + Σ_j C[j, k] X_j (Cᵀ X: C is not symmetric), as one batched product
    [Cᵀ | post] @ [X; y]."""
    mix = torch.cat([comb.transpose(1, 2), post.unsqueeze(-1)], dim=-1).to(streams.dtype)  # [T, m, m + 1]
    return torch.bmm(mix, torch.cat([streams, y.unsqueeze(1)], dim=1))


def _linear(x: torch.Tensor, holder: nn.Module) -> torch.Tensor:
    """x @ Wᵀ for a _Weight or an _Fp8Weight (which never leaves FP8: the kernel dequantizes)."""
    weight = holder.weight
    if weight.dtype == torch.float8_e4m3fn:
        return fp8_linear(x, weight, holder.weight_scale_inv)
    return decode_kernels.linear(x, weight)


def _shared_expert(shared: _SharedExpert, x: torch.Tensor, limit: float) -> torch.Tensor:
    act = _swiglu(_linear(x, shared.gate_proj), _linear(x, shared.up_proj), limit)
    return _linear(act, shared.down_proj)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, ±limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def build(
    config: dict[str, Any], family: str, dtype: torch.dtype, quantized: bool = False
) -> DeepseekV4Model:
    """The registry's entry point: the model for a config.json dict (`quantized`: FP8 / FP4 kept)."""
    return DeepseekV4Model(DeepseekV4Config.from_hf(config), dtype, quantized)
