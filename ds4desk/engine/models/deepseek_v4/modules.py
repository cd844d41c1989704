"""DeepSeek-V4's parameters: `nn.Module`s that only hold weights, named as transformers'
DeepseekV4ForCausalLM names them, so a checkpoint in that layout loads by name. The math that uses
them lives in the model's mixins (attention.py, moe.py, hyper.py, decode.py) and ops.py."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ds4desk.engine.formats import FP4_BLOCK, FP8_BLOCK, gguf_packed_bytes
from ds4desk.engine.models.base import load_failure
from ds4desk.engine.models.deepseek_v4.config import CSA, HASH_MOE, SLIDING, DeepseekV4Config
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Weight(nn.Module):
    """A `.weight` holder: linear layers and norms (the math lives in ops.py and the mixins)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(shape, dtype)


class Fp8Weight(nn.Module):
    """A linear weight kept in FP8 e4m3 with a float32 multiplier per 128 x 128 block (the format
    DeepSeek's official checkpoints store these linears in): half the bytes of bf16 per decode
    step, and Hopper's FP8 matrix units for prefill (kernels/quant/fp8.fp8_linear)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        rows, cols = shape
        self.weight = _param(shape, torch.float8_e4m3fn)
        self.weight_scale_inv = _param((-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), torch.float32)


def linear_weight(
    shape: tuple[int, int],
    dtype: torch.dtype,
    fp8: bool,
    packed: Mapping[str, int] | None = None,
    name: str = "",
) -> nn.Module:
    """The holder of linear weight `name`: the GGUF's blocks where `packed` (a GGUF's block types,
    parameter name -> GGML type id) holds it (models/packed.PackedLinear: ops.linear multiplies the
    blocks, nothing is dequantized), else FP8 (`fp8`) or `dtype`."""
    type_id = (packed or {}).get(f"{name}.weight")
    if type_id is not None:
        rows, cols = shape
        return PackedLinear(cols, rows, type_id)
    return Fp8Weight(shape) if fp8 else Weight(shape, dtype)


def _joinable(holders: tuple[nn.Module, ...]) -> tuple[str, ...]:
    """The tensors join_rows joins for these linears of one input width: the weights, and FP8
    scales where every weight's rows are whole 128-row blocks (so the scale rows split where the
    weight rows do); none for a GGUF's blocks (their own kernels) or a mix of kinds."""
    first = holders[0]
    if any(type(h) is not type(first) or h.weight.dtype != first.weight.dtype for h in holders):
        return ()
    if isinstance(first, PackedLinear):
        return ()
    if isinstance(first, Fp8Weight):
        whole = all(h.weight.shape[0] % FP8_BLOCK == 0 for h in holders)
        return ("weight", "weight_scale_inv") if whole else ()
    return ("weight",)


def join_rows(*holders: nn.Module) -> tuple[torch.Tensor, ...]:
    """Point the tensors of linears that read one input at consecutive rows of one new tensor each
    (the weight, then an FP8 scale), which a decode step multiplies once; returns those tensors, or
    () where they cannot join. For the model's materialize: the contents are undefined until the
    loader copies the weights in (in place)."""
    joined_tensors = []
    for name in _joinable(holders):
        parts = [getattr(h, name) for h in holders]
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        both = torch.empty(shape, device=parts[0].device, dtype=parts[0].dtype)
        start = 0
        for holder, part in zip(holders, parts, strict=True):
            view = both[start : start + part.shape[0]]
            setattr(holder, name, nn.Parameter(view, requires_grad=False))
            start += part.shape[0]
        joined_tensors.append(both)
    return tuple(joined_tensors)


def joined(tensors: tuple[torch.Tensor, ...], *holders: nn.Module) -> tuple[torch.Tensor, ...]:
    """join_rows' tensors where the holders' tensors are still their consecutive rows (nothing has
    replaced them since, as moving a module to another device does); else ()."""
    names = _joinable(holders)
    if not names or len(tensors) != len(names):
        return ()
    for both, name in zip(tensors, names, strict=True):
        at = both.data_ptr()
        for holder in holders:
            part = getattr(holder, name)
            if part.data_ptr() != at:
                return ()
            at += part.numel() * part.element_size()
    return tensors


