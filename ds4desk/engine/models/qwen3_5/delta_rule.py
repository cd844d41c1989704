"""The gated delta rule: Gated DeltaNet's recurrence, as one step and in chunks.

Per value head the state is a matrix S [dk, dv]. A token with query q, key k (both unit length,
q also scaled by dk^-1/2), value v, log-decay g <= 0 and write strength beta in (0, 1) does

    S' = exp(g) S                      (forget a little of everything)
    u  = beta (v - S'ᵀ k)              (the part of v the state does not already predict)
    S  = S' + k uᵀ                     (write it under k)
    o  = Sᵀ q

`step` is that, for decode. `chunked` does the same for a prompt, C tokens at a time, with
matmuls instead of a token loop. Inside a chunk, with γ_t the running sum of g from the chunk's
start and S0 the state before it, the writes u_t depend on the earlier writes of the chunk through

    u_t + Σ_{s<t} beta_t exp(γ_t - γ_s) (k_t·k_s) u_s = beta_t v_t - beta_t exp(γ_t) S0ᵀ k_t,

a unit lower-triangular system (I + A) U = B V - (B e^γ K) S0, solved for both right-hand parts
batched over every chunk (U = W_free - W_S S0). Then

    o_t = exp(γ_t) S0ᵀ q_t + Σ_{s<=t} exp(γ_t - γ_s) (q_t·k_s) u_s
    S_C = exp(γ_C) S0 + Σ_s exp(γ_C - γ_s) k_s u_sᵀ.

So each chunk's end state is an affine map of its start state, built for every chunk at once; only
applying those maps in order is sequential (one batched matmul a chunk), and the outputs and writes
of every chunk then follow from the start states in two batched products.

Everything runs in float32 whatever the model's dtype: the state is a long running sum.
Shapes: heads first, [H, T, d], batch dropped.
"""

from __future__ import annotations

import torch

# Tokens per chunk: large enough that the matmuls pay, small enough that exp(γ_t - γ_s) over a
# chunk stays well inside float32 (g is a log-decay, summed over at most this many tokens).
CHUNK = 64
_NORM_EPS = 1e-6


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _NORM_EPS)


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
    chunk: int = CHUNK,
) -> torch.Tensor:
    """A run of tokens: q, k [H, T, dk], v [H, T, dv], g, beta [H, T] (float32); `state`
    [H, dk, dv] float32 holds the state before the first token and is updated in place to the
    state after the last. Returns o [H, T, dv] float32."""
    heads, length = k.shape[:2]
    chunk = min(chunk, length)  # a short run (a small prefill chunk) pays for its own length only
    dv = v.shape[-1]
    pad = -length % chunk
    if pad:
        # Zero keys and write strengths add nothing, and g = 0 decays nothing: padding after the
        # last token leaves its outputs and the final state as they are.
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    chunks = (length + pad) // chunk
    q, k, v = (t.reshape(heads, chunks, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(heads, chunks, chunk), beta.reshape(heads, chunks, chunk)

    gamma = g.cumsum(dim=-1)  # [H, N, C]
    # exp(γ_t - γ_s) for s <= t; above the diagonal the exponent would be positive (and unused).
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(later, float("-inf")).exp()

    k_beta = k * beta[..., None]
    # I + A: A[t, s] = beta_t exp(γ_t - γ_s) (k_t·k_s) below the diagonal (`decay` zeroes the rest).
    unit_lower = (k_beta @ k.transpose(-1, -2)) * decay
    unit_lower = unit_lower.tril(-1) + torch.eye(chunk, dtype=unit_lower.dtype, device=unit_lower.device)
    writes_free = torch.linalg.solve_triangular(
        unit_lower, v * beta[..., None], upper=False, unitriangular=True
    )
    # [H, N, C, dk]: how S0 enters each write.
    writes_per_state = torch.linalg.solve_triangular(
        unit_lower, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )

    scores = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], zero above the diagonal
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = (k * (gamma[..., -1:] - gamma).exp()[..., None]).transpose(-1, -2)  # [H, N, dk, C]
    chunk_decay = gamma[..., -1].exp()  # [H, N]

    # From chunk to chunk the state is affine in the state before: S_{n+1} = A_n S_n + B_n, with
    # A_n = exp(γ_C) I - K̃ᵀ W_S and B_n = K̃ᵀ W_free (K̃ the keys decayed to the chunk's end, W_S and
    # W_free the writes' parts above). Both are batched over every chunk here, so the one thing left
    # sequential is a single batched matmul a chunk (on a GPU: one launch a chunk, not a dozen).
    step_matrix = -(k_to_end @ writes_per_state)  # [H, N, dk, dk]
    step_matrix.diagonal(dim1=-2, dim2=-1).add_(chunk_decay[..., None])
    step_offset = k_to_end @ writes_free  # [H, N, dk, dv]
    step_matrix, step_offset = (t.transpose(0, 1).contiguous() for t in (step_matrix, step_offset))
    states = torch.empty(chunks + 1, heads, k.shape[-1], dv, dtype=torch.float32, device=q.device)
    states[0] = state
    for n in range(chunks):
        torch.baddbmm(step_offset[n], step_matrix[n], states[n], out=states[n + 1])
    before = states[:-1].transpose(0, 1)  # [H, N, dk, dv]: the state each chunk starts from
    writes = writes_free - writes_per_state @ before  # [H, N, C, dv]
    out = q_decayed @ before + scores @ writes
    state.copy_(states[-1])
    return out.reshape(heads, chunks * chunk, dv)[:, :length]
