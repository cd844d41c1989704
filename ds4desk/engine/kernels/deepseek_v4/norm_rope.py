"""DeepSeek-V4's decode-step "RMS-norm then rotate" as one op: `norm_rope`.

A decode step's attention norms the low-rank query (q_a_norm), then norms and rotates every head of
the query (no weight) and the key/value row (kv_norm), and a CSA layer's indexer rotates its query
(no norm, kept float32). Eagerly each is the float cast, the norm, the table rows at pos, the complex
product and the cast back: 3-6 tiny kernels, ~20 a CSA layer, and inside a CUDA graph at batch 1
each costs a few µs. On NVIDIA GPUs with Triton each use is one kernel (a program a row, the row's
channels as even / odd halves so a rotary pair is one lane) that reads the position and the table
rows on the device; it launches early with programmatic dependent launch where there is one
(launch.pdl). Elsewhere (CPU, ROCm, no Triton) the eager form runs, with the same math.

The fused path goes through a torch custom op, so a CUDA graph capture and a dispatch-level op
counter (bench/count_ops.py) see one op whatever runs inside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device, pdl

# Default: the fused kernel where it can run (NVIDIA CUDA tensors, Triton importable; NVIDIA only: the
# kernel was written for CUDA, never run on ROCm, where is_cuda holds too). Forced on: always through
# the custom op (on the CPU its body is the eager math of `reference`: what bench/count_ops.py uses to
# count a fused step without a GPU); off: the model's own eager ops.
SWITCH = Switch(
    "deepseek_v4.norm_rope",
    "DeepSeek-V4's RMS-norm then rotate (queries, keys, the indexer's queries) as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)


def enabled(where: Where) -> bool:
    """Whether the model should call `norm_rope` for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    rope_dims: int,
    out_dtype: torch.dtype,
    group: int = 0,
) -> torch.Tensor:
    """x [R, C] RMS-normed per row in float32 (eps None: no norm), times the float32 `weight` when
    given, the trailing `rope_dims` channels (0: none) rotated in interleaved pairs (2i, 2i + 1) by
    the angle of table row pos + r // group for row r (cos, sin [positions, rope_dims / 2] float32,
    pos int64 [1] on the device; group 0: every row at pos, as a decode step's heads; a prefill's
    [T * H, d] query rows are group H), then cast once to `out_dtype`: a new [R, C] tensor. Always
    the custom op (see `enabled` for when the model takes this path)."""
    _check(x, weight, eps, cos, sin, pos, rope_dims)
    if group < 0:
        raise ValueError(f"group must be 0 or positive, got {group}")
    return _fused_op(x.contiguous(), weight, eps, cos, sin, pos, rope_dims, out_dtype, group)


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    rope_dims: int,
    out_dtype: torch.dtype,
    group: int = 0,
) -> torch.Tensor:
    """The eager form: deepseek_v4's _rms_norm, _norm_rope and _rope_ (with _turn of each row's table
    row, see norm_rope for `group`), op for op. Never aliases x (the rotation is in place on a fresh
    float32 copy)."""
    y = x.to(torch.float32, copy=True) if eps is None else F.rms_norm(x.float(), (x.shape[-1],), weight, eps)
    if rope_dims:
        rows = pos + torch.arange(x.shape[0], device=x.device) // _group(group, x)
        turn = torch.complex(cos.index_select(0, rows), sin.index_select(0, rows))  # [R, r / 2]
        rot = y[..., -rope_dims:]
        pairs = torch.view_as_complex(rot.unflatten(-1, (-1, 2)))
        rot.copy_(torch.view_as_real(pairs * turn).flatten(-2))
    return y.to(out_dtype)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    rope_dims: int,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"norm_rope takes rows [R, C], got shape {tuple(x.shape)}")
    if weight is not None and (eps is None or weight.shape != (x.shape[1],)):
        raise ValueError("a norm weight needs eps and one value per channel")
    if rope_dims and (rope_dims != 2 * cos.shape[-1] or rope_dims > x.shape[1] or x.shape[1] % 2):
        raise ValueError(
            f"rope_dims {rope_dims} must be 0 or twice the table width {cos.shape[-1]}, within an even C"
        )
    if cos.shape != sin.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("cos and sin are float32 tables of one shape")
    if pos.shape != (1,) or pos.dtype != torch.int64:
        raise ValueError("pos is an int64 tensor [1]")


