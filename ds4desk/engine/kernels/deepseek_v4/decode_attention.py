"""DeepSeek-V4's decode attention core as one op: one query token's H heads against the sliding
ring plus (HCA) every compressed entry or (CSA) the indexer's picks among them, with the per-head
sink logit, the values being the keys, and the output's rope dims rotated back.

Eagerly this is ~12 kernels a layer, among them a concatenation that copies the ring and the
compressed keys (up to 640 x 512 rows at Flash's shapes) and, for CSA, two gathers of the picks.
On NVIDIA GPUs with Triton it is two kernels (flash-decoding): the first splits the keys across
programs, each scoring its block of keys for a block of heads and accumulating a slice of the
head dim of the values (all heads share one K=V head, so a key block is read once for every head
of the block), reading the picks and positions from device tensors; the second merges the splits
with the sink, rotates the rope dims back in float32 and rounds once. Nothing syncs the host and
every shape is static, so a CUDA graph captures it. Elsewhere (CPU, ROCm, no Triton) the eager form
runs, with the same math.

The fused path goes through a torch custom op, so a CUDA graph capture and a dispatch-level op
counter (bench/count_ops.py) see one op whatever runs inside.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device

# Default: the fused kernels where they can run (NVIDIA CUDA tensors, Triton importable; NVIDIA only:
# they were written for an H200, never run on ROCm, where is_cuda holds too). Forced on: always through
# the custom op (on the CPU its body is the eager math: what bench/count_ops.py uses to count a fused
# step without a GPU); off: the eager ops.
SWITCH = Switch(
    "deepseek_v4.decode_attention",
    "DeepSeek-V4's decode attention core (ring, compressed entries, sink) as two kernels",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)


def reference(
    q: torch.Tensor,
    ring: torch.Tensor,
    ring_ready: torch.Tensor,
    extra: torch.Tensor | None,
    extra_ready: torch.Tensor | None,
    picks: torch.Tensor | None,
    sinks: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    turn: torch.Tensor,
) -> torch.Tensor:
    """The eager form: q [H, d], ring [W, d] with ring_ready [W] (the position from which each
    slot is visible), extra [E, d] with extra_ready [E] (compressed entries; None: none), picks
    [k] (CSA: the entries scored, as indices into extra; None: all of them), sinks [H] float32,
    pos int64 [1], turn complex64 [1, r / 2] (the query's rotation) -> out [H, d] in q's dtype."""
    keys, ready = ring, ring_ready
    if extra is not None and extra_ready is not None:
        if picks is not None:
            extra, extra_ready = extra.index_select(0, picks), extra_ready.index_select(0, picks)
        keys, ready = torch.cat([ring, extra]), torch.cat([ready, extra_ready])
    bias = torch.where(ready <= pos, 0.0, -math.inf)  # [keys]
    # One softmax over raw and compressed keys and the per-head sink logit (no value).
    logits = torch.add(bias, torch.mm(q, keys.t()), alpha=scale)  # [H, keys] float32
    probs = torch.softmax(torch.cat([logits, sinks.unsqueeze(1)], dim=1), dim=-1)
    out = torch.mm(probs[:, :-1].to(keys.dtype), keys)  # [H, d]
    # V = K carries the key's rotation; rotating back by the query's angle leaves relative ones.
    return _rotate_back_(out, turn)


def _rotate_back_(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """deepseek_v4._rope_ by conj(turn), in place (that module imports this one)."""
    dims = 2 * turn.shape[-1]
    rot = x[..., -dims:]
    pairs = torch.view_as_complex(rot.float().unflatten(-1, (-1, 2)))
    rot.copy_(torch.view_as_real(pairs * torch.conj_physical(turn)).flatten(-2))
    return x


@torch.library.custom_op("ds4desk::v4_decode_attention", mutates_args=())
def _fused_op(
    q: torch.Tensor,
    ring: torch.Tensor,
    ring_ready: torch.Tensor,
    extra: torch.Tensor | None,
    extra_ready: torch.Tensor | None,
    picks: torch.Tensor | None,
    sinks: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    turn: torch.Tensor,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(q) else None
    if kernel is None:
        return reference(q, ring, ring_ready, extra, extra_ready, picks, sinks, pos, scale, turn)
    return kernel(q, ring, ring_ready, extra, extra_ready, picks, sinks, pos, scale, turn)


@_fused_op.register_fake
def _(
    q: torch.Tensor,
    ring: torch.Tensor,
    ring_ready: torch.Tensor,
    extra: torch.Tensor | None,
    extra_ready: torch.Tensor | None,
    picks: torch.Tensor | None,
    sinks: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    turn: torch.Tensor,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def enabled(where: Where) -> bool:
    """Whether decode_attention runs the fused kernels for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def decode_attention(
    q: torch.Tensor,
    ring: torch.Tensor,
    ring_ready: torch.Tensor,
    extra: torch.Tensor | None,
    extra_ready: torch.Tensor | None,
    picks: torch.Tensor | None,
    sinks: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    turn: torch.Tensor,
) -> torch.Tensor:
    """out [H, d] (see reference for the arguments), fused where it can be (see SWITCH)."""
    if (extra is None) != (extra_ready is None) or (picks is not None and extra is None):
        raise ValueError("extra and extra_ready come together, and picks need extra")
    if enabled(q):
        return _fused_op(q, ring, ring_ready, extra, extra_ready, picks, sinks, pos, scale, turn)
    return reference(q, ring, ring_ready, extra, extra_ready, picks, sinks, pos, scale, turn)


def _pow2(n: int, low: int, high: int) -> int:
    return max(low, min(high, next_power_of_two(n)))


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton launcher, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit
    def split_kernel(
        q,
        ring,
        ring_ready,
        extra,
        extra_ready,
        picks,
        pos_at,
        part_acc,
        part_m,
        part_l,
        heads,
        dim,
        window,
        count,
        ring_ready_stride,
        extra_ready_stride,
        scale,
        HAS_PICKS: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TILES: tl.constexpr,
        K_TILES: tl.constexpr,
        BH: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BD: tl.constexpr,
    ):
        """Program (split, head block, value slice): keys [split * TILES * BN, +TILES * BN) of the
        logical list [ring slots | extra (or extra[picks])], unnormalised: acc [BH, BD] and the
        running max m and sum l of exp(score - m) [BH]."""
        split = tl.program_id(0)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        live_h = h < heads
        cols = tl.program_id(2) * BD + tl.arange(0, BD)
        live_c = cols < dim
        pos = tl.load(pos_at)
        m = tl.full((BH,), -1.0e30, tl.float32)  # finite: a block with no visible key adds exp(-inf) = 0
        total = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, BD), tl.float32)
        first = split * (TILES * BN)
        for tile in range(TILES):  # a constant: the interpreter loops over no runtime bound
            n = first + tile * BN + tl.arange(0, BN)
            live_n = n < count
            in_ring = live_n & (n < window)
            in_extra = live_n & (n >= window)
            row = tl.load(picks + (n - window), mask=in_extra, other=0) if HAS_PICKS else n - window
            # A masked load reads nothing and gives 0: each key comes from exactly one of the two.
            ready = tl.load(ring_ready + n * ring_ready_stride, mask=in_ring, other=0) + tl.load(
                extra_ready + row * extra_ready_stride, mask=in_extra, other=0
            )
            visible = live_n & (ready <= pos)
            scores = tl.zeros((BH, BN), tl.float32)
            for chunk in range(K_TILES):
                kc = chunk * BK + tl.arange(0, BK)
                live_k = kc < dim
                qt = tl.load(
                    q + h[:, None] * dim + kc[None, :], mask=live_h[:, None] & live_k[None, :], other=0
                )
                kt = tl.load(
                    ring + n[None, :] * dim + kc[:, None], mask=in_ring[None, :] & live_k[:, None], other=0
                ) + tl.load(
                    extra + row[None, :] * dim + kc[:, None],
                    mask=in_extra[None, :] & live_k[:, None],
                    other=0,
                )
                if UPCAST:
                    qt, kt = qt.to(tl.float32), kt.to(tl.float32)
                scores += tl.dot(qt, kt, input_precision=PRECISION)  # [BH, BN]
            scores = tl.where(visible[None, :], scores * scale, -float("inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(
                ring + n[:, None] * dim + cols[None, :], mask=in_ring[:, None] & live_c[None, :], other=0
            ) + tl.load(
                extra + row[:, None] * dim + cols[None, :], mask=in_extra[:, None] & live_c[None, :], other=0
            )
            pv = p.to(ring.dtype.element_ty)  # the probabilities in the keys' dtype, as the eager form
            if UPCAST:
                pv, v = pv.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
            m = m_new
        at = split * heads + h
        tl.store(part_acc + at[:, None] * dim + cols[None, :], acc, mask=live_h[:, None] & live_c[None, :])
        first_slice = tl.program_id(2) == 0  # every slice computed the same m and l
        tl.store(part_m + at, m, mask=live_h & first_slice)
        tl.store(part_l + at, total, mask=live_h & first_slice)

    @triton.jit
    def merge_kernel(
        part_acc,
        part_m,
        part_l,
        sinks,
        turn,
        out,
        heads,
        dim,
        rope_start,
        SPLITS: tl.constexpr,
        BD: tl.constexpr,
        BS: tl.constexpr,
    ):
        """Program (head, column slice): the splits and the sink's exp in one softmax, then the
        rope dims (interleaved pairs from rope_start) rotated back by conj(turn), then one rounding."""
        h = tl.program_id(0)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        live = cols < dim
        s = tl.arange(0, BS)
        live_s = s < SPLITS
        ms = tl.load(part_m + s * heads + h, mask=live_s, other=-float("inf"))
        ls = tl.load(part_l + s * heads + h, mask=live_s, other=0.0)
        sink = tl.load(sinks + h).to(tl.float32)
        top = tl.maximum(tl.max(ms, axis=0), sink)
        denominator = tl.sum(ls * tl.exp(ms - top), axis=0) + tl.exp(sink - top)
        partner = cols ^ 1  # the other half of a rope pair
        own = tl.zeros((BD,), tl.float32)
        other = tl.zeros((BD,), tl.float32)
        for i in range(SPLITS):
            weight = tl.exp(tl.load(part_m + i * heads + h) - top)
            base = part_acc + (i * heads + h) * dim
            own += weight * tl.load(base + cols, mask=live, other=0.0)
            other += weight * tl.load(base + partner, mask=live, other=0.0)
        own = own / denominator
        other = other / denominator
        rot = live & (cols >= rope_start)
        pair = (cols - rope_start) // 2
        cos = tl.load(turn + 2 * pair, mask=rot, other=1.0)
        sin = tl.load(turn + 2 * pair + 1, mask=rot, other=0.0)
        # (x0 + i x1) e^{-iφ} = (x0 cos + x1 sin) + i (x1 cos - x0 sin)
        even = (cols % 2) == 0
        turned = tl.where(even, own * cos + other * sin, own * cos - other * sin)
        result = tl.where(rot, turned, own)
        tl.store(out + h * dim + cols, result.to(out.dtype.element_ty), mask=live)

    def launch(
        q: torch.Tensor,
        ring: torch.Tensor,
        ring_ready: torch.Tensor,
        extra: torch.Tensor | None,
        extra_ready: torch.Tensor | None,
        picks: torch.Tensor | None,
        sinks: torch.Tensor,
        pos: torch.Tensor,
        scale: float,
        turn: torch.Tensor,
        *,
        block_d: int = 128,
        per_split: int | None = None,
    ) -> torch.Tensor:
        """block_d and per_split are tuning knobs (tests shrink them to exercise many programs)."""
        heads, dim = q.shape
        window = ring.shape[0]
        rope = 2 * turn.shape[-1]
        if dim % 2 or rope > dim:
            raise ValueError(f"head dim {dim} must be even and hold the {rope} rope dims")
        if ring.dtype != q.dtype or (extra is not None and extra.dtype != q.dtype):
            raise ValueError(f"the keys must be in the query's dtype {q.dtype}")
        q, ring = q.contiguous(), ring.contiguous()
        if extra is None or extra_ready is None:
            extra, extra_ready, count = ring, ring_ready, window  # never read: no key is past the ring
        else:
            extra = extra.contiguous()
            count = window + (picks.shape[0] if picks is not None else extra.shape[0])
        device = q.device
        bh = _pow2(heads, 16, 64)
        bd = _pow2(dim, 16, block_d)
        bk = _pow2(dim, 16, 64)
        bn = 32 if count > 16 and (per_split is None or per_split % 32 == 0) else 16
        # Triton 3.6's CPU interpreter (CPU tensors reach the kernel only there) multiplies 16-bit
        # tiles as their raw bits: there they go in as float32, the same numbers (16-bit products are
        # exact in float32, and the GPU's tensor cores sum them in float32 too).
        upcast = not q.is_cuda and q.dtype != torch.float32
        head_blocks, slices = triton.cdiv(heads, bh), triton.cdiv(dim, bd)
        if per_split is None:
            # Enough programs to fill an H200's 132 SMs, a whole number of key blocks each.
            wanted = triton.cdiv(264, head_blocks * slices)
            per_split = max(bn, triton.cdiv(triton.cdiv(count, wanted), bn) * bn)
        per_split = triton.cdiv(per_split, bn) * bn
        splits = triton.cdiv(count, per_split)
        part_acc = torch.empty((splits, heads, dim), device=device, dtype=torch.float32)
        part_m = torch.empty((splits, heads), device=device, dtype=torch.float32)
        part_l = torch.empty((splits, heads), device=device, dtype=torch.float32)
        split_kernel[(splits, head_blocks, slices)](
            q,
            ring,
            ring_ready,
            extra,
            extra_ready,
            picks if picks is not None else ring_ready,  # never read without HAS_PICKS
            pos,
            part_acc,
            part_m,
            part_l,
            heads,
            dim,
            window,
            count,
            ring_ready.stride(0),
            extra_ready.stride(0),
            scale,
            HAS_PICKS=picks is not None,
            PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",  # tf32: ignored for 16 bits
            UPCAST=upcast,
            TILES=per_split // bn,
            K_TILES=triton.cdiv(dim, bk),
            BH=bh,
            BN=bn,
            BK=bk,
            BD=bd,
            num_warps=8 if bh * bd > 4096 else 4,
        )
        out = torch.empty((heads, dim), device=device, dtype=q.dtype)
        merge_bd = _pow2(dim, 16, 128)
        merge_kernel[(heads, triton.cdiv(dim, merge_bd))](
            part_acc,
            part_m,
            part_l,
            sinks,
            torch.view_as_real(turn.reshape(-1).contiguous()),
            out,
            heads,
            dim,
            dim - rope,
            SPLITS=splits,
            BD=merge_bd,
            BS=_pow2(splits, 2, 1 << 20),
        )
        return out

    return on_its_device(launch)
