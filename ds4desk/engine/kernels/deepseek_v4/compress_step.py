"""DeepSeek-V4's decode compressor step as one op: everything after the two projections.

A decode step feeds its token to every compressor (CSA layers: the compressor and the indexer's;
HCA layers: one). Eagerly that is ~25 tiny kernels a call (the bias add, the open-window row
selection, the overlap's concatenation, the softmax pooling, the norm, the rope and the
branch-free row writes); inside a CUDA graph at batch 1 each costs a few µs, and Flash has 41
compressed layers. On NVIDIA GPUs with Triton it is one kernel that branches on the device value
of `pos`: a step that does not close its window only stores the token's row (the eager form pools
every step and throws the result away, to stay branch-free); a closing step pools, norms, rotates
and writes the entry, and (CSA) moves the window's first halves into the overlap state.
Elsewhere (CPU, ROCm, no Triton) the eager form runs, with the same math. Before the op, the two
projections are one product where the model's materialize made kv_proj and gate_proj halves of one
weight (fuse_projections): no copy of a weight is ever kept.

The state is exactly the model's (deepseek_v4.CompressorState and the entry rows), so eager
prefill, fused steps and snapshots mix freely.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.kernels.dense import gemv as decode_kernels
from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device
from ds4desk.engine.kernels.quant.gguf_matmul import gguf_matmul

# Default: the fused kernel where it can run (NVIDIA CUDA tensors, Triton importable; NVIDIA only: the
# kernel was written for (and checked on) CUDA, never on ROCm). Forced on: always through the custom
# op (on the CPU its body is the eager math of `reference`: what bench/count_ops.py uses to count a
# fused step without a GPU); off: the model's own eager ops.
SWITCH = Switch(
    "deepseek_v4.compress_step",
    "DeepSeek-V4's decode compressor step (pool, norm, rope, row writes) as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)


def enabled(where: Where) -> bool:
    """Whether the model's decode step should call `compress_step` for tensors on `where`."""
    return SWITCH.on(where)


def fuse_projections(module: nn.Module) -> None:
    """Point a compressor's kv_proj and gate_proj weights at the two row halves of one new tensor
    (kept as `module.fused_proj`, outside the state dict), so a decode step projects once. For the
    model's materialize: the contents are undefined until the loader copies the weights in. Weights
    in a GGUF's blocks fuse when both are of one block type (rows of blocks are independent)."""
    if getattr(module.kv_proj, "type_id", None) != getattr(module.gate_proj, "type_id", None):
        return
    kv, gate = module.kv_proj.weight, module.gate_proj.weight
    both = torch.empty((kv.shape[0] + gate.shape[0], kv.shape[1]), device=kv.device, dtype=kv.dtype)
    module.kv_proj.weight = nn.Parameter(both[: kv.shape[0]], requires_grad=False)
    module.gate_proj.weight = nn.Parameter(both[kv.shape[0] :], requires_grad=False)
    module.fused_proj = both


