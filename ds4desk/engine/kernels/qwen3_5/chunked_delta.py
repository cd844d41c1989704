"""The gated delta rule over a run of tokens (a prefill chunk, a verify step) as one op: `chunked`.

The recurrence (per value head a state matrix S, and per token its query q, key k, value v,
log-decay g and write strength beta) is written out in models/qwen3_5/delta_rule.py. The chunked
form runs it C tokens at a time with matmuls instead of a token loop. Inside a chunk, with γ_t the
running sum of g from the chunk's start and S0 the state before it, the writes u_t depend on the
earlier writes of the chunk through

    u_t + Σ_{s<t} beta_t exp(γ_t - γ_s) (k_t·k_s) u_s = beta_t v_t - beta_t exp(γ_t) S0ᵀ k_t,

a unit lower-triangular system (I + A) U = B V - (B e^γ K) S0, whose solution splits into a part
free of S0 and a part linear in it (U = W_free - W_S S0); both depend only on the chunk's own tokens.
Then

    o_t = exp(γ_t) S0ᵀ q_t + Σ_{s<=t} exp(γ_t - γ_s) (q_t·k_s) u_s
    S_C = exp(γ_C) S0 + Σ_s exp(γ_C - γ_s) k_s u_sᵀ.

`reference` (torch, what runs on the CPU and is what the kernels are held to) solves both systems
for every chunk at once, builds each chunk's end state as an affine map of its start state, applies
those maps in order (one batched matmul a chunk), and gets every chunk's writes and outputs in two
batched products. On NVIDIA GPUs with Triton the op runs three kernels instead
(chunked_delta_triton.py): per chunk and head, the inverse of I + A in blocks of 16 and W_S, W_free
from it; per head and block of state columns, the state carried from chunk to chunk in registers
(the one sequential part), which also turns W_free - W_S S0 into the writes; per chunk, head and
column block, the outputs.

Everything runs in float32 whatever the model's dtype: the state is a long running sum. Shapes: heads
first, [H, T, d], batch dropped; any strides with the last dimension contiguous. q and k may come per
key head (fewer heads than v, as the convolution's op gives them): value head h then reads key head
h // (value heads / key heads) in Hugging Face's order, h % key heads in llama.cpp's (`interleaved`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device

SWITCH = Switch(
    "qwen3_5.chunked_delta",
    "Qwen3.5's gated delta rule over a run of tokens (prefill, verify) as three kernels",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

# Tokens per chunk: large enough that the matmuls pay, small enough that exp(γ_t - γ_s) over a
# chunk stays well inside float32 (g is a log-decay, summed over at most this many tokens).
CHUNK = 64
# Warps a program of each kernel: 8, so that no program of Qwen3.5-9B's shapes spills registers
# (compiled for sm_90; at 4 they do).
WARPS = 8


def enabled(where: Where) -> bool:
    """Whether `chunked` runs the kernels for tensors on `where` (else the reference)."""
    return SWITCH.on(where)


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tf32: bool = False,
    interleaved: bool = True,
) -> torch.Tensor:
    """A run of tokens: q, k [H or key heads, T, dk], v [H, T, dv], g, beta [H, T] (float32);
    `state` [H, dk, dv] float32 holds the state before the first token and is updated in place to
    the state after the last. Returns o [H, T, dv] float32 (on the kernels a view of [T, H, dv]
    memory). `tf32`: the kernels' matmuls may round their inputs to TF32 (for a 16-bit model, whose
    output is rounded coarser than that; IEEE float32 otherwise, as the reference's).
    `interleaved`: the key-head order (the module's docstring), where q and k have fewer heads."""
    key_heads, length, dk = k.shape
    heads = v.shape[0]
    if q.shape != k.shape or v.shape[1] != length or g.shape != (heads, length) or heads % key_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}")
    if beta.shape != g.shape or state.shape != (heads, dk, v.shape[2]) or state.dtype != torch.float32:
        raise ValueError(f"beta {tuple(beta.shape)}, state {tuple(state.shape)} {state.dtype}")
    if not enabled(q):
        return reference(q, k, v, g, beta, state, interleaved=interleaved)
    return _fused_op(q, k, v, g, beta, state, tf32, interleaved)


def to_value_heads(x: torch.Tensor, value_heads: int, interleaved: bool) -> torch.Tensor:
    """Per-key-head rows [..., key heads, d] as each value head reads them [..., value_heads, d]: value
    head h reads key head h // (value_heads / key heads) where `interleaved` (Hugging Face's order),
    else h % key heads (llama.cpp's, a GGUF's)."""
    key_heads = x.shape[-2]
    repeat = value_heads // key_heads
    if repeat == 1:
        return x
    if not interleaved:
        return x.repeat(*([1] * (x.dim() - 2)), repeat, 1)
    # repeat_interleave as an expand, no sizes to learn on the device (graph-safe).
    shape = (*x.shape[:-2], value_heads, x.shape[-1])
    return x.unsqueeze(-2).expand(*x.shape[:-1], repeat, x.shape[-1]).reshape(shape)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
    interleaved: bool = True,
) -> torch.Tensor:
    """`chunked` in torch ops (see the module's docstring)."""
    heads, length = v.shape[:2]
    q, k = (to_value_heads(t.transpose(0, 1), heads, interleaved).transpose(0, 1) for t in (q, k))
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
    # sequential is a single batched matmul a chunk.
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


