"""The dense decoder family: Llama (and SmolLM2), Mistral, Qwen2, Qwen3.

One implementation covers all four; they differ only in a few switches that `DenseConfig.from_hf`
reads from the checkpoint's config.json:

- Qwen2 adds a bias to the q/k/v projections.
- Qwen3 RMS-normalises every query and key head (one weight per head dimension) before RoPE.
- Mistral (and Qwen when `use_sliding_window` is set) limits attention to a sliding window.

Parameter names equal Hugging Face's state-dict names, so a checkpoint loads by name. After
`materialize`, the q/k/v weights of a layer are views into one fused [q+k+v, hidden] tensor and
gate/up into one [2*ffn, hidden] tensor: the decode step then runs 2 matmuls instead of 5, with
no second copy of any weight. Keep that in mind: `Module.to()` or `load_state_dict(assign=True)`
would break the sharing; the loader copies into the existing parameters instead.

Shapes inside `forward` drop the batch dimension (batch is always 1): activations are [T, hidden].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.kernels.dense import decode_attention as fused_decode
from ds4desk.engine.kernels.dense import gemv as kernels
from ds4desk.engine.kernels.dense.silu_mul import silu_mul
from ds4desk.engine.models.registry import families_of
from ds4desk.engine.split import ShardPlan, check_placement, materialize_parameters

LogitsMode = Literal["none", "last", "all"]

# Hugging Face architecture name -> our family name, for the families this package runs.
DENSE_ARCHITECTURES = families_of("llama")

_ROPE_TYPES = ("default", "linear", "llama3")


def _fail(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def _positive_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise _fail(f"config.json has no '{key}'")
    # bool is an int subclass; a `true` here is a broken config, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(f"config.json '{key}' must be a positive integer, got {value!r}")
    return value


def _positive_float(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _fail(f"config.json '{key}' must be a positive number, got {value!r}")
    return float(value)


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
            raise _fail(f"config.json rope parameters must be an object, got {params!r}")
        merged = {"rope_theta": config.get("rope_theta", 10000.0), **params}
        theta = _positive_float(merged, "rope_theta", 10000.0)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise _fail(f"rope type '{kind}' is not supported; ds4desk runs: {', '.join(_ROPE_TYPES)}")
        if kind == "default":
            return cls(theta=theta)
        factor = _positive_float(params, "factor", 0.0) if "factor" in params else None
        if factor is None:
            raise _fail(f"rope type '{kind}' needs a 'factor'")
        if kind == "linear":
            return cls(theta=theta, kind=kind, factor=factor)
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise _fail(f"rope type 'llama3' needs '{key}'")
        low = _positive_float(params, "low_freq_factor", 1.0)
        high = _positive_float(params, "high_freq_factor", 4.0)
        if high <= low:
            raise _fail(f"rope 'high_freq_factor' ({high}) must be larger than 'low_freq_factor' ({low})")
        original = _positive_int(params, "original_max_position_embeddings")
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
            raise _fail("config.json is not a JSON object")
        if family is None:
            architectures = config.get("architectures") or []
            arch = architectures[0] if isinstance(architectures, list) and architectures else None
            family = DENSE_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
            if family is None:
                raise _fail(f"config.json architectures {architectures!r} is not a dense family ds4desk runs")
        if family not in DENSE_ARCHITECTURES.values():
            raise _fail(f"unknown dense family '{family}'")

        hidden = _positive_int(config, "hidden_size")
        heads = _positive_int(config, "num_attention_heads")
        kv_heads = _positive_int(config, "num_key_value_heads", heads)
        layers = _positive_int(config, "num_hidden_layers")
        if heads % kv_heads:
            raise _fail(
                f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        if config.get("head_dim") is None and hidden % heads:
            raise _fail(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
        head_dim = _positive_int(config, "head_dim", hidden // heads)
        if head_dim % 2:
            raise _fail(f"head_dim ({head_dim}) must be even for rotary embeddings")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise _fail(f"hidden_act '{act}' is not supported; the dense family uses 'silu'")
        partial = config.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise _fail(f"partial_rotary_factor {partial!r} is not supported")

        attention_bias = bool(config.get("attention_bias", False))
        if family == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v bias and never an o bias
        elif family == "mistral":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias

        return cls(
            family=family,
            vocab_size=_positive_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(config, "rms_norm_eps", 1e-6),
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
    window = _positive_int(config, "sliding_window")
    if family == "mistral":
        return (window,) * layers  # Mistral windows every layer whenever sliding_window is set
    if not config.get("use_sliding_window", False):
        return (None,) * layers  # Qwen configs carry a sliding_window they do not use
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    first = config.get("max_window_layers", 28)
    return tuple(window if i >= first else None for i in range(layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype) -> None:
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=cfg.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=cfg.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=b, dtype=dtype)
        self.up_proj = nn.Linear(h, f, bias=b, dtype=dtype)
        self.down_proj = nn.Linear(f, h, bias=b, dtype=dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # Set by _fuse: the tensors q/k/v and gate/up parameters are views of.
        self.fused: dict[str, torch.Tensor] | None = None


class Backbone(nn.Module):
    def __init__(self, cfg: DenseConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


@dataclass(slots=True)
class _LayerPlan:
    """The tensors one layer's forward touches, gathered once so the hot loop does no lookups.

    Weights are kept transposed (views, no copies) so the loop calls mm/addmm directly: that skips
    linear's dispatch layers and lets addmm fold the residual add into the projection.
    """

    ln1: torch.Tensor
    qkv_w_t: torch.Tensor  # [hidden, (H + 2 KV) * D]; q/k/v_proj.weight are views of the fused base
    qkv_b: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + KV, D]: q_norm for the query heads, k_norm for the key heads
    o_w_t: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gu_w_t: torch.Tensor  # [hidden, 2 * ffn]; gate/up_proj.weight are views of the fused base
    gu_b: torch.Tensor | None
    down_w_t: torch.Tensor
    down_b: torch.Tensor | None
    window: int | None
    kv_cache: torch.Tensor | None = None  # [2, KV, context, D]: keys then values
    keys: torch.Tensor | None = None  # [1, KV, context, D] views of kv_cache, shaped for SDPA
    values: torch.Tensor | None = None


@dataclass(slots=True)
class _DecodeBuffers:
    """Reused outputs for the one-token step, with their views made once: every torch call saved
    there counts, because after each weight-streaming matmul the caches are cold and even a view
    costs microseconds."""

    qkv: torch.Tensor  # [1, (H + 2 KV) D]
    qk: torch.Tensor  # [H + KV, D] view: queries and keys, rotated in place
    kv: torch.Tensor  # [2, KV, D] view: this position's keys and values, as the cache lays them out
    q: torch.Tensor  # [1, KV, G, D] view: queries grouped by the kv head they share
    gate_up: torch.Tensor  # [1, 2 F]
    gate: torch.Tensor  # [1, F] view
    up: torch.Tensor  # [1, F] view


@dataclass(slots=True)
class _Shard:
    """Consecutive layers on one device and what their loop reads there (ds4desk.engine.split):
    unsplit, the one shard holds every layer. Shards on one device share the tables and buffers."""

    device: torch.device
    plans: list[_LayerPlan]
    first: bool  # reads the embedding's output; a later shard gets the activation handed over
    cache: torch.Tensor | None = None  # [its layers, 2, KV, context, D]
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    half_swap: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    decode: _DecodeBuffers | None = None


def _on(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ids` where `weight` is: the caller's device may be another shard's."""
    return ids if ids.device == weight.device else ids.to(weight.device)


