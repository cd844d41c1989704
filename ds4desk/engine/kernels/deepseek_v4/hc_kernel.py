"""DeepSeek-V4's hyper-connection weights as one op: from a site's projection z to [pre | post] and the
Sinkhorn-normalised combination matrix.

Eagerly this is ~85 tiny kernels per site (the 20 Sinkhorn iterations on a 4 x 4 matrix are
sequential: two kernels each half step at best), and there are two sites a layer; in a decode step at
batch 1 they were most of the launches. On NVIDIA GPUs with Triton it is one kernel: each program
holds a block of tokens' matrices in registers for all iterations. Elsewhere (CPU, ROCm, no Triton,
an hc_mult that is not a power of two) the eager form runs, with the same math.

The fused path goes through a torch custom op, so a CUDA graph capture and a dispatch-level op
counter (bench/count_ops.py) see one op whatever runs inside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ds4desk.engine.kernels.launch import Switch, Where, is_power_of_two, nvidia, on_its_device

# Default: the fused kernel where it can run (NVIDIA CUDA tensors, Triton importable, hc_mult a power of
# 2). Forced on: always through the custom op (on the CPU its body is the eager math: what
# bench/count_ops.py uses to count a fused step without a GPU); off: the eager ops.
SWITCH = Switch(
    "deepseek_v4.hc_kernel",
    "DeepSeek-V4's hyper-connection weights (gates and Sinkhorn) as one kernel",
    lambda where, mult: nvidia(where) and is_power_of_two(mult) and _triton_kernel() is not None,
)


def reference(
    z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, mult: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager form: z [T, (2 + m) m] float32 (x_normed · fnᵀ), scale [3], base [(2 + m) m] ->
    ([σ(pre) + eps | 2σ(post)] [T, 2m], C [T, m, m])."""
    m = mult
    count = z.shape[0]
    index = _scale_index(m, z.device)
    z = torch.addcmul(base, z, scale.index_select(0, index))
    gate_mul, gate_add, row_sums, col_sums = _constants(m, eps, z.device)
    gates = torch.addcmul(gate_add, torch.sigmoid(z[:, : 2 * m]), gate_mul)  # [σ + eps | 2σ]
    # Sinkhorn: C = softmax + eps, then columns, then (rows, columns) iters - 1 times, each divided by
    # (its sum + eps). Each half step is two kernels: the sums + eps as one small matmul over
    # [C | 1] (the constant 1 times eps gives the + eps), then an in-place division.
    work = torch.empty((count, m * m + 1), device=z.device, dtype=torch.float32)
    work[:, m * m].fill_(1.0)
    comb = work[:, : m * m].view(count, m, m)
    torch.add(torch.softmax(z[:, 2 * m :].view(count, m, m), dim=-1), eps, out=comb)
    comb.div_(torch.mm(work, col_sums).view(count, 1, m))
    for _ in range(iters - 1):
        comb.div_(torch.mm(work, row_sums).view(count, m, 1))
        comb.div_(torch.mm(work, col_sums).view(count, 1, m))
    return gates, comb


@torch.library.custom_op("ds4desk::v4_hc_weights", mutates_args=())
def _fused_op(
    z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, mult: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(z) else None
    if kernel is None:
        gates, comb = reference(z, scale, base, mult, iters, eps)
        return gates, comb.contiguous()
    return kernel(z, scale, base, mult, iters, eps)


@_fused_op.register_fake
def _(z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, mult: int, iters: int, eps: float):
    count = z.shape[0]
    return z.new_empty((count, 2 * mult)), z.new_empty((count, mult, mult))


def enabled(where: Where, mult: int) -> bool:
    """Whether hc_weights runs the fused kernel for tensors on `where` and hc_mult `mult` (see SWITCH)."""
    return SWITCH.on(where, mult)


def hc_weights(
    z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, mult: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[pre | post] [T, 2m] and C [T, m, m], float32, fused where it can be (see SWITCH)."""
    if enabled(z, mult):
        return _fused_op(z.contiguous(), scale, base, mult, iters, eps)
    return reference(z, scale, base, mult, iters, eps)


# Built on first use, which is eager (a graph capture is always preceded by a warm-up step).
_CONSTANTS: dict[tuple[Any, ...], Any] = {}


def _scale_index(m: int, device: torch.device) -> torch.Tensor:
    key = ("index", m, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor([0] * m + [1] * m + [2] * m * m, device=device)
    return _CONSTANTS[key]


def _constants(
    m: int, eps: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate multipliers [2m], gate offsets [2m], row-sum and column-sum matrices [m m + 1, m])."""
    key = ("sums", m, eps, device)
    if key not in _CONSTANTS:
        ones = torch.ones(m, device=device)
        row_sums = torch.zeros((m * m + 1, m), device=device)
        col_sums = torch.zeros((m * m + 1, m), device=device)
        for j in range(m):
            row_sums[j * m : (j + 1) * m, j] = 1.0  # C[j, k] adds to row j's sum
            col_sums[j : m * m : m, j] = 1.0  # C[k, j] adds to column j's sum
        row_sums[m * m] = col_sums[m * m] = eps  # times the constant 1 after C
        gate_add = torch.cat([torch.full((m,), eps, device=device), torch.zeros(m, device=device)])
        _CONSTANTS[key] = (torch.cat([ones, 2 * ones]), gate_add, row_sums, col_sums)
    return _CONSTANTS[key]


@functools.cache
def _triton_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The Triton launcher, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit
    def kernel(
        z,
        scale,
        base,
        gates_out,
        comb_out,
        count,
        eps,
        ITERS: tl.constexpr,
        M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = (2 + M) * M
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # the block's tokens
        live = t < count

        g = tl.arange(0, 2 * M)
        zg = tl.load(z + t[:, None] * rows + g[None, :], mask=live[:, None], other=0.0)
        sg = tl.load(scale + g // M)  # scale[0] for pre, scale[1] for post
        s = tl.sigmoid(zg * sg[None, :] + tl.load(base + g)[None, :])
        gates = tl.where(g[None, :] < M, s + eps, 2.0 * s)
        tl.store(gates_out + t[:, None] * (2 * M) + g[None, :], gates, mask=live[:, None])

        i = tl.arange(0, M)
        cell = i[:, None] * M + i[None, :]  # [M, M], row-major
        at = z + t[:, None, None] * rows + 2 * M + cell[None, :, :]
        zc = tl.load(at, mask=live[:, None, None], other=0.0)
        logits = zc * tl.load(scale + 2) + tl.load(base + 2 * M + cell)[None, :, :]
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        c = e / tl.sum(e, axis=2)[:, :, None] + eps
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)  # columns first
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
            c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
        tl.store(comb_out + t[:, None, None] * (M * M) + cell[None, :, :], c, mask=live[:, None, None])

    def launch(
        z: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, mult: int, iters: int, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = z.shape[0]
        gates = torch.empty((count, 2 * mult), device=z.device, dtype=torch.float32)
        comb = torch.empty((count, mult, mult), device=z.device, dtype=torch.float32)
        block = 16
        kernel[(triton.cdiv(count, block),)](
            z, scale, base, gates, comb, count, eps, ITERS=iters, M=mult, BLOCK=block
        )
        return gates, comb

    return on_its_device(launch)
