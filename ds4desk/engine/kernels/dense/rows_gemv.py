"""GEMVs of a few rows (2..16) for the graphed verify step and prompt piece: the weight read once.

A verify step scores k + 1 tokens; a follow-up turn's prompt piece runs up to 16. cuBLAS picks a
GEMM for that row count whose tiles are built for many rows, and the torch path around it adds an
RMSNorm, an activation and residual copies as kernels of their own. Here each program holds a tile
of 4 weight rows in registers, as the one-row GEMV does, and multiplies it with every input row
before loading the next, so the weight is read once and T rows cost little more than one; the
RMSNorm (its 1/rms scales each row's sums at the end, so the input is read once), SiLU(gate) · up
and the residual add are folded in, as the one-row kernels in gemv.py fold them. (Tensor-core
tiles need 16 weight rows a program: too few programs to stream the 2,048-row projections, and
slower than cuBLAS on the H200.)

The kernels run where gemv.py's do (its SWITCH); `fits` says which weights the tiles cover.
The torch forms the tests compare against are gemv.py's `reference_*`, row by row the same math.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ds4desk.engine.kernels.dense import gemv
from ds4desk.engine.kernels.launch import next_power_of_two, on_its_device, pdl

MAX_ROWS = 16  # past it the accumulators leave the registers: more rows take the torch path

# (BLOCK_N, BLOCK_K, num_warps) forced for every shape: what the sweep tries settings with.
OVERRIDE: tuple[int, int, int] | None = None


def fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight can take the row kernels (rows contiguous, tiles that divide it)."""
    n, k = weight.shape
    return weight.stride(1) == 1 and n % 4 == 0 and k % 64 == 0


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [T, K] @ weightᵀ runs on the row kernels here."""
    return (
        1 <= x.shape[0] <= MAX_ROWS
        and x.stride(-1) == 1
        and x.dtype == weight.dtype
        and gemv.enabled(x.device)
        and fits(weight)
    )


def rows_config(n: int, k: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the one-row GEMV's tiles of 4 weight rows (many programs, long
    runs of each row), narrower as the rows' accumulators grow so that they stay in registers."""
    if OVERRIDE is not None:
        return OVERRIDE
    width = 512 if rows <= 2 else 256 if rows <= 8 else 128
    block_k = next(size for size in (width, 256, 128, 64) if size <= width and k % size == 0)
    return 4, block_k, 4


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weightᵀ in x's dtype: gemv.py's kernel for one row, the row kernel for 2..16 rows where
    they run (DeepSeek-V4's linears in a decode step, verify step or prompt piece), else torch."""
    if gemv.one_row(x, weight):
        return gemv.gemv(x, weight, x.new_empty((1, weight.shape[0])))
    if x.shape[0] > 1 and runs(x, weight):
        return gemv_rows(x, weight, x.new_empty((x.shape[0], weight.shape[0])))
    return x @ weight.t()


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, N] = x [T, K] @ weightᵀ, in out's dtype (float32 for logits)."""
    _launch(x, weight, out, None, None, 0.0, with_norm=False, silu=False, residual=False)
    return out


def norm_gemv(
    x: torch.Tensor,
    norm: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [T, N] = RMSNorm(x [T, K]; norm) @ weightᵀ (+ bias), in out's dtype (float32 for logits)."""
    _launch(x, weight, out, bias, norm, eps, with_norm=True, silu=False, residual=False)
    return out


def gemv_add_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """residual [T, N] += x @ weightᵀ (+ bias), rounded once; silu: x is [T, 2K] gate | up and the
    input is SiLU(gate) · up."""
    _launch(x, weight, residual, bias, None, 0.0, with_norm=False, silu=silu, residual=True)
    return residual


def _launch(
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
) -> None:
    kernel = _kernel()
    assert kernel is not None and x.shape[0] <= MAX_ROWS and out.stride(-1) == 1
    kernel(x, weight, out, bias, norm, eps, with_norm=with_norm, silu=silu, residual=residual)


@functools.cache
def _kernel() -> Callable[..., None] | None:
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the torch path runs
        return None

    @triton.jit
    def rows_kernel(
        x,
        w,
        out,
        bias,
        norm,
        rows,
        stride_x,
        stride_w,
        stride_out,
        eps,
        K: tl.constexpr,
        NORM: tl.constexpr,
        SILU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, ROWS)
        live = (r < rows)[:, None]
        kk = tl.arange(0, BLOCK_K)
        tiles = w + n.to(tl.int64)[:, None] * stride_w + kk[None, :]
        inputs = x + r[:, None] * stride_x + kk[None, :]
        # No earlier kernel writes the weights: the first tile streams in while that kernel ends.
        tile = tl.load(tiles)
        if PDL:  # the input rows come from the kernel before: wait for it, let the next one start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # The input rows rounded to the weight dtype before the product, as torch's are. The
            # norm's 1/rms is a factor of each row: it scales the row's sums after the loop, so the
            # rows are read once (torch rounds the row after that factor: a rounding apart).
            if SILU:
                g = tl.load(inputs + k0, mask=live, other=0.0).to(tl.float32)
                u = tl.load(inputs + K + k0, mask=live, other=0.0).to(tl.float32)
                v = (g * tl.sigmoid(g) * u).to(w.dtype.element_ty).to(tl.float32)
            elif NORM:
                v = tl.load(inputs + k0, mask=live, other=0.0).to(tl.float32)
                squares += v * v
                v = (v * tl.load(norm + k0 + kk).to(tl.float32)[None, :]).to(w.dtype.element_ty)
                v = v.to(tl.float32)
            else:
                v = tl.load(inputs + k0, mask=live, other=0.0).to(tl.float32)
            # Every row times the tile held in registers: the weight is read once for all rows.
            acc += tile.to(tl.float32)[None, :, :] * v[:, None, :]
            tile = tl.load(tiles + k0 + BLOCK_K, mask=k0 + BLOCK_K < K, other=0.0)
        y = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
        if NORM:
            y *= tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
        if HAS_BIAS:
            y += tl.load(bias + n).to(tl.float32)[None, :]
        at = out + r[:, None] * stride_out + n[None, :]
        if RESIDUAL:
            y += tl.load(at, mask=live, other=0.0).to(tl.float32)
        tl.store(at, y.to(out.dtype.element_ty), mask=live)

    def launch(
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
    ) -> None:
        n, k = weight.shape
        rows = x.shape[0]
        block_n, block_k, warps = rows_config(n, k, rows)
        use_pdl = pdl(x)
        rows_kernel[(n // block_n,)](
            x,
            weight,
            out,
            bias if bias is not None else out,
            norm if norm is not None else x,
            rows,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            eps,
            K=k,
            NORM=with_norm,
            SILU=silu,
            RESIDUAL=residual,
            HAS_BIAS=bias is not None,
            ROWS=next_power_of_two(rows),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PDL=use_pdl,
            num_warps=warps,
            launch_pdl=use_pdl,
        )

    return on_its_device(launch)
