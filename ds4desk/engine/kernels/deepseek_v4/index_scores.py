"""DeepSeek-V4's lightning-indexer scores for a prefill chunk as one op: `index_scores`.

A CSA layer's indexer scores every compressed entry e for every query t of the chunk as
Σ_h w[t, h] ReLU(q[t, h] · k[e]) (64 heads of 128 on Flash) and picks the top k. Eagerly that is a
[T, H, E] product in bf16, its float32 copy, the ReLU and a batched GEMV with the weights: at
T = 4096 and E = 1024, ~3 GB of memory traffic a layer for a result of 16 MB. On NVIDIA GPUs with
Triton it is one kernel: a program holds a [BT, BE] block of scores and a [BE, d] tile of keys (one
shared key head) and runs over the heads, each head's q · k on the tensor cores, so the [T, H, E]
products never leave the chip; blocks no query of the block can see yet are skipped.

The fused path goes through a torch custom op (one op for an op counter); elsewhere (CPU, ROCm, no
Triton) `reference` runs, the model's former eager math.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device

# Default: the kernel where it can run (NVIDIA CUDA tensors, Triton importable; NVIDIA only: the kernel
# was written for (and checked on) CUDA, never on ROCm). Forced on: always through the custom op (on
# the CPU its body is `reference`); off: the model's eager math.
SWITCH = Switch(
    "deepseek_v4.index_scores",
    "DeepSeek-V4's lightning-indexer scores of a prefill chunk as one kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

# reference: heads per batched product, so that its [T, heads, E] float32 block stays under this.
_REFERENCE_BLOCK = 1 << 26
# The kernel's score block: queries x entries a program.
_BLOCK_T = 64
_BLOCK_E = 128
# Few queries (one block of them): a program per 32 entries, not 128, so there are four times the
# programs to share the loop over heads (on the H200 at T = 2..16, 256 entries: 19 us against 31).
_FEW_BLOCK_E = 32


def reference(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: int, rate: int
) -> torch.Tensor:
    """q [T, H, d] in the keys' dtype, keys [E, d], weights float32 [T, H]; query t is at position
    start + t and sees entry e once its window closed: e < (start + t + 1) // rate. Returns float32
    [T, E]: Σ_h weights[t, h] ReLU(q[t, h] · keys[e]) with each product rounded to the keys' dtype
    (as a bf16 matmul returns it) and summed in float32; -inf where the entry is not visible."""
    count, heads, _ = q.shape
    total = keys.shape[0]
    keys_t, w = keys.t(), weights.unsqueeze(1)  # w [T, 1, H]
    scores = torch.zeros((count, total), device=q.device, dtype=torch.float32)
    step = max(1, _REFERENCE_BLOCK // max(1, count * total))
    for h in range(0, heads, step):
        part = torch.relu_(torch.matmul(q[:, h : h + step], keys_t).float())  # [T, h, E]
        scores.unsqueeze(1).baddbmm_(w[:, :, h : h + step], part)  # += Σ_h w_h part_h
    return scores.masked_fill_(~visible_entries(count, total, start, rate, q.device), -math.inf)


def visible_entries(count: int, total: int, start: int, rate: int, device: torch.device) -> torch.Tensor:
    """bool [T, E]: whether query t (position start + t) sees entry e (closed at (e + 1) rate - 1)."""
    ready = (torch.arange(start, start + count, device=device) + 1) // rate
    return torch.arange(total, device=device).unsqueeze(0) < ready.unsqueeze(1)


def enabled(where: Where) -> bool:
    """Whether the model's prefill should call `index_scores` for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def index_scores(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: int, rate: int
) -> torch.Tensor:
    """See `reference`; always the custom op (see `enabled` for when the model takes this path)."""
    count, heads, dim = q.shape
    if keys.dim() != 2 or keys.shape[1] != dim or q.dtype != keys.dtype:
        raise ValueError(f"keys must be [E, {dim}] in q's dtype, got {tuple(keys.shape)} {keys.dtype}")
    if weights.shape != (count, heads) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32 [{count}, {heads}], got {tuple(weights.shape)}")
    if start < 0 or rate < 1:
        raise ValueError(f"start must be >= 0 and rate >= 1, got {start} and {rate}")
    return _fused_op(q.contiguous(), keys.contiguous(), weights.contiguous(), start, rate)


