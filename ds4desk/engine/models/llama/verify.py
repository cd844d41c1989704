"""The verify step of speculative decoding as a graphable forward: T tokens at the device position
`here`..here+T-1, attention over the first `span` cache rows under a mask.

PrefillSteps runs the same T tokens, but its positions are host integers that slice the rotary
tables and the cache, so every verify would be a new shape to a CUDA graph. Here the positions are
device values (index_select / index_copy_ / a mask made from them), so a graph captured once per
(T, span) replays every verify of that size, as GraphedDecode does for one token. A prompt piece
(`prefill_graphable`) is the same step with the head on its last real row.

Two paths: `VerifySteps` (torch projections; attention by SDPA under a mask or the split-span decode
kernel) and, on NVIDIA GPUs where every projection is a float weight the tiles cover,
`KernelVerifySteps`: the one-token step's fused kernels for T rows (kernels/dense/rows_gemv.py), each
weight read once for all T, about the cost of one decode step rather than a GEMM per projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.dense import decode_attention as fused_decode
from ds4desk.engine.kernels.dense import gemv as kernels
from ds4desk.engine.kernels.dense import rows_gemv
from ds4desk.engine.models.llama.layer import LayerPlan, LayerSteps, Shard, _rotate, _TorchSteps

if TYPE_CHECKING:
    from ds4desk.engine.models.llama.config import DenseConfig
    from ds4desk.engine.models.packed import Projection


class VerifySteps(_TorchSteps):
    """T tokens at positions here..here+T-1 (`here`: int64 [1] on the device). `kernel`: attention
    through the split-span decode kernel (fused_decode, `tokens` = T) rather than SDPA under a mask,
    whose fused kernels run a short query block over a long span on one program per kv head."""

    def __init__(
        self,
        cfg: DenseConfig,
        exact: bool,
        shard: Shard,
        here: torch.Tensor,
        span: int,
        count: int,
        kernel: bool = False,
    ) -> None:
        super().__init__(cfg, exact)
        self.here, self.kernel = here, kernel
        cos, sin, keys_at, self.swap = shard.cos, shard.sin, shard.key_positions, shard.half_swap
        assert cos is not None and sin is not None and keys_at is not None and self.swap is not None
        self.count, self.span = count, span
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.heads // self.kv_heads
        self.q_width = self.heads * self.dim
        self.qk_width = (self.heads + self.kv_heads) * self.dim
        self.positions = here + torch.arange(count, device=here.device)  # [T]
        self.cos = cos.index_select(0, self.positions).unsqueeze(1)  # [T, 1, D]
        self.sin = sin.index_select(0, self.positions).unsqueeze(1)
        query_at = self.positions.unsqueeze(1)  # [T, 1]
        keys_at = keys_at[:span].unsqueeze(0)  # [1, span]
        # 0 where query t may read key j, -inf elsewhere; rows kv-head-major as attend lays them out.
        self.biases: dict[int | None, torch.Tensor] = {}
        for window in {plan.window for plan in shard.plans} if not kernel else ():
            allowed = keys_at <= query_at
            if window is not None:
                allowed = allowed & (keys_at > query_at - window)
            bias = torch.zeros((count, span), dtype=cos.dtype, device=cos.device)
            bias.masked_fill_(~allowed, -torch.inf)
            self.biases[window] = bias.repeat(self.group, 1)  # [G * T, span]

    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        assert plan.kv_cache is not None
        qk = qkv[:, : self.qk_width].view(self.count, self.heads + self.kv_heads, self.dim)
        _rotate(qk, plan.qk_norm, self.cos, self.sin, self.swap, self.eps, self.exact)
        kv = qkv[:, self.q_width :].view(self.count, 2, self.kv_heads, self.dim).permute(1, 2, 0, 3)
        plan.kv_cache.index_copy_(2, self.positions, kv)

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        if self.kernel:
            return attend_kernel(qkv, plan, self.here, self.span, self.heads, self.kv_heads, self.dim)
        assert plan.keys is not None and plan.values is not None
        count, kv_heads, group, dim, span = self.count, self.kv_heads, self.group, self.dim, self.span
        q = _queries(qkv, kv_heads, group, dim)
        attn = F.scaled_dot_product_attention(
            q[None], plan.keys[:, :, :span], plan.values[:, :, :span], attn_mask=self.biases[plan.window]
        )  # [1, KV, G * T, D]
        return attn.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, self.q_width)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        width = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :width]) * gate_up[:, width:]


class KernelVerifySteps(LayerSteps):
    """The verify step on the fused kernels, where every projection is a float weight the row
    kernels take (kernels/dense/rows_gemv.py): per layer norm+qkv, rope+cache write for the T
    tokens, the attention pair, o + residual, norm+gate/up, SiLU·up + down + residual, each weight
    read once for all T rows. The residual x is updated in place."""

    def __init__(self, cfg: DenseConfig, shard: Shard, here: torch.Tensor, span: int, count: int) -> None:
        assert shard.cos is not None and shard.sin is not None
        self.cos, self.sin = shard.cos, shard.sin  # the whole tables: rope_write reads from `here`
        self.eps, self.here, self.span, self.count = cfg.rms_norm_eps, here, span, count
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def qkv(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return _norm_rows(x, plan.ln1, plan.qkv, self.eps)

    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        assert plan.kv_cache is not None
        kernels.rope_write(
            qkv, self.cos, self.sin, self.here, plan.kv_cache, self.heads, plan.qk_norm, self.eps
        )

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return attend_kernel(qkv, plan, self.here, self.span, self.heads, self.kv_heads, self.dim)

    def out_residual(self, x: torch.Tensor, attn: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.o.weight_t is not None
        return rows_gemv.gemv_add_(x, attn, plan.o.weight_t.t(), plan.o.bias, silu=False)

    def gate_up(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return _norm_rows(x, plan.ln2, plan.gate_up, self.eps)

    def down_residual(self, x: torch.Tensor, gate_up: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.down.weight_t is not None
        return rows_gemv.gemv_add_(x, gate_up, plan.down.weight_t.t(), plan.down.bias, silu=True)


def rows_fit(projection: Projection, dtype: torch.dtype) -> bool:
    """Whether KernelVerifySteps can run `projection`: one float weight of the model's dtype that
    the row kernels' tiles cover (GGUF-packed weights verify on the torch path)."""
    weight_t = projection.weight_t
    return weight_t is not None and weight_t.dtype == dtype and rows_gemv.fits(weight_t.t())


