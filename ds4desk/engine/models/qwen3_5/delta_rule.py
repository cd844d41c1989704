"""The gated delta rule: Gated DeltaNet's recurrence, as one step and over a run of tokens.

Per value head the state is a matrix S [dk, dv]. A token with query q, key k (both unit length,
q also scaled by dk^-1/2), value v, log-decay g <= 0 and write strength beta in (0, 1) does

    S' = exp(g) S                      (forget a little of everything)
    u  = beta (v - S'ᵀ k)              (the part of v the state does not already predict)
    S  = S' + k uᵀ                     (write it under k)
    o  = Sᵀ q

`step` is that, for decode. `chunked` does the same for a prompt in chunks, with matmuls instead of
a token loop: kernels/qwen3_5/chunked_delta.py (its docstring has the chunked form's math; three
Triton kernels on NVIDIA GPUs, torch ops elsewhere).

Everything runs in float32 whatever the model's dtype: the state is a long running sum.
Shapes: heads first, [H, T, d], batch dropped.
"""

from __future__ import annotations

import torch

from ds4desk.engine.kernels.qwen3_5 import chunked_delta
from ds4desk.engine.kernels.qwen3_5.chunked_delta import to_value_heads  # key heads to value heads
from ds4desk.engine.kernels.qwen3_5.linear_decode import unit_rows  # q and k scaled to unit length

__all__ = ["CHUNK", "chunked", "step", "to_value_heads", "unit_rows"]

# Tokens per chunk of the chunked form (a Qwen3.5 prompt piece is one chunk).
CHUNK = chunked_delta.CHUNK


def step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token: q, k [H, dk], v [H, dv], g, beta [H] (float32); `state` [H, dk, dv] float32 is
    updated in place. Returns o [H, dv] float32."""
    decayed = state * g.exp()[:, None, None]
    predicted = torch.einsum("hkv,hk->hv", decayed, k)
    write = (v - predicted) * beta[:, None]
    new_state = decayed + k[:, :, None] * write[:, None, :]
    state.copy_(new_state)
    return torch.einsum("hkv,hk->hv", new_state, q)


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    model_dtype: torch.dtype,
    interleaved: bool = True,
) -> torch.Tensor:
    """A run of tokens: q, k [H, T, dk] (or per key head, value head h reading key head h // repeat
    where `interleaved`, else h % key heads), v [H, T, dv], g, beta [H, T] (float32); `state`
    [H, dk, dv] float32 holds the state before the first token and is updated in place to the
    state after the last. Returns o [H, T, dv] float32. A 16-bit model lets the GPU kernels'
    matmuls round their inputs to TF32."""
    tf32 = model_dtype != torch.float32
    return chunked_delta.chunked(q, k, v, g, beta, state, tf32=tf32, interleaved=interleaved)