class HyperConnection(nn.Module):
    """A hyper-connection site's weights: `fn` maps the normed streams to pre, post and comb."""

    def __init__(self, mult: int, hidden: int) -> None:
        super().__init__()
        rows = (2 + mult) * mult  # pre (m) | post (m) | comb (m x m)
        self.fn = _param((rows, mult * hidden), torch.float32)
        self.base = _param((rows,), torch.float32)
        self.scale = _param((3,), torch.float32)


class HyperHead(nn.Module):
    """The final collapse of the streams before the norm and the head (pre weights only)."""

    def __init__(self, mult: int, hidden: int) -> None:
        super().__init__()
        self.hc_fn = _param((mult, mult * hidden), torch.float32)
        self.hc_base = _param((mult,), torch.float32)
        self.hc_scale = _param((1,), torch.float32)


class Compressor(nn.Module):
    """Gated pooling of `rate` tokens into one entry of `dim`; `overlap` (CSA) doubles the width:
    each token feeds the next window (first half) and its own (second half)."""

    def __init__(
        self,
        hidden: int,
        dim: int,
        rate: int,
        overlap: bool,
        dtype: torch.dtype,
        packed: Mapping[str, int] | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.kv_proj = linear_weight((width, hidden), dtype, False, packed, f"{prefix}.kv_proj")
        self.gate_proj = linear_weight((width, hidden), dtype, False, packed, f"{prefix}.gate_proj")
        self.position_bias = _param((rate, width), torch.float32)
        self.kv_norm = Weight((dim,), torch.float32)


class Scorer(nn.Module):
    """The indexer's per-head weights of a query token."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = Weight((heads, hidden), dtype)


class Indexer(Compressor):
    """CSA's lightning indexer: a compressor of its own keys plus a low-rank multi-head query."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        dtype: torch.dtype,
        fp8: bool,
        packed: Mapping[str, int] | None,
        prefix: str,
    ) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, dtype, packed, prefix)
        shape = (cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank)
        self.q_b_proj = linear_weight(shape, dtype, fp8, packed, f"{prefix}.q_b_proj")
        self.scorer = Scorer(cfg.hidden_size, cfg.index_heads, dtype)