def projections(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ kv_projᵀ and x @ gate_projᵀ [T, width]: one product when fuse_projections made the two
    weights views of one tensor (and nothing has replaced them since), else two."""
    kv, gate = module.kv_proj.weight, module.gate_proj.weight

    def times(weight: torch.Tensor, holder: nn.Module) -> torch.Tensor:
        type_id = getattr(holder, "type_id", None)  # a GGUF's blocks (models/packed.PackedLinear)
        if type_id is None:
            return decode_kernels.linear(x, weight)
        return gguf_matmul(x, weight, type_id, x.shape[1])

    both = getattr(module, "fused_proj", None)
    if (
        both is None
        or kv.data_ptr() != both.data_ptr()
        or gate.data_ptr() != both.data_ptr() + kv.numel() * kv.element_size()
        or both.shape[0] != kv.shape[0] + gate.shape[0]
    ):
        return times(kv, module.kv_proj), times(gate, module.gate_proj)
    out = times(both, module.kv_proj)  # fused: both of one type
    return out[:, : kv.shape[0]], out[:, kv.shape[0] :]


def compress_step(
    kv: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    norm: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_gate: torch.Tensor | None,
    rows: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    stop: torch.Tensor | None = None,
) -> None:
    """Feed the T tokens at pos, pos + 1, .. (`pos`: int64 [1], on the device) to a compressor in
    order, in place; with `stop` (int64 [1]) only those below it: a prompt piece's padding leaves
    the state as it was. One kernel for all T (a verify step's or a prompt piece's tokens).

    kv, gate: the tokens' projections [T, width], rows contiguous (model dtype, gate without its bias);
    bias: position_bias [rate, width] float32; norm: kv_norm's weight [dim] float32; state_kv,
    state_gate: the open window [rate, width] float32; prev_kv, prev_gate: CSA's last closed
    window's first halves [rate, dim] float32 (None: no overlap, width = dim); rows: the entries
    [R, dim] (R may be 0); cos, sin: the compress rope tables [context, r / 2] float32."""
    _fused_op(
        kv,
        gate,
        bias,
        norm,
        state_kv,
        state_gate,
        prev_kv,
        prev_gate,
        rows,
        pos,
        cos,
        sin,
        eps,
        stop,
    )


def reference(
    kv: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    norm: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_gate: torch.Tensor | None,
    rows: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    stop: torch.Tensor | None = None,
) -> None:
    """The eager form (deepseek_v4's _decode_compress after the projections, branch-free), a
    token at a time: the entry of the window holding pos is pooled every step and written back
    unchanged unless pos closes it; the open window takes the token unless it closes (then, CSA,
    the window's first halves, the token's included, become the overlap state). Nothing changes
    unless pos < stop."""
    rate, width = state_kv.shape
    overlap = prev_kv is not None
    dim = width // 2 if overlap else width
    count = rows.shape[0]
    for t in range(kv.shape[0]):
        pos_t = pos + t
        slot = pos_t % rate  # [1]
        here = (torch.arange(rate, device=pos_t.device) == slot).unsqueeze(1)  # [rate, 1]
        closing = slot == rate - 1
        if stop is not None:
            alive = pos_t < stop
            here, closing = here & alive, closing & alive
        kv32 = kv[t].float()
        gate32 = torch.add(bias.index_select(0, slot), gate[t])  # float32, as the bias
        win_kv = torch.where(here, kv32, state_kv)
        win_gate = torch.where(here, gate32, state_gate)
        if count:
            window = torch.clamp(torch.div(pos_t, rate, rounding_mode="floor"), max=count - 1)
            start = pos_t - slot
            turn = torch.complex(cos.index_select(0, start), sin.index_select(0, start))  # [1, r / 2]
            pool_kv, pool_gate = win_kv, win_gate
            if overlap:
                assert prev_kv is not None and prev_gate is not None
                # Window 0 has no predecessor: weight 0 (its carried kv is finite: 0 * kv adds nothing).
                first_gate = torch.where(pos_t < rate, -math.inf, prev_gate)
                pool_kv = torch.cat([prev_kv, win_kv[:, dim:]])  # [2 rate, dim]
                pool_gate = torch.cat([first_gate, win_gate[:, dim:]])
            pooled = (pool_kv.t() * torch.softmax(pool_gate.t(), dim=-1)).sum(dim=-1).unsqueeze(0)
            normed = F.rms_norm(pooled, (dim,), norm, eps)
            turns = 2 * turn.shape[-1]
            rot = normed[..., -turns:]
            pairs = torch.view_as_complex(rot.unflatten(-1, (-1, 2)))
            rot.copy_(torch.view_as_real(pairs * turn).flatten(-2))
            entry = normed.to(rows.dtype)
            rows.index_copy_(0, window, torch.where(closing, entry, rows.index_select(0, window)))
        if overlap:
            assert prev_kv is not None and prev_gate is not None
            torch.where(closing, win_kv[:, :dim], prev_kv, out=prev_kv)
            torch.where(closing, win_gate[:, :dim], prev_gate, out=prev_gate)
        torch.where(closing, state_kv, win_kv, out=state_kv)
        torch.where(closing, state_gate, win_gate, out=state_gate)


@torch.library.custom_op(
    "ds4desk::v4_compress_step", mutates_args=("state_kv", "state_gate", "prev_kv", "prev_gate", "rows")
)
def _fused_op(
    kv: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    norm: torch.Tensor,
    state_kv: torch.Tensor,
    state_gate: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_gate: torch.Tensor | None,
    rows: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    stop: torch.Tensor | None = None,
) -> None:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(kv) else None
    run = reference if kernel is None else kernel
    run(kv, gate, bias, norm, state_kv, state_gate, prev_kv, prev_gate, rows, pos, cos, sin, eps, stop)


@_fused_op.register_fake
def _(
    kv, gate, bias, norm, state_kv, state_gate, prev_kv, prev_gate, rows, pos, cos, sin, eps, stop=None
) -> None:
    return None


@functools.cache
def _jit_kernel() -> Any:
    """The Triton kernel (a triton.jit function), or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit
    def kernel(
        kv_rows,
        gate_rows,
        kv_stride,
        gate_stride,
        bias,
        norm,
        state_kv,
        state_gate,
        prev_kv,
        prev_gate,
        rows,
        pos_ptr,
        stop_ptr,  # read only with HAS_STOP
        cos,
        sin,
        table_stride,
        eps,
        count,  # entry rows (> 0 when HAS_ROWS)
        RATE: tl.constexpr,
        WIDTH: tl.constexpr,  # state row width: 2 DIM with OVERLAP, else DIM
        DIM: tl.constexpr,
        HALF_P2: tl.constexpr,  # DIM / 2 rounded up to a power of two
        DIM_P2: tl.constexpr,
        WIDTH_P2: tl.constexpr,
        PAIRS: tl.constexpr,  # rotary pairs (the trailing 2 PAIRS dims rotate)
        BLOCK_R: tl.constexpr,
        OVERLAP: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        HAS_STOP: tl.constexpr,
        TOKENS: tl.constexpr,
    ):
        first = tl.load(pos_ptr)
        if HAS_STOP:  # noqa: SIM108 (a constexpr branch: stop_ptr is never read without it)
            stop = tl.load(stop_ptr)
        else:
            stop = first + TOKENS
        # The tokens in order, each seeing the state the one before left (the barrier makes its
        # stores visible to every thread of the program).
        for t in range(TOKENS):
            pos = first + t
            kv = kv_rows + t * kv_stride
            gate = gate_rows + t * gate_stride
            if pos < stop:  # else a prompt piece's padding: nothing changes
                slot = pos % RATE
                if slot != RATE - 1:
                    # The window stays open: the token's row, its gate with the position bias.
                    c = tl.arange(0, WIDTH_P2)
                    live = c < WIDTH
                    new_kv = tl.load(kv + c, mask=live, other=0.0).to(tl.float32)
                    new_gate = tl.load(gate + c, mask=live, other=0.0).to(tl.float32)
                    new_gate += tl.load(bias + slot * WIDTH + c, mask=live, other=0.0)
                    tl.store(state_kv + slot * WIDTH + c, new_kv, mask=live)
                    tl.store(state_gate + slot * WIDTH + c, new_gate, mask=live)
                else:
                    # pos closes its window (slot = RATE - 1): the token's own row stays in registers, the
                    # open-window state is left as it is (the next window overwrites it row by row).
                    if HAS_ROWS:
                        # Channels in even / odd halves, so each rotary pair (2i, 2i + 1) is one lane.
                        i = tl.arange(0, HALF_P2)
                        lane = i < DIM // 2
                        off = DIM if OVERLAP else 0  # the pooled (second) half of a CSA row
                        even = off + 2 * i
                        tok_kv_e = tl.load(kv + even, mask=lane, other=0.0).to(tl.float32)
                        tok_kv_o = tl.load(kv + even + 1, mask=lane, other=0.0).to(tl.float32)
                        tok_g_e = tl.load(gate + even, mask=lane, other=0.0).to(tl.float32)
                        tok_g_e += tl.load(bias + slot * WIDTH + even, mask=lane, other=0.0)
                        tok_g_o = tl.load(gate + even + 1, mask=lane, other=0.0).to(tl.float32)
                        tok_g_o += tl.load(bias + slot * WIDTH + even + 1, mask=lane, other=0.0)

                        # Online softmax per channel over the window's rows (and the predecessor's).
                        m_e = tl.full([HALF_P2], -float("inf"), tl.float32)
                        m_o = tl.full([HALF_P2], -float("inf"), tl.float32)
                        l_e = tl.zeros([HALF_P2], tl.float32)
                        l_o = tl.zeros([HALF_P2], tl.float32)
                        a_e = tl.zeros([HALF_P2], tl.float32)
                        a_o = tl.zeros([HALF_P2], tl.float32)
                        for r0 in range(0, RATE, BLOCK_R):
                            r = r0 + tl.arange(0, BLOCK_R)
                            old = (r < RATE - 1)[:, None] & lane[None, :]  # rows before the token's
                            tok = (r == RATE - 1)[:, None]
                            at = r[:, None] * WIDTH + even[None, :]
                            ke = tl.where(tok, tok_kv_e[None, :], tl.load(state_kv + at, mask=old, other=0.0))
                            ko = tl.where(
                                tok, tok_kv_o[None, :], tl.load(state_kv + at + 1, mask=old, other=0.0)
                            )
                            ge = tl.load(state_gate + at, mask=old, other=-float("inf"))
                            go = tl.load(state_gate + at + 1, mask=old, other=-float("inf"))
                            ge = tl.where(tok, tok_g_e[None, :], ge)
                            go = tl.where(tok, tok_g_o[None, :], go)
                            top_e = tl.max(ge, axis=0)
                            top_o = tl.max(go, axis=0)
                            if OVERLAP:
                                held = (r < RATE)[:, None] & lane[None, :]
                                p_at = r[:, None] * DIM + 2 * i[None, :]
                                pke = tl.load(prev_kv + p_at, mask=held, other=0.0)
                                pko = tl.load(prev_kv + p_at + 1, mask=held, other=0.0)
                                gone = held & (pos >= RATE)  # window 0: no predecessor (weight 0)
                                pge = tl.load(prev_gate + p_at, mask=gone, other=-float("inf"))
                                pgo = tl.load(prev_gate + p_at + 1, mask=gone, other=-float("inf"))
                                top_e = tl.maximum(top_e, tl.max(pge, axis=0))
                                top_o = tl.maximum(top_o, tl.max(pgo, axis=0))
                            # The token's row is in the first block or a later one; until a finite gate
                            # is seen, a lane's max is -inf: guard the rescale (exp(-inf - -inf) is NaN).
                            new_e = tl.maximum(m_e, top_e)
                            new_o = tl.maximum(m_o, top_o)
                            safe_e = tl.where(new_e == -float("inf"), 0.0, new_e)
                            safe_o = tl.where(new_o == -float("inf"), 0.0, new_o)
                            keep_e = tl.exp(m_e - safe_e)
                            keep_o = tl.exp(m_o - safe_o)
                            w_e = tl.exp(ge - safe_e[None, :])
                            w_o = tl.exp(go - safe_o[None, :])
                            l_e = l_e * keep_e + tl.sum(w_e, axis=0)
                            l_o = l_o * keep_o + tl.sum(w_o, axis=0)
                            a_e = a_e * keep_e + tl.sum(w_e * ke, axis=0)
                            a_o = a_o * keep_o + tl.sum(w_o * ko, axis=0)
                            if OVERLAP:
                                pw_e = tl.exp(pge - safe_e[None, :])
                                pw_o = tl.exp(pgo - safe_o[None, :])
                                l_e += tl.sum(pw_e, axis=0)
                                l_o += tl.sum(pw_o, axis=0)
                                a_e += tl.sum(pw_e * pke, axis=0)
                                a_o += tl.sum(pw_o * pko, axis=0)
                            m_e = new_e
                            m_o = new_o
                        pooled_e = tl.where(lane, a_e / l_e, 0.0)
                        pooled_o = tl.where(lane, a_o / l_o, 0.0)

                        # RMS norm with kv_norm's weight, then rotate the trailing pairs by the window
                        # start's angle (rows of the compress table at pos - slot).
                        square = tl.sum(pooled_e * pooled_e, axis=0) + tl.sum(pooled_o * pooled_o, axis=0)
                        inv = 1.0 / tl.sqrt(square / DIM + eps)
                        x_e = pooled_e * inv * tl.load(norm + 2 * i, mask=lane, other=0.0)
                        x_o = pooled_o * inv * tl.load(norm + 2 * i + 1, mask=lane, other=0.0)
                        pair = i - (DIM // 2 - PAIRS)
                        turns = lane & (pair >= 0)
                        start = pos - slot
                        c_t = tl.load(cos + start * table_stride + pair, mask=turns, other=1.0)
                        s_t = tl.load(sin + start * table_stride + pair, mask=turns, other=0.0)
                        out_e = x_e * c_t - x_o * s_t
                        out_o = x_e * s_t + x_o * c_t
                        window = tl.minimum(pos // RATE, count - 1)
                        row = rows + window * DIM + 2 * i
                        tl.store(row, out_e.to(rows.dtype.element_ty), mask=lane)
                        tl.store(row + 1, out_o.to(rows.dtype.element_ty), mask=lane)
                    if OVERLAP:
                        # Every thread has read the old overlap state before any overwrites it.
                        tl.debug_barrier()
                        d = tl.arange(0, DIM_P2)
                        cols = d < DIM
                        tok_kv = tl.load(kv + d, mask=cols, other=0.0).to(tl.float32)
                        tok_gate = tl.load(gate + d, mask=cols, other=0.0).to(tl.float32)
                        tok_gate += tl.load(bias + slot * WIDTH + d, mask=cols, other=0.0)
                        for r0 in range(0, RATE, BLOCK_R):
                            r = r0 + tl.arange(0, BLOCK_R)
                            old = (r < RATE - 1)[:, None] & cols[None, :]
                            tok = (r == RATE - 1)[:, None]
                            src = r[:, None] * WIDTH + d[None, :]
                            dst = r[:, None] * DIM + d[None, :]
                            held = (r < RATE)[:, None] & cols[None, :]
                            moved_kv = tl.where(
                                tok, tok_kv[None, :], tl.load(state_kv + src, mask=old, other=0.0)
                            )
                            moved_gate = tl.where(
                                tok, tok_gate[None, :], tl.load(state_gate + src, mask=old, other=0.0)
                            )
                            tl.store(prev_kv + dst, moved_kv, mask=held)
                            tl.store(prev_gate + dst, moved_gate, mask=held)
            if TOKENS > 1:
                tl.debug_barrier()

    return kernel


def launch_constants(
    rate: int, width: int, overlap: bool, rows: int, pairs: int, stop: bool = False, tokens: int = 1
) -> dict[str, Any]:
    """The kernel's compile-time arguments for a compressor's shapes (`stop`: the call has one;
    `tokens`: how many it feeds)."""
    dim = width // 2 if overlap else width
    half_p2 = next_power_of_two(dim // 2)
    return {
        "RATE": rate,
        "WIDTH": width,
        "DIM": dim,
        "HALF_P2": half_p2,
        "DIM_P2": next_power_of_two(dim),
        "WIDTH_P2": next_power_of_two(width),
        "PAIRS": pairs,
        # Four [BLOCK_R, DIM / 2] float32 tiles (kv and gate, even and odd; twice with the overlap)
        # per block of rows: ~1024 values a tile keeps them in registers at Flash's 512.
        "BLOCK_R": max(1, min(next_power_of_two(rate), 1024 // half_p2)),
        "OVERLAP": overlap,
        "HAS_ROWS": rows > 0,
        "HAS_STOP": stop,
        "TOKENS": tokens,
    }


@functools.cache
def _triton_kernel() -> Callable[..., None] | None:
    """The Triton launcher, or None where Triton is not importable."""
    kernel = _jit_kernel()
    if kernel is None:
        return None

    def launch(
        kv: torch.Tensor,
        gate: torch.Tensor,
        bias: torch.Tensor,
        norm: torch.Tensor,
        state_kv: torch.Tensor,
        state_gate: torch.Tensor,
        prev_kv: torch.Tensor | None,
        prev_gate: torch.Tensor | None,
        rows: torch.Tensor,
        pos: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        stop: torch.Tensor | None = None,
    ) -> None:
        rate, width = state_kv.shape
        assert kv.stride(-1) == 1 and gate.stride(-1) == 1 and state_kv.is_contiguous()
        overlap = prev_kv is not None
        count = rows.shape[0]
        dummy = state_kv  # never read without OVERLAP
        kernel[(1,)](
            kv,
            gate,
            kv.stride(0),
            gate.stride(0),
            bias,
            norm,
            state_kv,
            state_gate,
            prev_kv if overlap else dummy,
            prev_gate if overlap else dummy,
            rows,
            pos,
            pos if stop is None else stop,
            cos,
            sin,
            cos.stride(0),
            eps,
            max(count, 1),
            **launch_constants(rate, width, overlap, count, cos.shape[-1], stop is not None, kv.shape[0]),
            num_warps=4,
        )

    return on_its_device(launch)
