"""DeepSeek-V4's lightning-indexer pick for one decode query as one op: `decode_index`.

Once a CSA layer holds more compressed entries than index_topk (Flash: 512, so after 2,048 tokens),
a decode step scores every entry e as Σ_h w_h ReLU(q_h · k_e) (64 heads of 128) and attends to the
top 512. Eagerly that is the weights' float32 cast and scale, the bf16 product, its float32 copy,
the ReLU, the weighted sum, the visibility mask and torch's top-k: at 2,048 entries ~50 µs a layer
in a CUDA graph on an H100, most of it the top-k's radix sort, for 21 CSA layers in Flash. On NVIDIA
GPUs with Triton it is two kernels (~10 µs). The first scores a block of entries a program (the
heads are the product's rows, so the tensor cores run it; it casts and scales the projection's
weights itself). The second, one program, finds the k-th largest score from its bits, two bits a
round (16 rounds of counts over the entries, all held in registers), and writes every entry above
it plus the first entries equal to it, in entry order: the same set as a top-k up to ties, which
attention does not order.

The fused path goes through a torch custom op (one op for an op counter); elsewhere (CPU, ROCm, no
Triton) `reference` runs, the model's former eager math.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device, pdl

# Default: the kernels where they can run (NVIDIA CUDA tensors, Triton importable; NVIDIA only: they
# were written for CUDA, never run on ROCm). Forced on: always through the custom op (on the CPU its
# body is `reference`); off: the model's eager math.
SWITCH = Switch(
    "deepseek_v4.decode_index",
    "DeepSeek-V4's indexer pick of a decode step (scores and top-k) as two kernels",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

# Entries a scoring program takes: Flash's 2,048 entries after 8k tokens are 32 programs, each
# reading the [64, 128] query once.
_BLOCK_E = 64
# The selection holds every score of the layer in one program's registers: up to 16,384 entries (a
# 65,536-token context at rate 4); beyond, torch's top-k picks from the kernel's scores.
MAX_SELECT = 1 << 14
# Threshold bits the selection settles a round (bench/v4_decode_index.py sweeps it).
SELECT_BITS = 2
# The head weights' dtypes the scoring kernel reads (the indexer's projection gives the model's).
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def enabled(where: Where) -> bool:
    """Whether the model's decode step should call `decode_index` for tensors on `where`."""
    return SWITCH.on(where)


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    pos: torch.Tensor,
    rate: int,
    k: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """q [H, d] in the keys' dtype (rotated), keys [E, d], weights [1, H] (float32, bfloat16 or
    float16; head h weighs w_h = float32(weights[h]) · scale), pos int64 [1]: the k entries with the
    largest Σ_h w_h ReLU(q_h · k_e), each product rounded to the keys' dtype (a 16-bit matmul's
    output) and summed in float32, as int64 indices [k]. Entry e is visible from position
    (e + 1) rate - 1 on; the others score -inf (fewer visible than k: some of them are picked, and
    attention masks them)."""
    part = torch.relu_(torch.mm(q, keys.t()).float())  # [H, E]
    ready = torch.arange(1, keys.shape[0] + 1, device=keys.device) * rate - 1
    scores = torch.where(ready <= pos, torch.mm(weights.float() * scale, part), -math.inf)  # [1, E]
    return scores.topk(k, dim=-1).indices.view(-1)


