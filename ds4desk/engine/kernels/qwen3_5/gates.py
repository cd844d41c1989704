"""Qwen3.5's write strengths and log-decays over a prefill's rows as one op: `gates`.

A linear-attention layer's delta rule takes per token and value head a write strength
beta = sigmoid(b) (rounded to the model's dtype, as the eager sigmoid rounds it) and a log-decay
g = -exp(A_log) softplus(a + dt_bias) in float32, b and a being two small projections of the
layer's input. Rows at or past `real` (the padding of a graphed prompt piece) get beta = 0 and
g = 0: they write nothing and decay nothing. Eagerly that is ten elementwise launches a layer
(a float copy, the sigmoid, the add, softplus, the product, and the padding's mask), each a few µs
inside a prompt piece's CUDA graph; on NVIDIA GPUs with Triton it is one kernel. Elsewhere
`reference` runs, the model's eager math op for op. The decode step computes the same two values
inside its own fused op (linear_decode.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device
from ds4desk.engine.kernels.qwen3_5.linear_decode import SOFTPLUS_THRESHOLD

SWITCH = Switch(
    "qwen3_5.gates",
    "Qwen3.5's write strengths and log-decays of a prefill's rows as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

BLOCK_T = 32  # a program's rows


def enabled(where: Where) -> bool:
    """Whether the model should call `gates` for tensors on `where`."""
    return SWITCH.on(where)


def gates(
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, H] in the model's dtype (rows at any stride), neg_rate (-exp(A_log)) and dt_bias [H]
    float32, `real` None or int64 [1] on the device (only the first `real` rows are tokens): (beta,
    g) [T, H] float32. Always the custom op (see `enabled`)."""
    if b.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"b {tuple(b.shape)} {b.dtype} and a {tuple(a.shape)} {a.dtype} must match, [T, H]")
    heads = b.shape[1]
    for name, value in (("neg_rate", neg_rate), ("dt_bias", dt_bias)):
        if value.shape != (heads,) or value.dtype != torch.float32:
            raise ValueError(f"{name} {tuple(value.shape)} {value.dtype} must be float32 [{heads}]")
    if real is not None and (real.shape != (1,) or real.dtype != torch.int64):
        raise ValueError(f"real {tuple(real.shape)} {real.dtype} must be int64 [1]")
    return _fused_op(b, a, neg_rate, dt_bias, real)


def reference(
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's eager gates (linear_attention.forward), op for op."""
    beta = torch.sigmoid(b).float()
    decay = neg_rate * F.softplus(a.float() + dt_bias)  # log-decay, <= 0
    if real is not None:
        is_real = (torch.arange(b.shape[0], device=b.device) < real)[:, None]
        beta, decay = beta * is_real, decay * is_real
    return beta, decay


@torch.library.custom_op("ds4desk::qwen35_gates", mutates_args=())
def _fused_op(
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    real: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(b) else None
    run = reference if kernel is None else kernel
    return run(b, a, neg_rate, dt_bias, real)


@_fused_op.register_fake
def _(b, a, neg_rate, dt_bias, real):
    beta = b.new_empty(b.shape, dtype=torch.float32)
    return beta, torch.empty_like(beta)


@functools.cache
def _jit_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit(do_not_specialize=["rows"])
    def kernel(
        b,  # [T, H], rows apart by b_stride
        a,  # [T, H], rows apart by a_stride
        neg_rate,  # [H] float32
        dt_bias,  # [H] float32
        real,  # int64 [1]: the rows that are tokens (read where HAS_REAL)
        beta_out,  # [T, H] float32
        decay_out,  # [T, H] float32
        rows,
        b_stride,
        a_stride,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_T: tl.constexpr,
        HAS_REAL: tl.constexpr,
        THRESHOLD: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.arange(0, BLOCK_H)
        inside = (t < rows)[:, None] & (h < H)[None, :]
        # The sigmoid rounded to the model's dtype, as the eager op rounds it; the arithmetic in
        # float32 (Triton's interpreter has no bf16 arithmetic).
        b_t = tl.load(b + t[:, None] * b_stride + h[None, :], mask=inside, other=0.0).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b_t))).to(b.dtype.element_ty).to(tl.float32)
        x = tl.load(a + t[:, None] * a_stride + h[None, :], mask=inside, other=0.0).to(tl.float32)
        x += tl.load(dt_bias + h, mask=h < H, other=0.0)[None, :]
        softplus = tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
        decay = tl.load(neg_rate + h, mask=h < H, other=0.0)[None, :] * softplus
        if HAS_REAL:
            token = (t < tl.load(real))[:, None]
            beta = tl.where(token, beta, 0.0)
            decay = tl.where(token, decay, 0.0)
        at = t[:, None] * H + h[None, :]
        tl.store(beta_out + at, beta, mask=inside)
        tl.store(decay_out + at, decay, mask=inside)

    return kernel


@functools.cache
def _triton_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    kernel = _jit_kernel()
    if kernel is None:
        return None

    def launch(
        b: torch.Tensor,
        a: torch.Tensor,
        neg_rate: torch.Tensor,
        dt_bias: torch.Tensor,
        real: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads = b.shape
        b = b if b.stride(1) == 1 else b.contiguous()
        a = a if a.stride(1) == 1 else a.contiguous()
        beta = torch.empty((rows, heads), dtype=torch.float32, device=b.device)
        decay = torch.empty_like(beta)
        if rows:
            kernel[(-(-rows // BLOCK_T),)](
                b, a, neg_rate, dt_bias, beta if real is None else real, beta, decay, rows,
                b.stride(0), a.stride(0), H=heads, BLOCK_H=next_power_of_two(heads), BLOCK_T=BLOCK_T,
                HAS_REAL=real is not None, THRESHOLD=SOFTPLUS_THRESHOLD, num_warps=4,
            )  # fmt: skip
        return beta, decay

    return on_its_device(launch)
