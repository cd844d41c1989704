"""Small pieces of Qwen3.5's math that both kinds of layer use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.dense import norm_rows


def scaled_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: normalised in float32, scaled by the float32 `scale` = 1 + weight (the
    stored weight is centred on 0; the plans make the scale once), then rounded to x's dtype once.
    On a GPU one kernel for rows [N, D] (kernels/dense/norm_rows.py), else these torch ops."""
    if x.dim() == 2 and norm_rows.enabled(x):
        return norm_rows.scaled_rms_norm(x, scale, eps)
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * scale).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The linear-attention output norm, per head: RMSNorm (weight not centred) times silu(gate).
    x, gate [..., d]; the result in gate's dtype (the model's)."""
    dtype = gate.dtype
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype) * weight
    return (normed.float() * F.silu(gate.float())).to(dtype)


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dimensions of each head (halves paired, as rotate_half
    does); the remaining dimensions pass through. x [H, T, D]; cos, sin [T, rotary]."""
    rotary = cos.shape[-1]
    turned, kept = x[..., :rotary], x[..., rotary:]
    first, second = turned[..., : rotary // 2], turned[..., rotary // 2 :]
    swapped = torch.cat((-second, first), dim=-1)
    return torch.cat((turned * cos + swapped * sin, kept), dim=-1)
