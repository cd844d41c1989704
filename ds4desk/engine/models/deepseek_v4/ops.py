"""DeepSeek-V4's math on tensors: norms, the interleaved partial rotation, the hyper-connection
mix / collapse / expand, linears (bf16 or FP8) and the clamped SwiGLU. Free functions of tensors and
weight holders, shared by prefill (attention.py, moe.py, hyper.py) and the graphable decode step
(decode.py); each is the eager form a fused kernel in kernels/deepseek_v4/ must equal."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.formats import FP8_BLOCK, Q8_0_ROWS
from ds4desk.engine.kernels.deepseek_v4 import moe_tail
from ds4desk.engine.kernels.dense import gemv as decode_kernels
from ds4desk.engine.kernels.quant import fp8, gguf_experts, gguf_triton
from ds4desk.engine.kernels.quant.fp8 import fp8_dequantize, fp8_linear
from ds4desk.engine.kernels.quant.gguf_matmul import gguf_matmul
from ds4desk.engine.models.deepseek_v4.modules import Attention, Indexer, SharedExpert
from ds4desk.engine.models.packed import PackedLinear
from ds4desk.engine.models.row_buckets import bucketed

# On a GPU a prefill product of more than a few rows runs on its rows padded to their bucket
# (models/row_buckets.py: cuBLAS's first call at a new row count costs milliseconds); the load's
# warm-up runs each bucket (DeepseekV4Model.prefill_row_buckets). False: at their own row count.
PAD_PRODUCT_ROWS = True


def position(start: int, device: torch.device) -> torch.Tensor:
    """A chunk's first position as the int64 [1] device tensor the norm_rope kernel reads (a fill,
    no copy)."""
    return torch.full((1,), start, dtype=torch.int64, device=device)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm in float32; the (float32) weight multiplies before the cast to `dtype` (x's by
    default), as V4 keeps it. F.rms_norm is one fused kernel on CUDA (spelled out it is seven)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(dtype or x.dtype)


def rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation e^{iφ} of each rotary pair (complex64 [.., r / 2]) from a table's rows."""
    return torch.complex(cos, sin)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    turn: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """rms_norm then rope_, both in float32, cast once at the end (to x's dtype by default)."""
    return rope_(F.rms_norm(x.float(), (x.shape[-1],), weight, eps), turn).to(dtype or x.dtype)