@torch.library.custom_op("ds4desk::v4_index_scores", mutates_args=())
def _fused_op(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: int, rate: int
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(q) else None
    return (reference if kernel is None else kernel)(q, keys, weights, start, rate)


@_fused_op.register_fake
def _(q, keys, weights, start, rate):
    return q.new_empty((q.shape[0], keys.shape[0]), dtype=torch.float32)


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton launcher, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    # The chunk's sizes and start unspecialised: one variant a block shape, whatever the prompt's
    # length (a specialisation the warm-up did not meet costs a first request milliseconds).
    @triton.jit(do_not_specialize=["T", "E", "start"])
    def kernel(
        q,
        keys,
        weights,
        out,
        T,
        E,
        start,
        rate,
        H: tl.constexpr,
        DIM: tl.constexpr,
        DP: tl.constexpr,  # DIM rounded up to a power of two
        BT: tl.constexpr,
        BE: tl.constexpr,
        ROUND: tl.constexpr,  # round each product to the keys' dtype (a 16-bit matmul's output)
        UPCAST: tl.constexpr,  # the interpreter: float32 operands (numpy has no bfloat16)
        PRECISION: tl.constexpr,
    ):
        bt = tl.program_id(0)
        be = tl.program_id(1)
        t = bt * BT + tl.arange(0, BT)
        e = be * BE + tl.arange(0, BE)
        d = tl.arange(0, DP)
        live_t = t < T
        live_e = e < E
        ready = (start + t + 1) // rate  # entries query t sees
        acc = tl.zeros([BT, BE], dtype=tl.float32)
        last_t = tl.minimum(bt * BT + BT, T) - 1
        if be * BE < (start + last_t + 1) // rate:  # some query of the block sees some entry here
            k = tl.load(
                keys + e[:, None] * DIM + d[None, :], mask=live_e[:, None] & (d < DIM)[None, :], other=0.0
            )
            if UPCAST:
                k = k.to(tl.float32)
            k_t = tl.trans(k)
            for h in range(H):
                qh = tl.load(
                    q + (t[:, None] * H + h) * DIM + d[None, :],
                    mask=live_t[:, None] & (d < DIM)[None, :],
                    other=0.0,
                )
                if UPCAST:
                    qh = qh.to(tl.float32)
                s = tl.dot(qh, k_t, input_precision=PRECISION, out_dtype=tl.float32)
                if ROUND:
                    s = s.to(keys.dtype.element_ty).to(tl.float32)
                w = tl.load(weights + t * H + h, mask=live_t, other=0.0)
                acc += w[:, None] * tl.maximum(s, 0.0)
        visible = e[None, :] < ready[:, None]
        tl.store(
            out + t[:, None] * E + e[None, :],
            tl.where(visible, acc, -float("inf")),
            mask=live_t[:, None] & live_e[None, :],
        )

    def launch(
        q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: int, rate: int
    ) -> torch.Tensor:
        count, heads, dim = q.shape
        total = keys.shape[0]
        out = torch.empty((count, total), device=q.device, dtype=torch.float32)
        if total == 0 or count == 0:
            return out
        block_t = min(_BLOCK_T, max(16, next_power_of_two(count)))
        block_e = min(_FEW_BLOCK_E if count <= 16 else _BLOCK_E, max(16, next_power_of_two(total)))
        grid = (triton.cdiv(count, block_t), triton.cdiv(total, block_e))
        kernel[grid](
            q,
            keys,
            weights,
            out,
            count,
            total,
            start,
            rate,
            H=heads,
            DIM=dim,
            DP=max(16, next_power_of_two(dim)),
            BT=block_t,
            BE=block_e,
            ROUND=q.dtype != torch.float32,
            UPCAST=not q.is_cuda and q.dtype != torch.float32,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4,
        )
        return out

    return on_its_device(launch)
