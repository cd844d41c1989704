"""DeepSeek-V4's prefill attention as one op: every query of a chunk over its sliding window of raw
keys, plus the compressed entries it sees (HCA: all entries so far, masked by position; CSA: the
indexer's picks), plus the per-head sink logit that has no value. Keys are values (one shared head).

Eagerly (`reference`) each query gets a [d, W] window copy, CSA queries a [k, d] copy of their picks
(T = 4096, k = 512, d = 512: 2 GB a layer), and the float32 scores [T, H, W + k] go through one
softmax and two more batched products. On NVIDIA GPUs with Triton it is one flash-attention style
kernel: an online softmax in float32 that starts from the sink (a logit with no value: m = sink,
l = 1, nothing added to the output), reading window rows and picked entry rows by index where they
lie, so nothing is copied and no score leaves the chip.

Blocking: one program per (query token, block of BLOCK_H heads) holds the full head dim. The 64
heads share one K = V head, so the heads are the M dim of both products and each key tile loaded
serves BLOCK_H heads at once. All 64 heads with d = 512 would need a [64, 512] float32 accumulator
(128 KB) in one program: too many registers. The two ways out are splitting d across programs
(each split must recompute the full q · k over all 512 dims: the score FLOPs times the number of
splits, and every split still loads whole key rows for the scores) or splitting the heads (no
recomputation at all; a key tile is loaded once per head block, from L2, as with a d split). So the
heads are split: BLOCK_H = 32 keeps a [32, 512] accumulator (64 registers a thread at 8 warps; with
q held as the dot operand ptxas for sm_90a reports ~250 registers and no spills, 80 KB of shared
memory at BLOCK_N = 32, 2 stages). BLOCK_H = 64 gets Hopper's wgmma (M >= 64) and loads each key
once per query, but spills ~200 bytes at 8 warps; bench/v4_prefill_attention.py sweeps these
blockings on a GPU (LAUNCH_CONFIG is the default). Queries are not blocked together: their windows
overlap but their CSA picks do not, and H = 64 heads already fill the M dim.

The fused path goes through a torch custom op, so a dispatch-level op counter sees one op.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device

# Default: the fused kernel where it can run (NVIDIA CUDA tensors, Triton importable; NVIDIA only: the
# kernel is written for (and checked on) NVIDIA GPUs, never on ROCm). Forced on: always through the
# custom op (on the CPU its body is the eager math); off: the eager ops.
SWITCH = Switch(
    "deepseek_v4.prefill_attention",
    "DeepSeek-V4's prefill attention (window, compressed entries, sink) as one flash-attention kernel",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)


# The launch blocking (see the module docstring); a launch's keyword arguments override it (the bench).
LAUNCH_CONFIG: dict[str, int] = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2}
# A few queries (a graphed prompt piece or verify step, T <= FEW_QUERIES): the grid is T x heads /
# block_h programs each walking its whole window, so the time is one program's latency: smaller
# head blocks give twice the programs and longer key blocks half the trips (on the H200, a CSA
# layer of Flash's shapes with 256 picks: 23 us against 42 with LAUNCH_CONFIG, at T = 2..16).
FEW_QUERIES = 16
FEW_QUERIES_CONFIG: dict[str, int] = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    pad: int | torch.Tensor,
    entries: torch.Tensor | None,
    picks: torch.Tensor | None,
    extra_bias: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The eager form. q [T, H, d]; keys [W - 1 + T, d]: query t's window is rows t .. t + W - 1, of
    which the first `pad` rows are never visible (positions before 0; a host int, or int64 [1] on
    the device where a CUDA graph replays the call at other positions); entries [E, d] with picks
    [T, k] (CSA) or None (HCA: every entry); extra_bias [T, E or k] float32 (0 or -inf); sinks [H].
    Returns [T, H, d] in q's dtype."""
    count, heads, _ = q.shape
    window = keys.shape[0] - count + 1
    # A copy: cuBLAS takes no overlapping batches (on the strided view the products ran 5x slower).
    windows = keys.unfold(0, window, 1).contiguous()  # [T, d, W]
    scores = [torch.bmm(q, windows).float().mul_(scale)]  # [T, H, W] float32
    if isinstance(pad, torch.Tensor) or pad:
        device = q.device
        slots = torch.arange(count, device=device).unsqueeze(1) + torch.arange(window, device=device)
        scores[0].masked_fill_((slots < pad).unsqueeze(1), -math.inf)
    extra: torch.Tensor | None = None
    if entries is not None and extra_bias is not None:
        if picks is None:  # every query scores the same entries (HCA)
            extra = entries  # [E, d]
            extra_scores = torch.matmul(q, extra.t())
        else:  # each query its own indexer picks (CSA)
            extra = entries[picks]  # [T, k, d]
            extra_scores = torch.bmm(q, extra.transpose(1, 2))
        scores.append(torch.add(extra_bias.unsqueeze(1), extra_scores, alpha=scale))  # [T, H, E or k]

    # One softmax over raw keys, compressed keys and the per-head sink logit (no value).
    sink = sinks.view(1, heads, 1).expand(count, heads, 1)
    probs = torch.softmax(torch.cat([*scores, sink], dim=-1), dim=-1).to(keys.dtype)
    out = torch.bmm(probs[..., :window], windows.transpose(1, 2))  # [T, H, d]
    if extra is not None:
        weights = probs[..., window:-1]
        out = out + (torch.matmul(weights, extra) if extra.dim() == 2 else torch.bmm(weights, extra))
    return out


