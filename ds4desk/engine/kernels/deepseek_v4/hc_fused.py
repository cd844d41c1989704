"""DeepSeek-V4's hyper-connection sites in two kernels: expand + mix, then weights + collapse + norm.

A site eagerly is `_expand` of the previous block (cat, cast, bmm), `_hc_mix` (cast, rms_norm, mm
with fn), hc_weights, `_collapse` and `_rms_norm`: ~9 kernels, and a decode step at batch 1 has two
sites a layer. The RMS factor of the mix is one scalar per token, so z = (flat · fnᵀ) · rsqrt(mean
flat² + eps): a split-K kernel over the flattened m·D dim writes its slice of the new streams and
its partial dot products with fn's rows plus its partial sum of squares (one float32 row per block);
a second kernel sums the partials and collapses + norms the new streams into the block input (at
decode a token's D columns spread over several programs), while one more program per token makes
[pre | post] and the Sinkhorn matrix beside them. Neither kernel reads a device
value on the host or sizes anything by one: both can be captured in a CUDA graph.

The pieces are also ops of their own, used by the head: `expand_mix` (the new streams and z) and
`collapse_norm` (the block input from given gates).

Each fused op is a torch custom op (one op for a graph capture and for bench/count_ops.py) whose
body is the Triton kernels on NVIDIA GPUs and the eager math (`reference_*`, the model's current
ops) elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.deepseek_v4 import hc_kernel as v4_hc_kernel
from ds4desk.engine.kernels.launch import (
    Switch,
    Where,
    is_power_of_two,
    next_power_of_two,
    nvidia,
    on_its_device,
    pdl,
)

# Default: the fused kernels where they can run (NVIDIA CUDA tensors, Triton importable, hc_mult a
# power of 2; NVIDIA only: the kernels were written for and checked on CUDA, never on ROCm). Forced
# on: always through the custom ops (on the CPU their bodies are the eager math: what
# bench/count_ops.py uses to count a fused step without a GPU); off: the model's eager ops.
SWITCH = Switch(
    "deepseek_v4.hc_fused",
    "DeepSeek-V4's hyper-connection sites (expand + mix, weights + collapse + norm) in two kernels",
    lambda where, mult: nvidia(where) and is_power_of_two(mult) and _kernels() is not None,
)

# Flattened-dim block of the split-K mix kernel, per stream: fn's tile is [rows padded, m * 32].
_MIX_BLOCK = 32
# D block of the collapse loops (the sum of squares over the row, then the normed output).
_COLLAPSE_BLOCK = 1024
# Columns of h a program writes when a site has few tokens (decode): the token's collapse is spread
# over D / 256 programs, each of which recomputes the row's sum of squares from L2. With many tokens
# (prefill) a program writes its token's whole row, so the row is read from memory about twice.
_COLLAPSE_SLICE = 256
_FEW_TOKENS = 16
# Above _FEW_TOKENS the mix runs on tiled_mix_kernel (tokens and dims a program, per step; the tiles
# from bench/profile_v4_prefill.py --mix-sweep on an H200), after expand_kernel's D blocks.
_TILED_MIX_TOKENS = 128
_TILED_MIX_BLOCK = 64
_TILED_MIX_WARPS = 8
_TILED_MIX_STAGES = 3
_EXPAND_BLOCK = 512


def enabled(where: Where, mult: int) -> bool:
    """Whether a site on tensors on `where` with hc_mult `mult` goes through the fused ops (a host
    decision, made once a step; see SWITCH)."""
    return SWITCH.on(where, mult)


# --- the eager math (the model's ops, spelled as deepseek_v4 spells them) -------------------------


def reference_expand(
    streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """X'_k = post_k y + Σ_j C[j, k] X_j in the streams' dtype (deepseek_v4._expand)."""
    mix = torch.cat([comb.transpose(1, 2), post.unsqueeze(-1)], dim=-1).to(streams.dtype)
    return torch.bmm(mix, torch.cat([streams, y.unsqueeze(1)], dim=1))


def reference_mix(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(flat streams) · fnᵀ, float32 [T, rows] (deepseek_v4._hc_mix's z)."""
    flat = streams.reshape(streams.shape[0], -1).float()
    return torch.mm(F.rms_norm(flat, (flat.shape[-1],), None, eps), fn.t())