def decode_index(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    pos: torch.Tensor,
    rate: int,
    k: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """See `reference`; always the custom op (see `enabled` for when the model takes this path)."""
    heads, dim = q.shape
    if keys.dim() != 2 or keys.shape[1] != dim or q.dtype != keys.dtype:
        raise ValueError(f"keys must be [E, {dim}] in q's dtype, got {tuple(keys.shape)} {keys.dtype}")
    if weights.shape != (1, heads) or weights.dtype not in _WEIGHT_DTYPES:
        raise ValueError(
            f"weights must be [1, {heads}] in float32, bfloat16 or float16, got "
            f"{tuple(weights.shape)} {weights.dtype}"
        )
    if pos.shape != (1,) or pos.dtype != torch.int64:
        raise ValueError("pos is an int64 tensor [1]")
    if rate < 1 or not 0 < k < keys.shape[0]:
        raise ValueError(f"need rate >= 1 and 0 < k < {keys.shape[0]} entries, got rate {rate} and k {k}")
    return _fused_op(q.contiguous(), keys.contiguous(), weights.contiguous(), pos, rate, k, float(scale))


@torch.library.custom_op("ds4desk::v4_decode_index", mutates_args=())
def _fused_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    pos: torch.Tensor,
    rate: int,
    k: int,
    scale: float,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(q) else None
    return (reference if kernel is None else kernel)(q, keys, weights, pos, rate, k, scale)


@_fused_op.register_fake
def _(q, keys, weights, pos, rate, k, scale):
    return q.new_empty((k,), dtype=torch.int64)


@functools.cache
def _jit_kernels() -> tuple[object, object] | None:
    """The Triton kernels (scores, select), or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit(do_not_specialize=["E"])
    def scores_kernel(
        q,
        keys,
        weights,
        scale,
        pos_ptr,
        out,
        E,
        RATE: tl.constexpr,
        H: tl.constexpr,
        HP: tl.constexpr,  # H rounded up to a power of two, at least 16 (a tensor-core tile's rows)
        DIM: tl.constexpr,
        DP: tl.constexpr,
        BE: tl.constexpr,
        UPCAST: tl.constexpr,  # the interpreter: float32 operands (numpy has no bfloat16)
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # q and weights are the kernels before's outputs
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        e = tl.program_id(0) * BE + tl.arange(0, BE)
        h = tl.arange(0, HP)
        d = tl.arange(0, DP)
        live_e = e < E
        cols = (d < DIM)[None, :]
        qh = tl.load(q + h[:, None] * DIM + d[None, :], mask=(h < H)[:, None] & cols, other=0.0)
        k = tl.load(keys + e[:, None] * DIM + d[None, :], mask=live_e[:, None] & cols, other=0.0)
        if UPCAST:
            qh = qh.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(qh, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32)  # [HP, BE]
        s = s.to(keys.dtype.element_ty).to(tl.float32)  # a 16-bit matmul returns its dtype
        w = tl.load(weights + h, mask=h < H, other=0.0).to(tl.float32) * scale
        score = tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0)
        visible = (e + 1) * RATE - 1 <= tl.load(pos_ptr)
        tl.store(out + e, tl.where(visible, score, -float("inf")), mask=live_e)

    @triton.jit(do_not_specialize=["E"])
    def select_kernel(
        scores,
        picks,
        E,
        K: tl.constexpr,
        EP: tl.constexpr,
        BITS: tl.constexpr,  # threshold bits settled a round (1, 2 or 4: a divisor of 32)
        PDL: tl.constexpr,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        e = tl.arange(0, EP)
        live = e < E
        bits = tl.load(scores + e, mask=live, other=0.0).to(tl.int32, bitcast=True)
        # Order-preserving integers: a negative float's magnitude bits flip (-inf is above INT_MIN,
        # which the lanes past the end take).
        key = tl.where(live, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2147483648)
        # The k-th largest key, BITS bits a round from the top of the offset range 0 .. 2^32 - 1
        # (int64 on the threshold, int32 compares on the keys): the largest t with K keys >= t - 2^31.
        # A round counts the keys at or above each of the 2^BITS next thresholds at once (one
        # reduction, not BITS); the counts fall with the threshold, so those reaching K say the digit.
        steps = tl.arange(0, 1 << BITS).to(tl.int64)
        kth = tl.zeros([], dtype=tl.int64)
        for r in tl.static_range(32 // BITS):
            trials = (kth + (steps << (32 - BITS * (r + 1))) - 2147483648).to(tl.int32)
            counts = tl.sum((key[:, None] >= trials[None, :]).to(tl.int32), axis=0)
            digit = tl.sum((counts >= K).to(tl.int64), axis=0) - 1  # the step at kth always counts K
            kth = kth + (digit << (32 - BITS * (r + 1)))
        kth = (kth - 2147483648).to(tl.int32)
        above = key > kth
        tie = key == kth
        taken_above = tl.sum(above.to(tl.int32), axis=0)  # < K
        rank_above = tl.cumsum(above.to(tl.int32), axis=0) - above.to(tl.int32)
        rank_tie = taken_above + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
        slot = tl.where(above, rank_above, rank_tie)
        tl.store(picks + slot, e.to(tl.int64), mask=above | (tie & (rank_tie < K)))

    return scores_kernel, select_kernel


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton launcher, or None where Triton is not importable."""
    kernels = _jit_kernels()
    if kernels is None:
        return None
    scores_kernel, select_kernel = kernels

    def launch(
        q: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor,
        pos: torch.Tensor,
        rate: int,
        k: int,
        scale: float,
    ) -> torch.Tensor:
        heads, dim = q.shape
        total = keys.shape[0]
        use_pdl = pdl(q)
        scores = torch.empty((total,), device=q.device, dtype=torch.float32)
        block = min(_BLOCK_E, max(16, next_power_of_two(total)))
        scores_kernel[(-(-total // block),)](
            q,
            keys,
            weights,
            scale,
            pos,
            scores,
            total,
            RATE=rate,
            H=heads,
            HP=max(16, next_power_of_two(heads)),
            DIM=dim,
            DP=max(16, next_power_of_two(dim)),
            BE=block,
            UPCAST=not q.is_cuda and q.dtype != torch.float32,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            PDL=use_pdl,
            num_warps=4,
            launch_pdl=use_pdl,
        )
        if total > MAX_SELECT:
            return scores.topk(k).indices
        picks = torch.empty((k,), device=q.device, dtype=torch.int64)
        span = next_power_of_two(total)
        select_kernel[(1,)](
            scores,
            picks,
            total,
            K=k,
            EP=span,
            BITS=SELECT_BITS,
            PDL=use_pdl,
            num_warps=max(4, min(16, span // 512)),
            launch_pdl=use_pdl,
        )
        return picks

    return on_its_device(launch)
