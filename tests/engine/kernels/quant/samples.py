"""Random quantized weights for the quant kernel tests, with their references dequantized by the
loader's math (loading/quantized.py), and the error measures the tests share."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.loading.quantized import (
    dequantize_fp4_block32,
    dequantize_fp8_block128,
    e8m0_to_float,
    quantize_fp4_block32,
    quantize_fp8_block128,
)

needs_nvidia_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU"
)


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [n, k], float32 block scales, the reference dequantized float32 [n, k]); blocks of very
    different magnitudes, so a scale applied to the wrong block shows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w *= (
        torch.exp2(torch.randint(-6, 6, ((n + 127) // 128, (k + 127) // 128), generator=gen).float())
        .repeat_interleave(128, 0)[:n]
        .repeat_interleave(128, 1)[:, :k]
    )
    q, exponent = quantize_fp8_block128(w)
    return q, e8m0_to_float(exponent, "test"), dequantize_fp8_block128(q, exponent)


def fp4_experts(e: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [e, n, k/2], scale uint8 [e, n, k/32], the reference float32 [e, n, k])."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) * torch.exp2(
        torch.randint(-8, 4, (e, n, k // 32), generator=gen).float()
    ).repeat_interleave(32, -1)
    parts = [quantize_fp4_block32(w[i]) for i in range(e)]
    packed = torch.stack([p.view(torch.uint8) for p, _ in parts])
    scale = torch.stack([s.view(torch.uint8) for _, s in parts])
    reference = torch.stack([dequantize_fp4_block32(p, s) for p, s in parts])
    return packed, scale, reference


def swiglu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """The clamped SwiGLU of gate | up rows in float32, rounded once to x's dtype (as the kernels)."""
    gate, up = x.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return act.to(x.dtype).float()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def grouped_reference(x: torch.Tensor, sizes: list[int], reference: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert (sizes[e] of them for expert e) times their expert's reference weight."""
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    return torch.cat(
        [x[s : s + n].float() @ reference[e].t() for e, (s, n) in enumerate(zip(starts, sizes, strict=True))]
    )