def reference_collapse_norm(
    streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """rms_norm(Σ_j pre_j X_j) · weight in float32, cast once (deepseek_v4._collapse + _rms_norm)."""
    collapsed = torch.bmm(pre.unsqueeze(1), streams.float()).squeeze(1)
    return F.rms_norm(collapsed, (collapsed.shape[-1],), weight, eps).to(dtype)


def reference_site(
    streams: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    weight: torch.Tensor,
    mult: int,
    iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A site on given streams: (block input h [T, D], gates [pre | post] [T, 2m], comb [T, m, m])."""
    z = reference_mix(streams, fn, eps)
    gates, comb = v4_hc_kernel.hc_weights(z, scale, base, mult, iters, hc_eps)
    h = reference_collapse_norm(streams, gates[:, :mult], weight, eps, streams.dtype)
    return h, gates, comb


# --- custom ops --------------------------------------------------------------------------------


@torch.library.custom_op("ds4desk::v4_hc_expand_mix", mutates_args=())
def _expand_mix_op(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if SWITCH.kernel_runs_on(streams):
        new, z = _kernels().mix(streams, y, post, comb, fn, eps)
        assert new is not None
        return new, z
    new = reference_expand(streams, y, post, comb)
    return new, reference_mix(new, fn, eps)


@_expand_mix_op.register_fake
def _(streams, y, post, comb, fn, eps):
    return torch.empty_like(streams), streams.new_empty((streams.shape[0], fn.shape[0]), dtype=torch.float32)


@torch.library.custom_op("ds4desk::v4_hc_collapse_norm", mutates_args=())
def _collapse_norm_op(
    streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    if SWITCH.kernel_runs_on(streams):
        return _kernels().collapse_norm(streams, pre, weight, eps, dtype)
    return reference_collapse_norm(streams, pre, weight, eps, dtype)


@_collapse_norm_op.register_fake
def _(streams, pre, weight, eps, dtype):
    return streams.new_empty((streams.shape[0], streams.shape[2]), dtype=dtype)


def _site_impl(
    streams: torch.Tensor,
    y: torch.Tensor | None,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    weight: torch.Tensor,
    mult: int,
    iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    if SWITCH.kernel_runs_on(streams):
        return _kernels().site(streams, y, post, comb, fn, scale, base, weight, iters, hc_eps, eps)
    new = None
    if y is not None:
        assert post is not None and comb is not None
        new = streams = reference_expand(streams, y, post, comb)
    h, gates, new_comb = reference_site(streams, fn, scale, base, weight, mult, iters, hc_eps, eps)
    return new, h, gates, new_comb.contiguous()


@torch.library.custom_op("ds4desk::v4_hc_site", mutates_args=())
def _site_op(
    streams: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    weight: torch.Tensor,
    mult: int,
    iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, h, gates, comb = _site_impl(
        streams, None, None, None, fn, scale, base, weight, mult, iters, hc_eps, eps
    )
    return h, gates, comb


@_site_op.register_fake
def _(streams, fn, scale, base, weight, mult, iters, hc_eps, eps):
    count = streams.shape[0]
    return (
        streams.new_empty((count, streams.shape[2])),
        streams.new_empty((count, 2 * mult), dtype=torch.float32),
        streams.new_empty((count, mult, mult), dtype=torch.float32),
    )


@torch.library.custom_op("ds4desk::v4_hc_expand_site", mutates_args=())
def _expand_site_op(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    weight: torch.Tensor,
    mult: int,
    iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    new, h, gates, new_comb = _site_impl(
        streams, y, post, comb, fn, scale, base, weight, mult, iters, hc_eps, eps
    )
    assert new is not None
    return new, h, gates, new_comb


@_expand_site_op.register_fake
def _(streams, y, post, comb, fn, scale, base, weight, mult, iters, hc_eps, eps):
    count = streams.shape[0]
    return (
        torch.empty_like(streams),
        streams.new_empty((count, streams.shape[2])),
        streams.new_empty((count, 2 * mult), dtype=torch.float32),
        streams.new_empty((count, mult, mult), dtype=torch.float32),
    )


# --- the public face -----------------------------------------------------------------------------


def expand_mix(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new streams X'_k = post_k y + Σ_j C[j, k] X_j (rounded to the streams' dtype) and
    z = rms_norm(flat X') · fnᵀ (float32), as one op."""
    return _expand_mix_op(streams.contiguous(), y.contiguous(), post, comb.contiguous(), fn, eps)


def collapse_norm(
    streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """rms_norm(Σ_j pre_j X_j) · weight in float32, cast once to `dtype`, [T, D], as one op."""
    return _collapse_norm_op(streams.contiguous(), pre, weight, eps, dtype)


def site(
    streams: torch.Tensor,
    previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    weight: torch.Tensor,
    mult: int,
    iters: int,
    hc_eps: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One hyper-connection site, after expanding the previous block's (y, post, comb) into the
    streams when `previous` is given: (the streams [T, m, D], the block input h [T, D] in the streams'
    dtype, post [T, m] and comb [T, m, m] float32 for the next expand)."""
    streams = streams.contiguous()
    if previous is None:
        h, gates, comb = _site_op(streams, fn, scale, base, weight, mult, iters, hc_eps, eps)
    else:
        y, post, prev_comb = previous
        streams, h, gates, comb = _expand_site_op(
            streams,
            y.contiguous(),
            post,
            prev_comb.contiguous(),
            fn,
            scale,
            base,
            weight,
            mult,
            iters,
            hc_eps,
            eps,
        )
    return streams, h, gates[:, mult:], comb


# --- the Triton kernels --------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Kernels:
    """The launchers (built once Triton is imported)."""

    mix: Callable[..., Any]
    collapse_norm: Callable[..., Any]
    site: Callable[..., Any]


@functools.cache
def _kernels() -> _Kernels | None:
    """The Triton launchers, or None where Triton is not importable."""
    try:
        import triton

        from ds4desk.engine.kernels.deepseek_v4.hc_fused_triton import (
            collapse_kernel,
            expand_kernel,
            finish_kernel,
            mix_kernel,
            site_kernel,
            tiled_mix_kernel,
        )
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    def mix_partials(
        streams: torch.Tensor,
        y: torch.Tensor | None,
        post: torch.Tensor | None,
        comb: torch.Tensor | None,
        fn: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(the new streams or the given ones, the partials [T, blocks, RP], blocks, R)."""
        count, m, dim = streams.shape
        rows = fn.shape[0]
        expand = y is not None
        out = torch.empty_like(streams) if expand else streams
        if count > _FEW_TOKENS:
            return tiled_mix(streams, y, post, comb, fn, out)
        padded = next_power_of_two(rows + 1)  # + 1: the sum of squares rides in row `rows`
        block = min(_MIX_BLOCK, next_power_of_two(dim))
        blocks = triton.cdiv(dim, block)
        part = torch.empty((count, blocks, padded), device=streams.device, dtype=torch.float32)
        use_pdl = pdl(streams)
        mix_kernel[(blocks, count)](
            streams,
            y if expand else streams,
            post if expand else fn,
            comb if expand else fn,
            fn,
            out,
            part,
            dim,
            post.stride(0) if post is not None else 0,
            EXPAND=expand,
            M=m,
            R=rows,
            RP=padded,
            BD=block,
            PDL=use_pdl,
            launch_pdl=use_pdl,
        )
        return out, part, blocks, rows

    def tiled_mix(
        streams: torch.Tensor,
        y: torch.Tensor | None,
        post: torch.Tensor | None,
        comb: torch.Tensor | None,
        fn: torch.Tensor,
        out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """mix_partials for many tokens: the expand (when y is given) as a kernel of its own, then
        token blocks x splits of D with the dots on tensor cores."""
        count, m, dim = streams.shape
        if y is not None:
            assert post is not None and comb is not None
            block = min(_EXPAND_BLOCK, next_power_of_two(dim))
            expand_kernel[(triton.cdiv(dim, block), count)](
                streams, y, post, comb, out, dim, post.stride(0), M=m, BD=block
            )
            streams = out
        rows = fn.shape[0]
        padded = max(16, next_power_of_two(rows + 1))  # a dot's tile is at least 16 wide
        block_d = max(16, min(_TILED_MIX_BLOCK, next_power_of_two(dim)))
        token_blocks, dim_blocks = triton.cdiv(count, _TILED_MIX_TOKENS), triton.cdiv(dim, block_d)
        # Splits of D until the grid fills an H200 once to twice over (132 SMs), whole blocks each.
        # The split follows the token blocks' power of two, not their count: STEPS is a constexpr
        # (Triton's interpreter takes no runtime loop bound), and the load's warm-up runs a prompt
        # in every power-of-two class, so no prompt length meets a variant it did not compile.
        fill = triton.cdiv(264, next_power_of_two(token_blocks))
        steps = triton.cdiv(dim_blocks, min(dim_blocks, fill))
        splits = triton.cdiv(dim_blocks, steps)
        part = torch.empty((count, splits, padded), device=streams.device, dtype=torch.float32)
        tiled_mix_kernel[(token_blocks, splits)](
            streams,
            fn,
            part,
            count,
            dim,
            M=m,
            R=rows,
            RP=padded,
            BT=_TILED_MIX_TOKENS,
            BD=block_d,
            STEPS=steps,
            # The interpreter's dot mishandles bfloat16 (numpy has none): float32 there.
            SPLIT_DOT=streams.dtype == torch.bfloat16 and streams.is_cuda,
            num_warps=_TILED_MIX_WARPS,
            num_stages=_TILED_MIX_STAGES,
        )
        return out, part, splits, rows

    def launch_mix(
        streams: torch.Tensor,
        y: torch.Tensor | None,
        post: torch.Tensor | None,
        comb: torch.Tensor | None,
        fn: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        _check_post(post)
        out, part, blocks, rows = mix_partials(streams, y, post, comb, fn)
        count, m, dim = streams.shape
        z = torch.empty((count, rows), device=streams.device, dtype=torch.float32)
        use_pdl = pdl(streams)
        finish_kernel[(count,)](
            part,
            z,
            blocks,
            m * dim,
            eps,
            R=rows,
            RP=part.shape[2],
            NB=next_power_of_two(blocks),
            PDL=use_pdl,
            launch_pdl=use_pdl,
        )
        return (out if y is not None else None), z

    def launch_collapse_norm(
        streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
    ) -> torch.Tensor:
        _check_post(pre)
        count, m, dim = streams.shape
        h = torch.empty((count, dim), device=streams.device, dtype=dtype)
        use_pdl = pdl(streams)
        block, columns = _collapse_layout(count, dim)
        collapse_kernel[(triton.cdiv(dim, columns), count)](
            streams,
            pre,
            pre.stride(0),
            weight,
            h,
            dim,
            eps,
            M=m,
            BD=block,
            SLICE=columns,
            PDL=use_pdl,
            launch_pdl=use_pdl,
        )
        return h

    def launch_site(
        streams: torch.Tensor,
        y: torch.Tensor | None,
        post: torch.Tensor | None,
        comb: torch.Tensor | None,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        weight: torch.Tensor,
        iters: int,
        hc_eps: float,
        eps: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        _check_post(post)
        out, part, blocks, rows = mix_partials(streams, y, post, comb, fn)
        count, m, dim = streams.shape
        gates = torch.empty((count, 2 * m), device=streams.device, dtype=torch.float32)
        new_comb = torch.empty((count, m, m), device=streams.device, dtype=torch.float32)
        h = torch.empty((count, dim), device=streams.device, dtype=streams.dtype)
        use_pdl = pdl(streams)
        block, columns = _collapse_layout(count, dim)
        site_kernel[(triton.cdiv(dim, columns) + 1, count)](  # + 1: the gates' program
            part,
            out,
            scale,
            base,
            weight,
            gates,
            new_comb,
            h,
            blocks,
            dim,
            eps,
            hc_eps,
            ITERS=iters,
            M=m,
            R=rows,
            RP=part.shape[2],
            NB=next_power_of_two(blocks),
            BD=block,
            SLICE=columns,
            PDL=use_pdl,
            launch_pdl=use_pdl,
        )
        return (out if y is not None else None), h, gates, new_comb

    return _Kernels(
        on_its_device(launch_mix), on_its_device(launch_collapse_norm), on_its_device(launch_site)
    )


def _collapse_layout(count: int, dim: int) -> tuple[int, int]:
    """(the D block of the collapse loops, the columns of h a program writes)."""
    block = min(_COLLAPSE_BLOCK, next_power_of_two(dim))
    columns = min(_COLLAPSE_SLICE, block) if count <= _FEW_TOKENS else next_power_of_two(dim)
    return block, columns


def _check_post(gates: torch.Tensor | None) -> None:
    """post / pre may be column slices of the gates (a row stride, unit column stride)."""
    if gates is not None and gates.stride(-1) != 1:
        raise ValueError("the hyper-connection gates must have a unit column stride")