@torch.library.custom_op("ds4desk::v4_norm_rope", mutates_args=())
def _fused_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    rope_dims: int,
    out_dtype: torch.dtype,
    group: int,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(x) else None
    run = reference if kernel is None else kernel
    return run(x, weight, eps, cos, sin, pos, rope_dims, out_dtype, group)


@_fused_op.register_fake
def _(x, weight, eps, cos, sin, pos, rope_dims, out_dtype, group):
    return x.new_empty(x.shape, dtype=out_dtype)


def _group(group: int, x: torch.Tensor) -> int:
    """Rows a table row serves: 0 means all of them."""
    return group or max(1, x.shape[0])


def launch_constants(channels: int, rope_dims: int, norm: bool, weighted: bool) -> dict[str, Any]:
    """The kernel's compile-time arguments for rows of `channels` (PDL is added at launch)."""
    return {
        "C": channels,
        "HALF_P2": next_power_of_two((channels + 1) // 2),
        "PAIRS": rope_dims // 2,
        "NORM": norm,
        "WEIGHTED": weighted,
    }


def _warps(channels: int) -> int:
    # Two channels a lane: a warp per 64 lanes' worth up to 4 warps (Flash's 1024-wide q_res).
    return max(1, min(4, next_power_of_two((channels + 1) // 2) // 64))


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
        x,
        weight,
        cos,
        sin,
        pos_ptr,
        out,
        stride_x,
        table_stride,
        group,
        eps,
        C: tl.constexpr,
        HALF_P2: tl.constexpr,  # ceil(C / 2) rounded up to a power of two
        PAIRS: tl.constexpr,  # rotary pairs: the trailing 2 PAIRS channels rotate (0: none)
        NORM: tl.constexpr,
        WEIGHTED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # x is the kernel before's output: nothing to read before it is done
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        # Even and odd channels in two vectors: a rotary pair (2i, 2i + 1) is lane i of both.
        i = tl.arange(0, HALF_P2)
        even = 2 * i
        has_e = even < C
        has_o = even + 1 < C
        src = x + row * stride_x + even
        v_e = tl.load(src, mask=has_e, other=0.0).to(tl.float32)
        v_o = tl.load(src + 1, mask=has_o, other=0.0).to(tl.float32)
        if NORM:
            square = tl.sum(v_e * v_e, axis=0) + tl.sum(v_o * v_o, axis=0)
            inv = tl.rsqrt(square / C + eps)
            v_e = v_e * inv
            v_o = v_o * inv
            if WEIGHTED:  # the float32 weight multiplies before the cast, as F.rms_norm
                v_e = v_e * tl.load(weight + even, mask=has_e, other=0.0).to(tl.float32)
                v_o = v_o * tl.load(weight + even + 1, mask=has_o, other=0.0).to(tl.float32)
        if PAIRS > 0:
            pos = tl.load(pos_ptr) + row // group
            pair = i - (C // 2 - PAIRS)
            turns = has_o & (pair >= 0)
            c = tl.load(cos + pos * table_stride + pair, mask=turns, other=1.0)
            s = tl.load(sin + pos * table_stride + pair, mask=turns, other=0.0)
            r_e = v_e * c - v_o * s
            r_o = v_e * s + v_o * c
            v_e = r_e
            v_o = r_o
        dst = out + row * C + even
        tl.store(dst, v_e.to(out.dtype.element_ty), mask=has_e)
        tl.store(dst + 1, v_o.to(out.dtype.element_ty), mask=has_o)

    return kernel


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton launcher, or None where Triton is not importable."""
    kernel = _jit_kernel()
    if kernel is None:
        return None

    def launch(
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        rope_dims: int,
        out_dtype: torch.dtype,
        group: int = 0,
    ) -> torch.Tensor:
        rows, channels = x.shape
        assert x.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(0) == cos.stride(0)
        out = torch.empty((rows, channels), device=x.device, dtype=out_dtype)
        use_pdl = pdl(x)
        kernel[(rows,)](
            x,
            weight if weight is not None else cos,  # never read without WEIGHTED
            cos,
            sin,
            pos,
            out,
            x.stride(0),
            cos.stride(0),
            _group(group, x),
            0.0 if eps is None else eps,
            **launch_constants(channels, rope_dims, eps is not None, weight is not None),
            PDL=use_pdl,
            num_warps=_warps(channels),
            launch_pdl=use_pdl,
        )
        return out

    return on_its_device(launch)