@torch.library.custom_op("ds4desk::v4_prefill_attention", mutates_args=())
def _fused_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    pad: int,
    pad_at: torch.Tensor | None,
    entries: torch.Tensor | None,
    picks: torch.Tensor | None,
    extra_bias: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(q) else None
    padding = pad if pad_at is None else pad_at
    if kernel is None:
        return reference(q, keys, padding, entries, picks, extra_bias, sinks, scale).contiguous()
    return kernel(q, keys, padding, entries, picks, extra_bias, sinks, scale)


@_fused_op.register_fake
def _(q, keys, pad, pad_at, entries, picks, extra_bias, sinks, scale):
    return q.new_empty(q.shape)


def enabled(where: Where) -> bool:
    """Whether prefill_attention runs the fused kernel for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    pad: int | torch.Tensor,
    entries: torch.Tensor | None,
    picks: torch.Tensor | None,
    extra_bias: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The chunk's attention output [T, H, d] in q's dtype (see `reference` for the arguments), fused
    where it can be (see SWITCH)."""
    if not enabled(q):
        return reference(q, keys, pad, entries, picks, extra_bias, sinks, scale)
    return _fused_op(
        q.contiguous(),
        keys.contiguous(),
        0 if isinstance(pad, torch.Tensor) else pad,
        pad if isinstance(pad, torch.Tensor) else None,
        None if entries is None else entries.contiguous(),
        None if picks is None else picks.contiguous(),
        None if extra_bias is None else extra_bias.contiguous(),
        sinks.contiguous(),
        scale,
    )