def rope_(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * turn.shape[-1] dims of x in interleaved pairs (2i, 2i + 1) by `turn`
    (see rotation; its conjugate rotates back), in float32 (one complex product), in place: x is
    always a fresh activation. Returns x."""
    dims = 2 * turn.shape[-1]
    rot = x[..., -dims:]
    pairs = torch.view_as_complex(rot.float().unflatten(-1, (-1, 2)))
    rot.copy_(torch.view_as_real(pairs * turn).flatten(-2))
    return x


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The hyper-connection projection of the RMS-normed flattened streams, float32 [T, rows], and
    the float32 streams [T, m, D] (which the collapse reuses)."""
    flat = streams.reshape(streams.shape[0], -1).float()
    mixed = torch.mm(F.rms_norm(flat, (flat.shape[-1],), None, eps), fn.t())
    return mixed, flat.view(streams.shape)


def collapse(streams32: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_j pre_j X_j: the block input, float32 [T, D] (normed before it is cast: one rounding)."""
    return torch.bmm(pre.unsqueeze(1), streams32).squeeze(1)


def expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k y + Σ_j C[j, k] X_j (Cᵀ X: C is not symmetric), as one batched product
    [Cᵀ | post] @ [X; y]."""
    mix = torch.cat([comb.transpose(1, 2), post.unsqueeze(-1)], dim=-1).to(streams.dtype)  # [T, m, m + 1]
    return torch.bmm(mix, torch.cat([streams, y.unsqueeze(1)], dim=1))


def linear(x: torch.Tensor, holder: nn.Module) -> torch.Tensor:
    """x @ Wᵀ for a Weight, an Fp8Weight (which never leaves FP8: the kernel dequantizes) or a GGUF's
    PackedLinear (its blocks, on the GGUF kernels)."""
    if isinstance(holder, PackedLinear):
        rows = gguf_matmul(x.reshape(-1, x.shape[-1]), holder.weight, holder.type_id, holder.in_features)
        return rows.view(*x.shape[:-1], holder.out_features)
    weight = holder.weight
    if weight.dtype == torch.float8_e4m3fn:
        return fp8_linear(x, weight, holder.weight_scale_inv)
    return product(x, lambda rows: decode_kernels.linear(rows, weight))


def joined_linear(x: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x @ Wᵀ for the joined rows of several linears (modules.join_rows: a weight, and an FP8
    weight's scale)."""
    weight = tensors[0]
    if weight.dtype == torch.float8_e4m3fn:
        return fp8_linear(x, weight, tensors[1])
    return product(x, lambda rows: decode_kernels.linear(rows, weight))


def q_a_kv(x: torch.Tensor, attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ q_a_projᵀ and x @ kv_projᵀ: one product where the two weights are joined
    (Attention.q_a_kv), else two."""
    tensors = attn.q_a_kv()
    if not tensors:
        return linear(x, attn.q_a_proj), linear(x, attn.kv_proj)
    both = joined_linear(x, tensors)
    return both.split([attn.q_a_proj.weight.shape[0], attn.kv_proj.weight.shape[0]], dim=-1)


@functools.cache
def _group_ids(groups: int, device: torch.device) -> torch.Tensor:
    """0 .. groups - 1 on `device`: the groups as experts_gemv's slots, made once, not every step."""
    return torch.arange(groups, device=device)


def grouped_low_rank(out: torch.Tensor, holder: nn.Module, groups: int) -> torch.Tensor:
    """Attention's grouped low-rank output projection of out [T, H, d]: group g's heads (H / G side
    by side) times rows g R .. (g + 1) R of the weight [G R, H d / G], [T, G R]. A GGUF's blocks
    (PackedLinear) at one row go through one kernel with the groups as its stacked matrices: the
    rows GEMV for Q8_0 as a GPU holds it (Q8_0_ROWS), else the experts GEMV with the groups as its
    slots (the blocks read in place); longer, one packed matmul a group. FP8 (Fp8Weight): one row
    on the one-row FP8 kernel with the groups, a few rows one FP8 GEMV a group; a prefill chunk
    multiplies the weight dequantized (the reference's bf16 product, activations unquantized)."""
    count = out.shape[0]
    grouped = out.reshape(count, groups, -1)
    weight = holder.weight
    if weight.dtype == torch.float8_e4m3fn:
        scale = holder.weight_scale_inv
        flat = out.reshape(count, -1)
        if count == 1 and fp8.fp8_grouped_row_fits(flat, weight, scale, groups):
            return fp8.fp8_row_(flat, weight, scale, flat.new_empty((1, weight.shape[0])), groups=groups)
        rank = weight.shape[0] // groups
        if count <= fp8.GEMV_MAX_ROWS and rank % FP8_BLOCK == 0 and fp8.enabled(out):
            blocks = rank // FP8_BLOCK
            parts = [
                fp8_linear(
                    grouped[:, g].contiguous(),
                    weight[g * rank : (g + 1) * rank],
                    scale[g * blocks : (g + 1) * blocks],
                )
                for g in range(groups)
            ]
            return torch.cat(parts, dim=1)
        weight = fp8_dequantize(weight, scale, out.dtype)
    if isinstance(holder, PackedLinear):
        rank, cols, type_id = holder.out_features // groups, holder.in_features, holder.type_id
        stacked = holder.weight.view(groups, rank, -1)
        if count == 1 and gguf_triton.enabled(out) and gguf_triton.covers(type_id, out.dtype):
            low = out.new_empty((groups, rank))
            if type_id == Q8_0_ROWS.type_id:
                return gguf_triton.stacked_rows_gemv(grouped[0], holder.weight, cols, low).view(1, -1)
            ids = _group_ids(groups, out.device)
            return gguf_experts.experts_gemv(grouped[0], ids, stacked, type_id, cols, low).view(1, -1)
        parts = [gguf_matmul(grouped[:, g].contiguous(), stacked[g], type_id, cols) for g in range(groups)]
        return torch.cat(parts, dim=1)
    weight = weight.view(groups, -1, weight.shape[-1])

    def by_group(rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        grouped = rows.view(n, groups, -1).transpose(0, 1)
        return torch.bmm(grouped, weight.transpose(1, 2)).transpose(0, 1).reshape(n, -1)

    return product(out.reshape(count, -1), by_group)


def shared_expert(shared: SharedExpert, x: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert's SwiGLU FFN of x (every token goes through it)."""
    act = swiglu(linear(x, shared.gate_proj), linear(x, shared.up_proj), limit)
    return linear(act, shared.down_proj)


def pads_rows(device: torch.device) -> bool:
    """Whether products on `device` run on their rows' bucket (see PAD_PRODUCT_ROWS)."""
    return PAD_PRODUCT_ROWS and device.type == "cuda"


def product(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(x) for a product whose rows are independent, on the rows' bucket where pads_rows says."""
    return bucketed(x, fn) if pads_rows(x.device) else fn(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, ±limit), one kernel where it can be (kernels/deepseek_v4/moe_tail)."""
    return moe_tail.swiglu(gate, up, limit)


def index_weights(x: torch.Tensor, indexer: Indexer, heads: int, dim: int) -> torch.Tensor:
    """The indexer's per-head weights with both scales folded in, float32 [T, Hi]: the score is
    Σ_h w_h Hi^-½ ReLU(q_h · k) di^-½ = Σ_h (w_h Hi^-½ di^-½) ReLU(q_h · k)."""
    return index_head_weights(x, indexer).float() * index_weight_scale(heads, dim)


def index_head_weights(x: torch.Tensor, indexer: Indexer) -> torch.Tensor:
    """The indexer's per-head weights w_h as its projection gives them, in x's dtype [T, Hi]."""
    weight = indexer.scorer.weights_proj.weight
    return product(x, lambda rows: decode_kernels.linear(rows, weight))


def index_weight_scale(heads: int, dim: int) -> float:
    """Hi^-½ di^-½: what index_weights folds into each head's weight."""
    return heads**-0.5 * dim**-0.5