@torch.library.custom_op("ds4desk::qwen35_chunked_delta", mutates_args=("state",))
def _fused_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tf32: bool,
    interleaved: bool,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(state) else None
    if kernel is None:
        return reference(q, k, v, g, beta, state, interleaved=interleaved).contiguous()
    return kernel(q, k, v, g, beta, state, tf32, interleaved)


@_fused_op.register_fake
def _(q, k, v, g, beta, state, tf32, interleaved):
    return v.new_empty(v.shape, dtype=torch.float32)


def chunk_for(length: int) -> int:
    """The kernels' tokens a chunk: CHUNK, or the run's length rounded up to a power of two for a
    shorter run (16 at least: Triton's smallest matmul)."""
    return min(CHUNK, max(16, next_power_of_two(length)))


def launch_constants(dk: int, dv: int, length: int) -> dict[str, Any]:
    # Key and value columns in blocks of at most 64, so no tile of the parallel kernels passes
    # [64, 64] floats; the state kernel holds a state block of all dk rows and BV columns.
    block_k, block_v = min(64, max(16, next_power_of_two(dk))), min(64, max(16, next_power_of_two(dv)))
    return {"DK": dk, "DV": dv, "C": chunk_for(length), "BK": block_k, "BV": block_v}


def state_constants(dk: int, dv: int, length: int) -> dict[str, Any]:
    return {
        "DK": dk,
        "DV": dv,
        "C": chunk_for(length),
        "BKF": max(16, next_power_of_two(dk)),
        # 32 state columns a program: 128 programs (32 heads x 4) carry the state at Qwen3.5-9B's shapes.
        "BV": min(32, max(16, next_power_of_two(dv))),
    }


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The launcher of the three kernels, or None where Triton is not importable."""
    try:
        from ds4desk.engine.kernels.qwen3_5 import chunked_delta_triton as source
    except Exception:
        return None

    def launch(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        tf32: bool,
        interleaved: bool,
    ) -> torch.Tensor:
        key_heads, length, dk = k.shape
        heads, dv = v.shape[0], v.shape[2]
        q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
        state_was = state
        state = state.contiguous()
        constants = launch_constants(dk, dv, length)
        chunk = constants["C"]
        chunks = -(-length // chunk)
        padded = chunks * chunk
        scratch = {"device": state.device, "dtype": torch.float32}
        gam = torch.empty((heads, padded), **scratch)
        w = torch.empty((heads, padded, dk), **scratch)
        u = torch.empty((heads, padded, dv), **scratch)
        lower, inverse = (torch.empty((heads, padded, chunk), **scratch) for _ in range(2))
        starts = torch.empty((heads, chunks, dk, dv), **scratch)
        # Tokens first in memory: the model reads the outputs back as [T, H, dv] rows (the gated norm's
        # input), which a transposed view of this is without a copy.
        out = torch.empty((length, heads, dv), **scratch).transpose(0, 1)
        settings = {"PRECISION": "tf32" if tf32 else "ieee", "num_warps": WARPS, "num_stages": 1}
        # Value head h reads key head (h // KEY_DIV) % KEY_HEADS: h // repeat interleaved, else h % key heads.
        settings |= {"KEY_HEADS": key_heads, "KEY_DIV": heads // key_heads if interleaved else 1}
        source.prepare_kernel[(chunks, heads)](
            k,
            v,
            g,
            beta,
            gam,
            w,
            u,
            lower,
            inverse,
            length,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            g.stride(0),
            g.stride(1),
            beta.stride(0),
            beta.stride(1),
            padded,
            **constants,
            **settings,
        )
        along = state_constants(dk, dv, length)
        source.state_kernel[(-(-dv // along["BV"]), heads)](
            k,
            gam,
            w,
            u,
            starts,
            state,
            length,
            chunks,
            k.stride(0),
            k.stride(1),
            padded,
            **along,
            **settings,
        )
        source.output_kernel[(chunks, heads, -(-dv // constants["BV"]))](
            q,
            k,
            gam,
            u,
            starts,
            out,
            length,
            chunks,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            out.stride(0),
            out.stride(1),
            padded,
            **constants,
            **settings,
        )
        if state is not state_was:
            state_was.copy_(state)
        return out

    return on_its_device(launch)