def norm_rows(x: torch.Tensor, norm: torch.Tensor, projection: Projection, eps: float) -> torch.Tensor:
    """RMSNorm(x [T, K]) @ Wᵀ (+ b) on the row kernel, float32 out (the head's logits)."""
    assert projection.weight_t is not None
    out = torch.empty((x.shape[0], projection.rows), device=x.device, dtype=torch.float32)
    return rows_gemv.norm_gemv(x, norm, projection.weight_t.t(), projection.bias, eps, out)


def _norm_rows(x: torch.Tensor, norm: torch.Tensor, projection: Projection, eps: float) -> torch.Tensor:
    assert projection.weight_t is not None
    out = x.new_empty((x.shape[0], projection.rows))
    return rows_gemv.norm_gemv(x, norm, projection.weight_t.t(), projection.bias, eps, out)


def _queries(qkv: torch.Tensor, kv_heads: int, group: int, dim: int) -> torch.Tensor:
    """The queries of qkv [T, ...] as [KV, G * T, D], row g * T + t (as both attention paths take them)."""
    count = qkv.shape[0]
    q = qkv[:, : kv_heads * group * dim].reshape(count, kv_heads, group, dim).permute(1, 2, 0, 3)
    return q.reshape(kv_heads, group * count, dim)


def attend_kernel(
    qkv: torch.Tensor, plan: LayerPlan, here: torch.Tensor, span: int, heads: int, kv_heads: int, dim: int
) -> torch.Tensor:
    """The T queries' attention over the first `span` cache rows through the split-span decode kernel
    (`tokens` = T), masked by position from `here`: [T, H * D]."""
    assert plan.keys is not None and plan.values is not None
    count, group = qkv.shape[0], heads // kv_heads
    q = _queries(qkv, kv_heads, group, dim)
    attn = fused_decode.decode_attention(
        q, plan.keys[0, :, :span], plan.values[0, :, :span], here, dim**-0.5, plan.window, tokens=count
    )
    return attn.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, heads * dim)