def _pow2_at_least_16(n: int) -> int:
    return max(16, next_power_of_two(n))  # tl.dot takes no dim under 16


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton launcher, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit
    def kernel(
        q,
        keys,
        entries,
        picks,
        bias,
        sinks,
        out,
        pad,  # a pointer to it with PAD_AT
        n_extra,
        heads,
        dim,
        scale,
        WINDOW: tl.constexpr,
        PAD_AT: tl.constexpr,
        EXTRA_BLOCKS: tl.constexpr,
        HAS_EXTRA: tl.constexpr,
        HAS_PICKS: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_live = h < heads
        d_live = d < dim
        hd = h_live[:, None] & d_live[None, :]
        q_at = q + t * heads * dim + h[:, None] * dim + d[None, :]
        qt = tl.load(q_at, mask=hd, other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
        if PAD_AT:  # noqa: SIM108 (a constexpr branch: a pointer is loaded only with PAD_AT)
            pad_rows = tl.load(pad)
        else:
            pad_rows = pad

        m = tl.load(sinks + h, mask=h_live, other=0.0).to(tl.float32)  # the sink: a logit, no value
        lsum = tl.full((BLOCK_H,), 1.0, tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)

        # Raw keys: slot j of query t is keys row t + j; rows below pad are before position 0 (only
        # the first W - 1 queries of a prompt have any: masked, not skipped).
        for j0 in range(0, WINDOW, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            live = (j < WINDOW) & (t + j >= pad_rows)
            k = tl.load(
                keys + (t + j)[:, None] * dim + d[None, :], mask=live[:, None] & d_live[None, :], other=0.0
            )
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(qt, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * scale
            s = tl.where(live[None, :], s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])  # masked (-inf) -> 0
            lsum = lsum * alpha + tl.sum(p, axis=1)
            # p in the model's dtype, as the eager form's probabilities (then float32 under UPCAST).
            acc = acc * alpha[:, None] + tl.dot(
                p.to(keys.dtype.element_ty).to(k.dtype), k, input_precision=PRECISION
            )
            m = m_new

        if HAS_EXTRA:
            # Compressed entries: all of them (HCA) or the query's picks (CSA), gathered by index.
            # The trip count is a constexpr (a power of two of blocks: few compiles as E grows) and
            # the blocks past n_extra are skipped: a loop bound from a runtime int breaks Triton's
            # interpreter under numpy 2.4, and a constexpr count keeps the loop a plain for.
            for block in range(EXTRA_BLOCKS):
                j0 = block * BLOCK_N
                if j0 < n_extra:
                    j = j0 + tl.arange(0, BLOCK_N)
                    live = j < n_extra
                    if HAS_PICKS:
                        row = tl.load(picks + t * n_extra + j, mask=live, other=0).to(tl.int64)
                    else:
                        row = j.to(tl.int64)
                    b = tl.load(bias + t * n_extra + j, mask=live, other=-float("inf"))
                    k_at = entries + row[:, None] * dim + d[None, :]
                    k = tl.load(k_at, mask=live[:, None] & d_live[None, :], other=0.0)
                    if UPCAST:
                        k = k.to(tl.float32)
                    s = (
                        tl.dot(qt, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * scale
                        + b[None, :]
                    )
                    m_new = tl.maximum(m, tl.max(s, axis=1))
                    alpha = tl.exp(m - m_new)
                    p = tl.exp(s - m_new[:, None])
                    lsum = lsum * alpha + tl.sum(p, axis=1)
                    acc = acc * alpha[:, None] + tl.dot(
                        p.to(keys.dtype.element_ty).to(k.dtype), k, input_precision=PRECISION
                    )
                    m = m_new

        o = acc / lsum[:, None]
        tl.store(out + t * heads * dim + h[:, None] * dim + d[None, :], o.to(out.dtype.element_ty), mask=hd)

    def launch(
        q: torch.Tensor,
        keys: torch.Tensor,
        pad: int | torch.Tensor,
        entries: torch.Tensor | None,
        picks: torch.Tensor | None,
        extra_bias: torch.Tensor | None,
        sinks: torch.Tensor,
        scale: float,
        **config: int,
    ) -> torch.Tensor:
        count, heads, dim = q.shape
        window = keys.shape[0] - count + 1
        config = {**(FEW_QUERIES_CONFIG if count <= FEW_QUERIES else LAUNCH_CONFIG), **config}
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        has_extra = entries is not None and extra_bias is not None and extra_bias.shape[1] > 0
        n_extra = extra_bias.shape[1] if has_extra and extra_bias is not None else 0
        block_h = min(config["block_h"], _pow2_at_least_16(heads))
        grid = (count, triton.cdiv(heads, block_h))
        kernel[grid](
            q,
            keys,
            entries if has_extra else keys,  # unread when there are no entries
            picks if picks is not None else keys,
            extra_bias if has_extra else sinks,
            sinks,
            out,
            pad,
            n_extra,
            heads,
            dim,
            scale,
            WINDOW=window,
            PAD_AT=isinstance(pad, torch.Tensor),
            EXTRA_BLOCKS=next_power_of_two(triton.cdiv(n_extra, config["block_n"])) if has_extra else 0,
            HAS_EXTRA=has_extra,
            HAS_PICKS=picks is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            # Triton 3.6's interpreter multiplies bf16 tiles as their raw bits: there the operands go
            # in as float32, which are the same numbers (bf16 x bf16 products are exact in float32,
            # and the GPU's tensor cores sum them in float32 too).
            UPCAST=q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
            BLOCK_H=block_h,
            BLOCK_N=config["block_n"],
            BLOCK_D=_pow2_at_least_16(dim),
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
        return out

    return on_its_device(launch)