class Attention(nn.Module):
    """One layer's attention; CSA / HCA layers add a compressor (CSA's with an indexer)."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer_type: str,
        dtype: torch.dtype,
        fp8: bool,
        packed: Mapping[str, int] | None = None,
        prefix: str = "",
    ) -> None:
        """`packed`, `prefix`: see linear_weight; the prefix is the module's own (`...self_attn`)."""
        super().__init__()
        hidden, heads, dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.q_a_proj = linear_weight((cfg.q_lora_rank, hidden), dtype, fp8, packed, f"{prefix}.q_a_proj")
        self.q_a_norm = Weight((cfg.q_lora_rank,), torch.float32)
        q_b = (heads * dim, cfg.q_lora_rank)
        self.q_b_proj = linear_weight(q_b, dtype, fp8, packed, f"{prefix}.q_b_proj")
        self.kv_proj = linear_weight((dim, hidden), dtype, fp8, packed, f"{prefix}.kv_proj")
        self.kv_norm = Weight((dim,), torch.float32)
        # Grouped (ops.grouped_low_rank); FP8 as the official checkpoint stores it (the official
        # inference converter widens it to bf16, twice the bytes a decode step reads).
        o_a = (cfg.o_groups * cfg.o_lora_rank, heads * dim // cfg.o_groups)
        self.o_a_proj = linear_weight(o_a, dtype, fp8, packed, f"{prefix}.o_a_proj")
        o_rank = cfg.o_groups * cfg.o_lora_rank
        self.o_b_proj = linear_weight((hidden, o_rank), dtype, fp8, packed, f"{prefix}.o_b_proj")
        self.sinks = _param((heads,), torch.float32)
        self._q_a_kv: tuple[torch.Tensor, ...] = ()
        self.compressor: Compressor | None = None
        if layer_type != SLIDING:
            compressor = f"{prefix}.compressor"
            self.compressor = Compressor(
                hidden, dim, cfg.rate(layer_type), layer_type == CSA, dtype, packed, compressor
            )
            if layer_type == CSA:
                self.compressor.indexer = Indexer(cfg, dtype, fp8, packed, f"{compressor}.indexer")

    def join_q_a_kv(self) -> None:
        """q_a_proj and kv_proj (both read the normed input) as consecutive rows of one tensor
        (join_rows): a decode step runs one GEMV for both (q_a_kv)."""
        self._q_a_kv = join_rows(self.q_a_proj, self.kv_proj)

    def q_a_kv(self) -> tuple[torch.Tensor, ...]:
        """q_a | kv as one weight (and an FP8 pair's scale): see joined."""
        return joined(self._q_a_kv, self.q_a_proj, self.kv_proj)


class Router(nn.Module):
    """The MoE gate: expert scores, and a token-id table (hash layers) or a selection bias."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param((cfg.num_experts, cfg.hidden_size), dtype)
        if hashed:
            # token id -> its experts; validated at finish_loading.
            self.tid2eid = _param((cfg.vocab_size, cfg.experts_per_token), torch.int64)
        else:
            # Added to the scores for choosing experts only, never to their weights.
            self.e_score_correction_bias = _param((cfg.num_experts,), torch.float32)


class Experts(nn.Module):
    """Every routed expert's SwiGLU weights, stacked: bf16 (or `dtype`), or packed FP4; from a GGUF
    (cfg.gguf_experts) gate, up and down stacked apart, each in its GGUF block type (`packed`: the
    stacked tensor's name -> GGML type id) or, where the file stores floats, in `dtype`."""

    # GGUF layout: projection -> GGML type id of its stacked weight, -1 for floats.
    type_ids: dict[str, int]

    def __init__(
        self,
        cfg: DeepseekV4Config,
        dtype: torch.dtype,
        fp4: bool,
        packed: Mapping[str, int] | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        experts, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.expert_size
        self.type_ids = {}
        if cfg.gguf_experts:
            # [experts, rows, columns] each, expert after expert, as the file stacks them.
            for name, rows, cols in (
                ("gate_proj", width, hidden),
                ("up_proj", width, hidden),
                ("down_proj", hidden, width),
            ):
                type_id = (packed or {}).get(f"{prefix}.{name}", -1)
                self.type_ids[name] = type_id
                if type_id < 0:
                    setattr(self, name, _param((experts, rows, cols), dtype))
                else:
                    setattr(
                        self, name, _param((experts, rows, gguf_packed_bytes(type_id, (cols,))), torch.uint8)
                    )
            return
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


class SharedExpert(nn.Module):
    """The expert every token goes through (its linears FP8 when quantized)."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        dtype: torch.dtype,
        fp8: bool,
        packed: Mapping[str, int] | None,
        prefix: str,
    ) -> None:
        super().__init__()
        inner, outer = (cfg.expert_size, cfg.hidden_size), (cfg.hidden_size, cfg.expert_size)
        self.gate_proj = linear_weight(inner, dtype, fp8, packed, f"{prefix}.gate_proj")
        self.up_proj = linear_weight(inner, dtype, fp8, packed, f"{prefix}.up_proj")
        self.down_proj = linear_weight(outer, dtype, fp8, packed, f"{prefix}.down_proj")
        self._gate_up: tuple[torch.Tensor, ...] = ()

    def join_gate_up(self) -> None:
        """gate_proj and up_proj as the row halves of one tensor (join_rows): a decode step runs one
        GEMV for both (gate_up)."""
        self._gate_up = join_rows(self.gate_proj, self.up_proj)

    def gate_up(self) -> tuple[torch.Tensor, ...]:
        """gate | up as one weight (and an FP8 pair's scale): see joined."""
        return joined(self._gate_up, self.gate_proj, self.up_proj)


class Moe(nn.Module):
    """One layer's FFN: router, routed experts and the shared expert."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        hashed: bool,
        dtype: torch.dtype,
        quantized: bool,
        packed: Mapping[str, int] | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.gate = Router(cfg, hashed, dtype)
        self.experts = Experts(cfg, dtype, quantized, packed, f"{prefix}.experts")
        self.shared_experts = SharedExpert(cfg, dtype, quantized, packed, f"{prefix}.shared_experts")


class Layer(nn.Module):
    """One decoder layer: attention and MoE, each with its norm and hyper-connection site.
    `kinds`: (attention kind, FFN kind), by default the config's for layer `index`."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        index: int,
        dtype: torch.dtype,
        quantized: bool,
        kinds: tuple[str, str] | None = None,
        packed: Mapping[str, int] | None = None,
        prefix: str | None = None,
    ) -> None:
        """`packed`: the weights a GGUF stores in block types (name -> GGML type id); of those, the
        routed experts and the linears (attention's, the compressors', the indexer's query, the
        shared expert's) stay packed, the rest are built as floats (the loader dequantizes them).
        `prefix`: the layer's parameter names' (`model.layers.N` by default)."""
        super().__init__()
        layer_type, mlp_type = kinds or (cfg.layer_types[index], cfg.mlp_layer_types[index])
        prefix = prefix or f"model.layers.{index}"
        self.self_attn = Attention(cfg, layer_type, dtype, quantized, packed, f"{prefix}.self_attn")
        self.mlp = Moe(cfg, mlp_type == HASH_MOE, dtype, quantized, packed, f"{prefix}.mlp")
        self.input_layernorm = Weight((cfg.hidden_size,), torch.float32)
        self.post_attention_layernorm = Weight((cfg.hidden_size,), torch.float32)
        self.attn_hc = HyperConnection(cfg.hc_mult, cfg.hidden_size)
        self.ffn_hc = HyperConnection(cfg.hc_mult, cfg.hidden_size)


class MtpBlock(Layer):
    """A multi-token-prediction block as the official release stores it: a full layer, plus the
    projections that mix the next token's (normed) embedding into the main model's (normed) streams,
    and its own final norm and stream head (the embedding and the head are the main model's).
    Loaded and kept; the speculative MTP drafter runs it (models/deepseek_v4/mtp.py, speculative/mtp.py)."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        index: int,
        dtype: torch.dtype,
        quantized: bool,
        packed: Mapping[str, int] | None = None,
    ) -> None:
        kinds = (cfg.mtp_layer_types[index], cfg.mtp_mlp_layer_types[index])
        super().__init__(cfg, index, dtype, quantized, kinds, packed, f"mtp.{index}")
        hidden = cfg.hidden_size
        self.e_proj = linear_weight((hidden, hidden), dtype, quantized)
        self.h_proj = linear_weight((hidden, hidden), dtype, quantized)
        self.enorm = Weight((hidden,), torch.float32)
        self.hnorm = Weight((hidden,), torch.float32)
        self.norm = Weight((hidden,), torch.float32)
        self.hc_head = HyperHead(cfg.hc_mult, hidden)


class Backbone(nn.Module):
    """transformers' `model.`: the embedding, the layers, the final norm and hyper-connection head."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        dtype: torch.dtype,
        quantized: bool,
        packed: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        type_id = (packed or {}).get("model.embed_tokens.weight")
        self.embed_tokens: nn.Module = (
            Weight((cfg.vocab_size, cfg.hidden_size), dtype)
            if type_id is None
            else PackedEmbedding(cfg.vocab_size, cfg.hidden_size, type_id, dtype)
        )
        self.layers = nn.ModuleList(
            Layer(cfg, i, dtype, quantized, packed=packed) for i in range(cfg.num_layers)
        )
        self.norm = Weight((cfg.hidden_size,), torch.float32)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size)


def check_hash_table(name: str, table: torch.Tensor, num_experts: int) -> None:
    """A hash-routing table may only name experts that exist (LOAD_FAILED otherwise)."""
    bad = (table < 0) | (table >= num_experts)
    if bool(bad.any()):
        raise load_failure(
            f"tensor {name} names expert {int(table[bad][0])}; the model has experts 0..{num_experts - 1}"
        )
