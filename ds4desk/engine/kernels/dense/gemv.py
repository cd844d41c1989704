"""Fused kernels for the graphed decode step (batch 1, one token).

A dense layer of the step was ~17 kernels: four weight GEMVs (cuBLAS), two RMSNorms, three for the
rotary embedding, the cache write, SiLU and the product, the residual copies of two addmm, and the
attention pair. Inside a captured graph each costs ~2-3 µs of launch and tail however little it
does, which at 16 layers was a third of the step. Here a layer is seven kernels:

- `norm_gemv`: RMSNorm folded into the GEMV that reads its output (every program re-reads the 4-16 KB
  input row from L2 and computes the norm itself, so the normed row never exists in memory);
- `rope_write`: RoPE (and Qwen3's per-head norm) on the queries in place and on the keys, which go
  straight into the cache at the position read on the device, with the values;
- `gemv_add_`: a GEMV whose result is added into the residual in place, optionally reading SiLU(g)·u
  from the gate/up row as its input (the MLP's activation is never stored either).

DeepSeek-V4 uses the same GEMV for its bf16 one-row linears and head (`gemv`) and for its routed
experts (`experts_gemv`: the picked experts' rows by id on the device, the clamped SwiGLU folded
into the down projection's input).

The GEMVs stream the weight rows at close to the copy bandwidth, and on Hopper they launch early
(launch.PDL) to stream their first tile while the kernel before them ends; tiles never cross
a row end (K a multiple of BLOCK_K, N of BLOCK_N), which every checkpoint this app runs satisfies.
`enabled` says where the kernels run (NVIDIA GPUs with Triton: see SWITCH) and the models keep their
torch form elsewhere. `reference_*` are the same math in torch, for the tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, nvidia, on_its_device, pdl

# Default: the kernels where they can run (NVIDIA CUDA tensors, Triton importable). Forced on: always
# (the tests, on Triton's interpreter); off: the torch form. There is no custom op around them: the
# models call them inside their graphed decode step, where this says they run.
SWITCH = Switch(
    "dense.gemv",
    "the decode step's fused GEMVs (RMSNorm + GEMV, GEMV + residual, RoPE + cache write, experts)",
    lambda where: nvidia(where) and _kernels() is not None,
)

# (BLOCK_N, BLOCK_K, num_warps) forced for every shape: what the sweep tries settings with.
OVERRIDE: tuple[int, int, int] | None = None


def enabled(where: Where) -> bool:
    """Whether the GEMV kernels run for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight can take the GEMV kernels (rows contiguous, tiles that divide it)."""
    n, k = weight.shape
    return weight.stride(1) == 1 and n % 4 == 0 and k % 64 == 0


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [1, K] @ weightᵀ runs on the GEMV kernel (faster than cuBLAS at one row)."""
    return (
        x.shape[0] == 1
        and x.is_contiguous()
        and x.dtype == weight.dtype
        and enabled(x.device)
        and fits(weight)
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weightᵀ in x's dtype: the GEMV kernel for one row where it runs, else torch."""
    if one_row(x, weight):
        return gemv(x, weight, x.new_empty((1, weight.shape[0])))
    return x @ weight.t()


def fits_heads(head_dim: int) -> bool:
    """rope_write holds a head in one power-of-two block."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). The H200 sweep (`python3 bench/decode_kernels.py --sweep`,
    docs/BENCHMARKS.md) was fastest on every shape of the 1.07B model with 4 rows by 1024 columns a
    tile: many small programs, each a long contiguous run per row; 8 warps for the long rows of the
    down projection. Wide tiles were up to 12x slower on the 49,152-row head."""
    if OVERRIDE is not None:
        return OVERRIDE
    block_k = next(size for size in (1024, 512, 256, 128, 64) if k % size == 0)
    return 4, block_k, 8 if k >= 8192 else 4


# --- torch forms (the tests' reference) -----------------------------------------------------------


def reference_norm_gemv(
    x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    h = F.rms_norm(x, (x.shape[-1],), norm, eps)
    return F.linear(h, weight, bias)


def reference_gemv_add_(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    if silu:
        gate, up = x.chunk(2, dim=-1)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        x = F.silu(gate) * up
    return residual.add_(F.linear(x, weight, bias))


def reference_experts_gemv(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None
) -> torch.Tensor:
    picked = weight.index_select(0, ids)  # [k, R, K]
    if swiglu_limit is None:
        inputs = x.expand(ids.numel(), -1)
    else:
        gate, up = x.chunk(2, dim=-1)
        inputs = F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
    return torch.einsum("erk,ek->er", picked, inputs)


def reference_rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    cache: torch.Tensor,
    heads: int,
    qk_norm: torch.Tensor | None,
    eps: float,
) -> None:
    kv_heads, dim = cache.shape[1], cache.shape[3]
    swap = torch.arange(dim, device=qkv.device).roll(dim // 2)
    for token in range(qkv.shape[0]):
        at = pos + token
        rows = qkv[token].view(heads + 2 * kv_heads, dim)
        qk = rows[: heads + kv_heads]
        src = qk.float()
        if qk_norm is not None:
            src = F.rms_norm(src, (dim,), None, eps).to(qkv.dtype).float() * qk_norm.float()
        c, s = cos.index_select(0, at).float(), sin.index_select(0, at).float()
        qk.copy_(src * c + src[:, swap] * s)
        cache.index_copy_(2, at, rows[heads:].view(2, kv_heads, 1, dim))


# --- the kernels ----------------------------------------------------------------------------------


def norm_gemv(
    x: torch.Tensor,
    norm: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [1, N] = RMSNorm(x [1, K]; norm) @ weightᵀ (+ bias), in out's dtype (float32 for logits)."""
    kernels = _kernels()
    assert kernels is not None
    kernels.gemv(x, weight, out, bias, norm, eps, with_norm=True, silu=False, residual=False)
    return out


def gemv_add_(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """residual [1, N] += x @ weightᵀ (+ bias), rounded once; silu: x is [1, 2K] gate | up and the
    input is SiLU(gate) · up (with swiglu_limit: SiLU(min(gate, limit)) · clamp(up, ±limit))."""
    kernels = _kernels()
    assert kernels is not None
    kernels.gemv(
        x, weight, residual, bias, None, 0.0, with_norm=False, silu=silu, residual=True, limit=swiglu_limit
    )
    return residual


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [1, N] = x [1, K] @ weight [N, K]ᵀ, in out's dtype."""
    kernels = _kernels()
    assert kernels is not None
    kernels.gemv(x, weight, out, None, None, 0.0, with_norm=False, silu=False, residual=False)
    return out


def experts_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """out [k, R] = row i: weight[ids[i]] [R, K] @ input_i, for a mixture of experts' picked experts
    (ids int [k], read on the device: weight [E, R, K] is never gathered). Without swiglu_limit every
    input_i is x [1, K]; with it, x is [k, 2K] (gate | up of each pick) and input_i is
    SiLU(min(gate, limit)) · clamp(up, ±limit)."""
    kernels = _kernels()
    assert kernels is not None
    experts, rows, _ = weight.shape
    kernels.gemv(
        x,
        weight.view(experts * rows, -1),
        out,
        None,
        None,
        0.0,
        with_norm=False,
        silu=swiglu_limit is not None,
        residual=False,
        ids=ids,
        group_rows=rows,
        limit=swiglu_limit,
        out_rows=ids.numel() * rows,
    )
    return out


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    cache: torch.Tensor,
    heads: int,
    qk_norm: torch.Tensor | None,
    eps: float,
) -> None:
    """Rotate the queries of qkv [T, (H + 2 KV) D] in place and write the rotated keys and the
    values into cache [2, KV, context, D] at positions pos..pos+T-1 (pos: int64 [1] on the device);
    cos / sin [context, D] are the model's tables (the sign of rotate_half folded into sin)."""
    kernels = _kernels()
    assert kernels is not None
    kernels.rope_write(qkv, cos, sin, pos, cache, heads, qk_norm, eps)


@dataclass(slots=True)
class _Kernels:
    gemv: Callable[..., None]
    rope_write: Callable[..., None]


@functools.cache
def _kernels() -> _Kernels | None:
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the torch form runs
        return None

    @triton.jit
    def gemv_kernel(
        x,
        w,
        out,
        bias,
        norm,
        ids,
        stride_w,
        stride_x,
        group_rows,
        eps,
        limit,
        K: tl.constexpr,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        IDS: tl.constexpr,
        LIMIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        first = tl.program_id(0) * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        if IDS:  # rows of the picked experts: the ids come from an earlier kernel, so wait first
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            slot = first // group_rows  # BLOCK_N divides group_rows: one pick a program
            expert = tl.load(ids + slot).to(tl.int64)
            rows = w + (expert * group_rows + n - slot * group_rows)[:, None] * stride_w + kk[None, :]
            x += slot * stride_x
            tile = tl.load(rows)
        else:
            rows = w + n.to(tl.int64)[:, None] * stride_w + kk[None, :]
            # No earlier kernel writes the weights: the first tile streams in while that kernel ends.
            tile = tl.load(rows)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
        rstd = 1.0
        if NORM:  # the row is a few KB and hot in L2: every program computes its norm
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                v = tl.load(x + k0 + kk).to(tl.float32)
                squares += v * v
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # The input row's columns, rounded to the weight dtype as torch's normed or activated
            # row would be.
            if SILU:
                g = tl.load(x + k0 + kk).to(tl.float32)
                u = tl.load(x + K + k0 + kk).to(tl.float32)
                if LIMIT:  # DeepSeek-V4's clamped SwiGLU
                    g = tl.minimum(g, limit)
                    u = tl.minimum(tl.maximum(u, -limit), limit)
                v = (g * tl.sigmoid(g) * u).to(w.dtype.element_ty).to(tl.float32)
            elif NORM:
                v = tl.load(x + k0 + kk).to(tl.float32) * rstd
                v = (v * tl.load(norm + k0 + kk).to(tl.float32)).to(w.dtype.element_ty).to(tl.float32)
            else:
                v = tl.load(x + k0 + kk).to(tl.float32)
            acc += tile.to(tl.float32) * v[None, :]
            tile = tl.load(rows + k0 + BLOCK_K, mask=k0 + BLOCK_K < K, other=0.0)
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(bias + n).to(tl.float32)
        if RESIDUAL:
            y += tl.load(out + n).to(tl.float32)
        tl.store(out + n, y.to(out.dtype.element_ty))

    @triton.jit
    def rope_write_kernel(
        qkv,
        cos,
        sin,
        pos_ptr,
        cache,
        qk_norm,
        eps,
        stride_row,
        stride_table,
        stride_kind,
        stride_head,
        stride_pos,
        HEADS: tl.constexpr,
        KV: tl.constexpr,
        D: tl.constexpr,
        QK_NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        head = tl.program_id(0)  # queries, then keys, then values
        token = tl.program_id(1)  # the token's row of qkv, at the position after the first's
        pos = tl.load(pos_ptr) + token
        d = tl.arange(0, D)
        row = qkv + token * stride_row + head * D
        v = tl.load(row + d).to(tl.float32)
        if head < HEADS + KV:
            partner = tl.load(row + (d + D // 2) % D).to(tl.float32)
            if QK_NORM:  # the normed row is rounded to the model dtype before its weight, as in torch
                rstd = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
                weight = tl.load(qk_norm + head * D + d).to(tl.float32)
                weight_partner = tl.load(qk_norm + head * D + (d + D // 2) % D).to(tl.float32)
                v = (v * rstd).to(qkv.dtype.element_ty).to(tl.float32) * weight
                partner = (partner * rstd).to(qkv.dtype.element_ty).to(tl.float32) * weight_partner
            c = tl.load(cos + pos * stride_table + d).to(tl.float32)
            s = tl.load(sin + pos * stride_table + d).to(tl.float32)
            v = v * c + partner * s
            if head < HEADS:
                tl.store(row + d, v.to(qkv.dtype.element_ty))
            else:
                at = cache + (head - HEADS) * stride_head + pos * stride_pos
                tl.store(at + d, v.to(cache.dtype.element_ty))
        else:
            at = cache + stride_kind + (head - HEADS - KV) * stride_head + pos * stride_pos
            tl.store(at + d, v.to(cache.dtype.element_ty))

    def gemv(
        x: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None,
        norm: torch.Tensor | None,
        eps: float,
        *,
        with_norm: bool,
        silu: bool,
        residual: bool,
        ids: torch.Tensor | None = None,
        group_rows: int = 0,
        limit: float | None = None,
        out_rows: int | None = None,
    ) -> None:
        n, k = weight.shape
        block_n, block_k, warps = gemv_config(n, k)
        use_pdl = pdl(x)
        gemv_kernel[((out_rows or n) // block_n,)](
            x,
            weight,
            out,
            bias if bias is not None else out,
            norm if norm is not None else x,
            ids if ids is not None else x,
            weight.stride(0),
            x.stride(0) if ids is not None and x.shape[0] > 1 else 0,  # an input row a pick
            max(group_rows, 1),
            eps,
            0.0 if limit is None else limit,
            K=k,
            HAS_BIAS=bias is not None,
            IDS=ids is not None,
            LIMIT=limit is not None,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            NORM=with_norm,
            SILU=silu,
            RESIDUAL=residual,
            PDL=use_pdl,
            num_warps=warps,
            launch_pdl=use_pdl,
        )

    def rope(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        cache: torch.Tensor,
        heads: int,
        qk_norm: torch.Tensor | None,
        eps: float,
    ) -> None:
        kv_heads, dim = cache.shape[1], cache.shape[3]
        use_pdl = pdl(qkv)
        rope_write_kernel[(heads + 2 * kv_heads, qkv.shape[0])](
            qkv,
            cos,
            sin,
            pos,
            cache,
            qk_norm if qk_norm is not None else qkv,
            eps,
            qkv.stride(0),
            cos.stride(0),
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            HEADS=heads,
            KV=kv_heads,
            D=dim,
            QK_NORM=qk_norm is not None,
            PDL=use_pdl,
            num_warps=1 if dim <= 128 else 2,
            launch_pdl=use_pdl,
        )

    return _Kernels(on_its_device(gemv), on_its_device(rope))