def _hand_over(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The activation crossing into the next shard: always a copy into that shard's own tensor
    (never an alias of one the previous shard may still write), synchronous so that the next
    device never reads a half-copied buffer."""
    return x.to(device, non_blocking=False, copy=True)


class DenseModel(nn.Module):
    """A dense decoder with a preallocated KV cache. Build it on the meta device, then
    `materialize(device)`, copy the checkpoint into its parameters, `finish_loading()`, and
    `allocate_cache(context)` before the first `forward`."""

    supports_graphs = True  # decode_graphable can be captured in a CUDA graph
    # Prefill attention through flash-style kernels (heads laid out for them) instead of the
    # kv-head-major layout that is fastest on the CPU. Set per device by finish_loading.
    fused_attention = False
    # RMSNorm as one F.rms_norm call, weight included: exact in float32; in bf16 on a GPU it is one
    # fused kernel instead of four (and rounds once instead of twice, a hair more precise than the
    # reference's cast-then-scale). Set by finish_loading.
    one_pass_norm = True
    # How decode_graphable attends: "triton" (a split-K kernel pair, models/decode_attention.py, where
    # it can run: NVIDIA CUDA with Triton; elsewhere the "matmul" math), "matmul" (baddbmm + softmax +
    # bmm) or "sdpa" (one fused call).
    decode_attention = "triton"

    def __init__(self, config: DenseConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = Backbone(config, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self._plans: list[_LayerPlan] = []
        self._cache: torch.Tensor | None = None
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None  # sign-folded: see allocate_cache
        self._inv_freq: torch.Tensor | None = None
        self._decode: _DecodeBuffers | None = None
        self._half_swap: torch.Tensor | None = None  # [D]: index d -> (d + D/2) mod D
        self._key_positions: torch.Tensor | None = None  # [context]: 0..context-1, for graph masks
        self._context = 0
        self._split: ShardPlan | None = None  # None: every layer on one device
        self._shards: list[_Shard] = []
        # A tied head on another device than the embedding (a split): the last shard's own copy.
        self._tied_head: torch.Tensor | None = None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context(self) -> int:
        """Positions the allocated cache holds (0 when none is allocated)."""
        return self._context

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def split(self) -> ShardPlan | None:
        """The layer split set by place(); None: every layer on `device`."""
        return self._split

    # --- loading -----------------------------------------------------------------------------

    def place(self, plan: ShardPlan) -> None:
        """Split the layers over the plan's devices; before materialize (which then ignores its
        device): layer i's weights and cache go to its shard's device, the embedding to the first,
        the final norm and head to the last."""
        check_placement(plan, self.config.num_layers, self.parameters())
        self._split = plan

    def materialize(self, device: torch.device) -> None:
        """Give every parameter real (uninitialised) storage on `device` (or where the split puts
        it), fusing q/k/v and gate/up."""
        split = self._split
        layer_devices = [device] * self.config.num_layers
        if split is not None:
            layer_devices = [torch.device(d) for d in split.layer_devices()]
        for layer, where in zip(self.model.layers, layer_devices, strict=True):
            _fuse(layer, where, self.dtype, empty=True)
        materialize_parameters(self, device, split)

    def finish_loading(self) -> None:
        """After the weights are in: derive rope frequencies and the per-layer plans."""
        cfg = self.config
        device = self.device
        self._inv_freq = cfg.rope.inverse_frequencies(cfg.head_dim, device)
        self.fused_attention = device.type == "cuda"
        self.one_pass_norm = self.dtype == torch.float32 or device.type == "cuda"
        self._plans = []
        for index, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if layer.fused is None:  # built without materialize
                _fuse(layer, layer.input_layernorm.weight.device, self.dtype, empty=False)
            fused = layer.fused
            assert fused is not None
            qk_norm = None
            if cfg.qk_norm:
                # One [H + KV, D] weight lets a single multiply scale the query and key heads together.
                qk_norm = torch.cat(
                    [
                        attn.q_norm.weight.expand(cfg.num_heads, -1),
                        attn.k_norm.weight.expand(cfg.num_kv_heads, -1),
                    ]
                )
            self._plans.append(
                _LayerPlan(
                    ln1=layer.input_layernorm.weight,
                    qkv_w_t=fused["qkv.weight"].t(),
                    qkv_b=fused.get("qkv.bias"),
                    qk_norm=qk_norm,
                    o_w_t=attn.o_proj.weight.t(),
                    o_b=attn.o_proj.bias,
                    ln2=layer.post_attention_layernorm.weight,
                    gu_w_t=fused["gate_up.weight"].t(),
                    gu_b=fused.get("gate_up.bias"),
                    down_w_t=mlp.down_proj.weight.t(),
                    down_b=mlp.down_proj.bias,
                    window=cfg.sliding_windows[index] if cfg.sliding_windows else None,
                )
            )
        bounds = self._split.bounds() if self._split is not None else [(0, cfg.num_layers)]
        self._shards = [
            _Shard(self._plans[start].ln1.device, self._plans[start:stop], index == 0)
            for index, (start, stop) in enumerate(bounds)
        ]
        last = self.model.norm.weight.device
        self._tied_head = None
        if cfg.tie_word_embeddings and last != device:
            self._tied_head = self.model.embed_tokens.weight.to(last, copy=True)
        if self._context:
            self.allocate_cache(self._context)

    # --- cache -------------------------------------------------------------------------------

    def allocate_cache(self, context: int) -> None:
        """Allocate the KV cache and rope tables for `context` positions (replacing any old cache)."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        if self._inv_freq is None:
            raise RuntimeError("allocate_cache before finish_loading")
        cfg = self.config
        self.free_cache()
        device = self.device
        # One block for every layer's keys and values (per shard): a single allocation, zeroed so
        # that no stale NaN can ever meet a mask.
        for shard in self._shards:
            shard.cache = torch.zeros(
                (len(shard.plans), 2, cfg.num_kv_heads, context, cfg.head_dim),
                device=shard.device,
                dtype=self.dtype,
            )
            for i, plan in enumerate(shard.plans):
                plan.kv_cache = shard.cache[i]
                plan.keys = shard.cache[i, 0].unsqueeze(0)
                plan.values = shard.cache[i, 1].unsqueeze(0)
        self._cache = self._shards[0].cache
        positions = torch.arange(context, device=device, dtype=torch.float32)
        angles = torch.outer(positions, self._inv_freq)  # [context, D/2], float32 like the reference
        half = cfg.head_dim // 2
        cos = angles.cos()
        sin = angles.sin()
        self._cos = torch.cat([cos, cos], dim=-1).to(self.dtype)
        # rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: folding the sign into the table turns
        # rotate_half's slice+neg+cat into one gather (index_select, the cheapest of the options).
        self._sin = torch.cat([-sin, sin], dim=-1).to(self.dtype)
        self._half_swap = torch.arange(cfg.head_dim, device=device).roll(half)
        self._key_positions = torch.arange(context, device=device)
        assert self._cos.shape[-1] == 2 * half
        self._decode = _decode_buffers(cfg, device, self.dtype)
        self._context = context
        # Another device's shards get copies of the first device's tables (computed once, so every
        # shard rotates by bit-identical angles) and their own decode buffers.
        tables = (self._cos, self._sin, self._half_swap, self._key_positions)
        per_device: dict[torch.device, tuple[tuple[torch.Tensor, ...], _DecodeBuffers]] = {
            device: (tables, self._decode)
        }
        for shard in self._shards:
            if shard.device not in per_device:
                copies = tuple(t.to(shard.device, copy=True) for t in tables)
                per_device[shard.device] = (copies, _decode_buffers(cfg, shard.device, self.dtype))
            copied_tables, shard.decode = per_device[shard.device]
            shard.cos, shard.sin, shard.half_swap, shard.key_positions = copied_tables

    def free_cache(self) -> None:
        self._cache = None
        self._cos = self._sin = None
        self._key_positions = None
        self._decode = None
        for plan in self._plans:
            plan.kv_cache = plan.keys = plan.values = None
        for shard in self._shards:
            shard.cache = shard.cos = shard.sin = shard.half_swap = shard.key_positions = None
            shard.decode = None
        self._context = 0

    def cache_bytes(self) -> int:
        return sum(s.cache.numel() * s.cache.element_size() for s in self._shards if s.cache is not None)

    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """What each layer's share of allocate_cache(context) takes (a split plan places it)."""
        return [self.cache_bytes_for(context) // self.config.num_layers] * self.config.num_layers

    def cache_bytes_for(self, context: int) -> int:
        """What allocate_cache(context) will take, before taking it."""
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return cfg.num_layers * 2 * cfg.num_kv_heads * context * cfg.head_dim * itemsize

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """Everything positions 0..length-1 left behind, as host tensors (a snapshot's payload)."""
        assert self._cache is not None
        if len(self._shards) == 1:
            return {"kv": self._cache[:, :, :, :length].to("cpu", copy=True)}
        # Every shard's part, in layer order: the same payload as the unsplit model's.
        parts = [shard.cache[:, :, :, :length].to("cpu") for shard in self._shards if shard.cache is not None]
        return {"kv": torch.cat(parts)}

    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state: attention never reads past `length`, so nothing else to reset."""
        assert self._cache is not None
        if len(self._shards) == 1:
            self._cache[:, :, :, :length].copy_(state["kv"])
            return
        start = 0
        for shard in self._shards:
            assert shard.cache is not None
            stop = start + shard.cache.shape[0]
            shard.cache[:, :, :, :length].copy_(state["kv"][start:stop])  # onto the shard's device
            start = stop

    # --- forward -----------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, writing their keys/values into the
        cache. Returns float32 logits: [V] for "last", [T, V] for "all", None for "none"."""
        cfg = self.config
        count = input_ids.shape[0]
        end = start_pos + count
        if self._cos is None or self._sin is None:
            raise RuntimeError("forward before allocate_cache")
        if start_pos < 0 or count == 0 or end > self._context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW,
                f"positions {start_pos}..{end - 1} do not fit a context of {self._context}",
            )
        x = self._decode_step(input_ids, start_pos) if count == 1 else self._prefill(input_ids, start_pos)
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        x = _rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps, self.one_pass_norm)
        out = torch.mm(x, self._head().t()).float()
        if out.device != input_ids.device:  # split: the logits come back to where the ids came from
            out = out.to(input_ids.device)
        return out[0] if logits == "last" else out

    def _head(self) -> torch.Tensor:
        if self._tied_head is not None:
            return self._tied_head
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def decode_graphable(self, token: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One decode step whose shapes depend on `span` only, so a CUDA graph can replay it.

        `token` and `pos` are int64 [1] device tensors (the graph's inputs); attention reads the
        first `span` cache rows (pos < span <= context) under a mask, because the number of valid
        rows must not be a shape. Returns float32 logits [V], like forward(token, pos, "last").
        """
        carry: tuple[torch.Tensor, ...] = (token, pos)
        for index, device in enumerate(self.decode_devices()):
            if index:
                carry = tuple(_hand_over(t, device) for t in carry)
            carry = self.decode_shard(index, carry, span)
        logits = carry[0]
        return logits if logits.device == token.device else logits.to(token.device)

    def decode_devices(self) -> list[torch.device]:
        """The device of every shard a decode step runs through, in order (one when unsplit)."""
        return [shard.device for shard in self._shards]

    def decode_shard(
        self, index: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `index`'s part of decode_graphable, all on its own device (so each shard can be a
        graph of its own): the first shard takes (token, pos), every later one the previous one's
        (hidden, pos) copied to its device; the last returns (logits,), the others (hidden, pos)."""
        cfg = self.config
        assert self._cos is not None and self._sin is not None and self._key_positions is not None
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        eps = cfg.rms_norm_eps
        exact = self.one_pass_norm
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width = heads * dim
        qk_width = (heads + kv_heads) * dim
        scale = dim**-0.5
        shard = self._shards[index]
        if index == 0:
            token, here = inputs
            x = F.embedding(token, self.model.embed_tokens.weight)  # [1, hidden]
        else:
            x, here = inputs
        fused = self.decode_attention == "triton" and fused_decode.available(shard.device)
        if fused and self._kernels_fit(shard):
            return self._decode_shard_kernels(index, shard, x, here, span)
        cos_table, sin_table, keys_at = shard.cos, shard.sin, shard.key_positions
        assert cos_table is not None and sin_table is not None and keys_at is not None
        cos, sin = cos_table.index_select(0, here), sin_table.index_select(0, here)  # [1, D]
        keys_at = keys_at[:span]
        biases: dict[int | None, torch.Tensor] = {}  # 0 where a key may be read, -inf elsewhere
        windows = set() if fused else {plan.window for plan in shard.plans}  # the kernel masks itself
        for window in windows:
            allowed = keys_at <= here
            if window is not None:
                allowed = allowed & (keys_at > here - window)
            bias = torch.zeros(span, dtype=self.dtype, device=keys_at.device).masked_fill_(
                ~allowed, -torch.inf
            )
            biases[window] = bias.expand(kv_heads, heads // kv_heads, span)

        for plan in shard.plans:
            assert plan.kv_cache is not None and plan.keys is not None and plan.values is not None
            h = _rms_norm(x, plan.ln1, eps, exact)
            qkv = _project(h, plan.qkv_w_t, plan.qkv_b)
            qk = qkv[0, :qk_width].view(heads + kv_heads, dim)
            src = qk if plan.qk_norm is None else _rms_norm(qk, None, eps, exact) * plan.qk_norm
            torch.addcmul(src * cos, torch.index_select(src, 1, shard.half_swap), sin, out=qk)
            plan.kv_cache.index_copy_(2, here, qkv[0, q_width:].view(2, kv_heads, 1, dim))
            if fused:  # the kernel masks by `here` itself, on the device
                q = qkv[0, :q_width].view(kv_heads, heads // kv_heads, dim)
                attn = fused_decode.decode_attention(
                    q, plan.keys[0, :, :span], plan.values[0, :, :span], here, scale, plan.window
                )
            elif self.decode_attention == "sdpa":
                q = qkv[0, :q_width].view(1, kv_heads, heads // kv_heads, dim)
                attn = F.scaled_dot_product_attention(
                    q, plan.keys[:, :, :span], plan.values[:, :, :span], attn_mask=biases[plan.window]
                )
            else:
                # Two batched matmuls over the span: a fused attention kernel gives each kv head
                # one thread block, which leaves most of the GPU idle on a long cache.
                q = qkv[0, :q_width].view(kv_heads, heads // kv_heads, dim)
                scores = torch.baddbmm(
                    biases[plan.window], q, plan.keys[0, :, :span].transpose(1, 2), alpha=scale
                )  # [KV, G, span]
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                attn = torch.bmm(probs, plan.values[0, :, :span])  # [KV, G, D]
            x = torch.addmm(x, attn.reshape(1, q_width), plan.o_w_t)
            if plan.o_b is not None:
                x = x + plan.o_b
            h = _rms_norm(x, plan.ln2, eps, exact)
            gate_up = _project(h, plan.gu_w_t, plan.gu_b)
            width = gate_up.shape[1] // 2
            x = torch.addmm(x, F.silu(gate_up[:, :width]) * gate_up[:, width:], plan.down_w_t)
            if plan.down_b is not None:
                x = x + plan.down_b
        if index + 1 < len(self._shards):
            return x, here
        x = _rms_norm(x, self.model.norm.weight, eps, exact)
        return (torch.mm(x, self._head().t()).float()[0],)

    def _kernels_fit(self, shard: _Shard) -> bool:
        """Whether the shard's graphed step can run on decode_kernels (see there)."""
        if not kernels.available(shard.device) or not kernels.fits_heads(self.config.head_dim):
            return False
        weights = [self._head()] if shard is self._shards[-1] else []
        for plan in shard.plans:
            weights += [plan.qkv_w_t.t(), plan.o_w_t.t(), plan.gu_w_t.t(), plan.down_w_t.t()]
        return all(kernels.fits(w) for w in weights)

    def _decode_shard_kernels(
        self, index: int, shard: _Shard, x: torch.Tensor, here: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, ...]:
        """decode_shard on the fused kernels: seven a layer (norm+qkv, rope+cache write, attention
        pair, o + residual, norm+gate/up, SiLU·up + down + residual)."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width = heads * dim
        buffers, cos, sin = shard.decode, shard.cos, shard.sin
        assert buffers is not None and cos is not None and sin is not None
        if index:
            x = x.clone()  # the residual is updated in place: never in the graph's input buffer
        for plan in shard.plans:
            assert plan.kv_cache is not None and plan.keys is not None and plan.values is not None
            kernels.norm_gemv(x, plan.ln1, plan.qkv_w_t.t(), plan.qkv_b, eps, out=buffers.qkv)
            kernels.rope_write(buffers.qkv, cos, sin, here, plan.kv_cache, heads, plan.qk_norm, eps)
            q = buffers.qkv[0, :q_width].view(kv_heads, heads // kv_heads, dim)
            attn = fused_decode.decode_attention(
                q, plan.keys[0, :, :span], plan.values[0, :, :span], here, dim**-0.5, plan.window
            )
            kernels.gemv_add_(x, attn.view(1, q_width), plan.o_w_t.t(), plan.o_b, silu=False)
            kernels.norm_gemv(x, plan.ln2, plan.gu_w_t.t(), plan.gu_b, eps, out=buffers.gate_up)
            kernels.gemv_add_(x, buffers.gate_up, plan.down_w_t.t(), plan.down_b, silu=True)
        if index + 1 < len(self._shards):
            return x, here
        head = self._head()
        logits = torch.empty((1, head.shape[0]), device=x.device, dtype=torch.float32)
        return (kernels.norm_gemv(x, self.model.norm.weight, head, None, eps, out=logits)[0],)

    def _decode_step(self, input_ids: torch.Tensor, pos: int) -> torch.Tensor:
        """One token through every layer; returns the final hidden state [1, hidden] (unnormed).

        The same math as _prefill with T = 1, in as few torch calls as possible: outputs go into
        the preallocated buffers, whose views were made once, and no mask is needed.
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        exact = self.one_pass_norm
        q_width = cfg.num_heads * cfg.head_dim
        end = pos + 1

        embed = self.model.embed_tokens.weight
        x = F.embedding(_on(input_ids, embed), embed)  # [1, hidden]
        for shard in self._shards:
            if not shard.first:
                x = _hand_over(x, shard.device)
            buffers, cos, sin, swap = shard.decode, shard.cos, shard.sin, shard.half_swap
            assert buffers is not None and cos is not None and sin is not None and swap is not None
            qkv, qk, kv, q = buffers.qkv, buffers.qk, buffers.kv, buffers.q
            gate_up, gate, up = buffers.gate_up, buffers.gate, buffers.up
            cos, sin = cos[pos], sin[pos]  # [D], broadcast over the heads
            for plan in shard.plans:
                h = _rms_norm(x, plan.ln1, eps, exact)
                if plan.qkv_b is None:
                    torch.mm(h, plan.qkv_w_t, out=qkv)
                else:
                    torch.addmm(plan.qkv_b, h, plan.qkv_w_t, out=qkv)
                src = qk if plan.qk_norm is None else _rms_norm(qk, None, eps, exact) * plan.qk_norm
                torch.addcmul(src * cos, torch.index_select(src, 1, swap), sin, out=qk)
                assert plan.kv_cache is not None and plan.keys is not None and plan.values is not None
                plan.kv_cache.select(2, pos).copy_(kv)
                low = 0 if plan.window is None else max(0, end - plan.window)
                attn = F.scaled_dot_product_attention(
                    q, plan.keys.narrow(2, low, end - low), plan.values.narrow(2, low, end - low)
                )
                # reshape: a view on CPU; GPU kernels may hand back a [1, G, KV, D] memory layout.
                x = torch.addmm(x, attn.reshape(1, q_width), plan.o_w_t)  # the residual add rides along
                if plan.o_b is not None:
                    x.add_(plan.o_b)

                h = _rms_norm(x, plan.ln2, eps, exact)
                if plan.gu_b is None:
                    torch.mm(h, plan.gu_w_t, out=gate_up)
                else:
                    torch.addmm(plan.gu_b, h, plan.gu_w_t, out=gate_up)
                x = torch.addmm(x, F.silu(gate, inplace=True).mul_(up), plan.down_w_t)
                if plan.down_b is not None:
                    x.add_(plan.down_b)
        return x

    def _prefill(self, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """T > 1 tokens through every layer; returns the final hidden states [T, hidden] (unnormed)."""
        cfg = self.config
        count = input_ids.shape[0]
        end = start_pos + count
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        q_width = heads * dim
        qk_width = (heads + kv_heads) * dim
        eps = cfg.rms_norm_eps
        exact = self.one_pass_norm

        embed = self.model.embed_tokens.weight
        x = F.embedding(_on(input_ids, embed), embed)  # [T, hidden]
        for shard in self._shards:
            if not shard.first:
                x = _hand_over(x, shard.device)
            assert shard.cos is not None and shard.sin is not None and shard.half_swap is not None
            cos = shard.cos[start_pos:end].unsqueeze(1)  # [T, 1, D]
            sin = shard.sin[start_pos:end].unsqueeze(1)
            masks: dict[int | None, torch.Tensor | None] = {}

            for plan in shard.plans:
                kv_cache, all_keys, all_values = plan.kv_cache, plan.keys, plan.values
                assert kv_cache is not None and all_keys is not None and all_values is not None
                h = _rms_norm(x, plan.ln1, eps, exact)
                if plan.qkv_b is None:
                    qkv = torch.mm(h, plan.qkv_w_t)  # [T, (H + 2 KV) D]
                else:
                    qkv = torch.addmm(plan.qkv_b, h, plan.qkv_w_t)
                qk = qkv[:, :qk_width].view(count, heads + kv_heads, dim)
                rotated = qk if plan.qk_norm is None else _rms_norm(qk, None, eps, exact) * plan.qk_norm
                # RoPE on queries and keys at once (HF's rotate_half convention, see allocate_cache),
                # written back into qkv so keys and values reach the cache in one copy.
                torch.addcmul(rotated * cos, torch.index_select(rotated, 2, shard.half_swap), sin, out=qk)
                kv_cache[:, :, start_pos:end].copy_(
                    qkv[:, q_width:].view(count, 2, kv_heads, dim).permute(1, 2, 0, 3)
                )

                if self.fused_attention and plan.window is None:
                    attn = _causal_attention(qkv[:, :q_width], all_keys, all_values, start_pos, group)
                else:
                    # GQA without copying keys: the `group` query heads that share one kv head become
                    # group * T query rows of that kv head, so SDPA's batch dimension is the kv head.
                    q = qkv[:, :q_width].reshape(count, kv_heads, group, dim).permute(1, 2, 0, 3)
                    q = q.reshape(1, kv_heads, group * count, dim)
                    mask = masks.get(plan.window)
                    if mask is None:
                        mask = masks[plan.window] = _causal_mask(
                            start_pos, count, group, plan.window, x.device
                        )
                    attn = F.scaled_dot_product_attention(
                        q, all_keys[:, :, :end], all_values[:, :, :end], attn_mask=mask
                    )  # [1, KV, G * T, D]
                    attn = attn.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, q_width)
                x = torch.addmm(x, attn, plan.o_w_t)  # the residual add rides along
                if plan.o_b is not None:
                    x.add_(plan.o_b)

                h = _rms_norm(x, plan.ln2, eps, exact)
                if plan.gu_b is None:
                    gate_up = torch.mm(h, plan.gu_w_t)
                else:
                    gate_up = torch.addmm(plan.gu_b, h, plan.gu_w_t)
                x = torch.addmm(x, silu_mul(gate_up), plan.down_w_t)
                if plan.down_b is not None:
                    x.add_(plan.down_b)
        return x


def _decode_buffers(cfg: DenseConfig, device: torch.device, dtype: torch.dtype) -> _DecodeBuffers:
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.empty((1, (heads + 2 * kv_heads) * dim), device=device, dtype=dtype)
    gate_up = torch.empty((1, 2 * cfg.intermediate_size), device=device, dtype=dtype)
    return _DecodeBuffers(
        qkv=qkv,
        qk=qkv[0, : (heads + kv_heads) * dim].view(heads + kv_heads, dim),
        kv=qkv[0, heads * dim :].view(2, kv_heads, dim),
        q=qkv[0, : heads * dim].view(1, kv_heads, heads // kv_heads, dim),
        gate_up=gate_up,
        gate=gate_up[:, : cfg.intermediate_size],
        up=gate_up[:, cfg.intermediate_size :],
    )


def _project(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, exact: bool) -> torch.Tensor:
    """RMSNorm computed in float32; the weight multiplies after the cast back (as the reference)."""
    if exact:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed if weight is None else normed * weight


def _causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, group: int
) -> torch.Tensor:
    """Causal attention of T queries [T, H * D] at positions start.. over cache rows 0..start+T-1,
    shaped so SDPA can pick a flash kernel: heads as the head dimension (kv heads repeated, a small
    copy next to the matmuls) and the causal mask as a flag (aligned to the last key when a chunk
    follows earlier ones), never as a materialised [T, L] tensor. Returns [T, H * D]."""
    count = q.shape[0]
    end = start + count
    heads = keys.shape[1] * group
    q = q.view(count, heads, -1).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    keys = keys[:, :, :end].repeat_interleave(group, dim=1)
    values = values[:, :, :end].repeat_interleave(group, dim=1)
    if start == 0:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(count, end))
    return out[0].transpose(0, 1).reshape(count, -1)


def _causal_mask(
    start: int, count: int, group: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Bool [G*T, start+T] mask (True = attend) for queries laid out kv-head-major as in forward."""
    query_pos = torch.arange(start, start + count, device=device).unsqueeze(1)
    key_pos = torch.arange(start + count, device=device).unsqueeze(0)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed.repeat(group, 1)


def _fuse(layer: DecoderLayer, device: torch.device, dtype: torch.dtype, empty: bool) -> None:
    """Point q/k/v (and gate/up) weights and biases at consecutive row ranges of one tensor each.

    `empty`: allocate fresh storage (the loader fills it); otherwise keep the current values.
    The fused tensors live in `layer.fused`, a plain dict, so they never show up in state_dict.
    """
    attn, mlp = layer.self_attn, layer.mlp
    fused: dict[str, torch.Tensor] = {}
    groups = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "gate_up": [mlp.gate_proj, mlp.up_proj]}
    for key, parts in groups.items():
        for attr in ("weight", "bias"):
            current = [getattr(part, attr) for part in parts]
            if current[0] is None:
                continue
            if empty:
                rows = sum(c.shape[0] for c in current)
                storage = torch.empty((rows, *current[0].shape[1:]), device=device, dtype=dtype)
            else:
                storage = torch.cat([c.detach() for c in current])
            start = 0
            for part, c in zip(parts, current, strict=True):
                stop = start + c.shape[0]
                setattr(part, attr, nn.Parameter(storage[start:stop], requires_grad=False))
                start = stop
            fused[f"{key}.{attr}"] = storage
    layer.fused = fused


def build(config: dict[str, Any], family: str, dtype: torch.dtype, quantized: bool = False) -> DenseModel:
    """The registry's entry point: `family`'s model for a config.json dict."""
    if quantized:
        raise _fail(f"the {family} family does not keep weights quantized")
    return DenseModel(DenseConfig.from_hf(config, family), dtype)
