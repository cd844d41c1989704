"""The verify step of speculative decoding as a graphable forward: T tokens at the device position
`here`..here+T-1, attention over the first `span` cache rows under a mask.

PrefillSteps runs the same T tokens, but its positions are host integers that slice the rotary
tables and the cache, so every verify would be a new shape to a CUDA graph. Here the positions are
device values (index_select / index_copy_ / a mask made from them), so a graph captured once per
(T, span) replays every verify of that size, as GraphedDecode does for one token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.dense import decode_attention as fused_decode
from ds4desk.engine.kernels.dense import gemv as kernels
from ds4desk.engine.kernels.dense.silu_mul import silu_mul
from ds4desk.engine.models.llama.layer import LayerPlan, Shard, _rotate, _TorchSteps

if TYPE_CHECKING:
    from ds4desk.engine.models.llama.config import DenseConfig


class VerifySteps(_TorchSteps):
    """T tokens at positions here..here+T-1 (`here`: int64 [1] on the device). `kernel`: attention
    through the split-span decode kernel (fused_decode, `tokens` = T) rather than SDPA under a mask,
    whose fused kernels run a short query block over a long span on one program per kv head.
    Where the decode step's kernels run (kernels/dense/gemv.py), RoPE and the cache write of the T
    tokens are its one rope_write kernel, and SiLU · up one kernel (silu_mul), instead of about ten
    small torch kernels a layer: inside a graph each costs its launch whatever it does. The
    projections stay cuBLAS GEMMs, faster at 2-16 rows than GEMV-style kernels measured on an H200."""

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
        self.fused_rope = kernels.enabled(here.device) and kernels.fits_heads(self.dim)
        if self.fused_rope:
            self.cos, self.sin = cos, sin  # the whole tables: rope_write reads from `here`
        else:
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
        if self.fused_rope:
            kernels.rope_write(
                qkv, self.cos, self.sin, self.here, plan.kv_cache, self.heads, plan.qk_norm, self.eps
            )
            return
        qk = qkv[:, : self.qk_width].view(self.count, self.heads + self.kv_heads, self.dim)
        _rotate(qk, plan.qk_norm, self.cos, self.sin, self.swap, self.eps, self.exact)
        kv = qkv[:, self.q_width :].view(self.count, 2, self.kv_heads, self.dim).permute(1, 2, 0, 3)
        plan.kv_cache.index_copy_(2, self.positions, kv)

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        keys, values = plan.keys, plan.values
        assert keys is not None and values is not None
        count, kv_heads, group, dim, span = self.count, self.kv_heads, self.group, self.dim, self.span
        q = qkv[:, : self.q_width].view(count, self.heads, dim)
        if self.kernel:  # the kernel reads and writes the tokens' heads in place: no regrouping copies
            attn = fused_decode.decode_attention(
                q if count > 1 else q.view(kv_heads, group, dim),
                keys[0, :, :span],
                values[0, :, :span],
                self.here,
                dim**-0.5,
                plan.window,
                tokens=count,
            )
            return attn.view(count, self.q_width)
        rows = q.view(count, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * count, dim)
        attn = F.scaled_dot_product_attention(
            rows[None], keys[:, :, :span], values[:, :, :span], attn_mask=self.biases[plan.window]
        )  # [1, KV, G * T, D], row g * T + t as the bias lays them out
        return attn.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, self.q_width)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)
