"""One token's grouped-query attention over a KV cache, for the graphed dense decode step (and a
few tokens' at consecutive positions: a verify step or a prompt piece).

The eager form (baddbmm with a -inf bias over the span, softmax, bmm) is a handful of small kernels
a layer, ~20 us of a ~100 us layer on an H200 at batch 1. On NVIDIA GPUs with Triton it is two
kernels, flash-decoding style: the first splits the span into blocks, and each program reads one
block of keys and values once for all the query heads of its kv head and leaves a partial max, sum
and weighted value sum (float32); the second combines the blocks. The position is read on the
device, so the pair can be captured in a CUDA graph whose span is fixed; blocks past the position
(or before the window) do no loads. Elsewhere (CPU, ROCm, no Triton) the eager form runs.

With `tokens` T > 1, q is the T tokens' query heads [T, H, D] as the projection lays them out
(positions pos..pos+T-1) and so is the result: the kernels read and write them through strides, so
no copy regroups them. A kv head's program takes its G query heads of every token as G * T rows
(row g * T + t), each masked at its own position: splitting the span keeps a short query block over
a long cache from running on as few programs as it has kv heads, which is what SDPA's fused kernels
do with it.

The fused path goes through a torch custom op, so a CUDA graph capture and a dispatch-level op
counter (bench/count_ops.py) see one op whatever runs inside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ds4desk.engine.formats import gguf_type
from ds4desk.engine.kernels.launch import Switch, Where, nvidia, on_its_device, pdl

# Default: the fused kernel where it can run (NVIDIA CUDA tensors, Triton importable). Forced on:
# always through the custom op (on the CPU its body is the eager math); off: the eager ops.
SWITCH = Switch(
    "dense.decode_attention",
    "the dense decode step's attention as two flash-decoding kernels",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

# Keys a program's inner loop reads at once, and how many programs the first kernel aims for per
# streaming multiprocessor (two: one can load while the other computes).
BLOCK_N = 64
PROGRAMS_PER_SM = 2
DEFAULT_SMS = 132  # an H200; used where the device cannot be asked (Triton's CPU interpreter)


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    tokens: int = 1,
) -> torch.Tensor:
    """The eager form. q [KV, G, D] (one token), or [T, H, D] for `tokens` T > 1 (head h reads kv
    head h // G); keys, values [KV, span, D]; pos int64 [1] on q's device. Key row j is visible to a
    query at p iff j <= p and (no window or j > p - window). Returns q's shape."""
    if tokens == 1:
        return _rows_reference(q, keys, values, pos, scale, window, 1)
    count, heads, dim = q.shape
    kv_heads = keys.shape[0]
    rows = q.reshape(count, kv_heads, -1, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    out = _rows_reference(rows, keys, values, pos, scale, window, tokens)
    return out.view(kv_heads, -1, count, dim).permute(2, 0, 1, 3).reshape(count, heads, dim)


def _rows_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    tokens: int,
) -> torch.Tensor:
    """reference over a kv head's query rows q [KV, G * T, D], row g * T + t at pos + t."""
    kv_heads, rows, _ = q.shape
    span = keys.shape[1]
    key_at = torch.arange(span, device=q.device)
    query_at = (pos + torch.arange(rows, device=q.device) % tokens)[:, None]  # [G * T, 1]
    allowed = key_at <= query_at
    if window is not None:
        allowed = allowed & (key_at > query_at - window)
    bias = torch.zeros((rows, span), dtype=q.dtype, device=q.device).masked_fill_(~allowed, -torch.inf)
    scores = torch.baddbmm(bias.expand(kv_heads, rows, span), q, keys.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, values)


@torch.library.custom_op("ds4desk::decode_attention", mutates_args=("ordered",))
def _fused_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    ordered: torch.Tensor | None,
    order_kind: int,
    order_groups: int,
    tokens: int = 1,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(q) else None
    if kernel is None:
        out = reference(q, keys, values, pos, scale, window, tokens).contiguous()
        if ordered is not None:
            index = read_order_index(order_kind, order_groups, out.numel(), out.device)
            ordered.index_copy_(0, index, out.flatten().float())
        return out
    return kernel(q, keys, values, pos, scale, window, ordered, order_kind, order_groups, tokens)


@_fused_op.register_fake
def _(q, keys, values, pos, scale, window, ordered, order_kind, order_groups, tokens=1):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def enabled(where: Where) -> bool:
    """Whether decode_attention runs the fused kernel for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    ordered: tuple[torch.Tensor, int, int] | None = None,
    tokens: int = 1,
) -> torch.Tensor:
    """Attention of q [KV, G, D] over keys / values [KV, span, D] (views of a cache: strides are
    honoured, the last one must be 1) at the position in `pos` (int64 [1], read on the device), in
    q's dtype, fused where it can be (see SWITCH). `tokens` T > 1: q [T, H, D] (any row stride)
    holds T tokens at pos..pos+T-1 and the result is [T, H, D] (see the module docstring).

    ordered: (buffer, GGUF type id, groups a tile): the result is also written, as float32 values of
    q's dtype, into the buffer in the read order of the one-row GEMV that reads it next (the output
    projection; gguf_gemv1_triton.read_slot), which saves that GEMV's input kernel. Only on the
    fused path."""
    fits = q.dim() == 3 and keys.dim() == 3 and keys.shape == values.shape and keys.shape[2] == q.shape[2]
    # One token: q [KV, G, D]; several: [T, H, D] with H a multiple of KV.
    if not fits or (q.shape[0] != keys.shape[0] if tokens == 1 else q.shape[1] % keys.shape[0]):
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}"
        )
    if tokens < 1 or (tokens > 1 and q.shape[0] != tokens):
        raise ValueError(f"q {tuple(q.shape)} is not {tokens} tokens' query heads")
    if ordered is not None and tokens != 1:
        raise ValueError("decode_attention writes a read-order copy for one token only")
    if enabled(q.device):
        buffer, kind, groups = ordered if ordered is not None else (None, 0, 1)
        return _fused_op(q, keys, values, pos, scale, window, buffer, kind, groups, tokens)
    if ordered is not None:
        raise ValueError("decode_attention writes a read-order copy only on its fused path")
    return reference(q, keys, values, pos, scale, window, tokens)


def read_order_index(kind: int, groups: int, cols: int, device: torch.device) -> torch.Tensor:
    """Where each of a row's `cols` values goes in the read order of a one-row GEMV of GGUF type
    `kind` with tiles of `groups` groups: gguf_gemv1_triton.read_slot in torch (int64 [cols])."""
    col = torch.arange(cols, device=device)
    if gguf_type(kind).name == "Q4_K":
        group, r = col // 64, col % 64
        slot = (r % 32) // 4 * 8 + (r // 32) * 4 + r % 4
    elif gguf_type(kind).name == "Q6_K":
        group, r = col // 128 * 2 + (col % 32) // 16, col % 128
        slot = (r % 16) // 4 * 16 + (r // 32) * 4 + r % 4
    else:
        raise ValueError(f"{gguf_type(kind).name} reads its input in row order")
    return group // groups * (groups * 64) + slot * groups + group % groups


def plan_splits(span: int, kv_heads: int, sms: int, block: int | None = None) -> tuple[int, int]:
    """(splits, keys per split): enough programs to fill the GPU, each a whole number of blocks
    (of BLOCK_N keys unless `block` says otherwise)."""
    block = block or BLOCK_N
    blocks = -(-span // block)
    wanted = max(1, min(blocks, -(-PROGRAMS_PER_SM * sms // kv_heads)))
    per_split = -(-blocks // wanted)
    return -(-blocks // per_split), per_split * block


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton launcher, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl

        from ds4desk.engine.kernels.quant.gguf_gemv1_triton import read_slot
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit
    def split_kernel(
        q,
        keys,
        values,
        pos_ptr,
        part_max,
        part_sum,
        part_acc,
        qk_scale,  # scale * log2(e): the exponentials are exp2
        span,
        window,
        chunk,
        splits,
        stride_qh,
        stride_qg,
        stride_qt,
        stride_kh,
        stride_kn,
        stride_vh,
        stride_vn,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
        WINDOWED: tl.constexpr,
        F32: tl.constexpr,
        PDL: tl.constexpr,
        TOKENS: tl.constexpr = 1,
    ):
        if PDL:  # launched early (launch.PDL): the cache row at pos comes from the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        head = tl.program_id(0)
        split = tl.program_id(1)
        pos = tl.load(pos_ptr).to(tl.int32)
        lo = split * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, span), pos + TOKENS)
        if WINDOWED:
            lo = tl.maximum(lo, pos - window + 1)

        g = tl.arange(0, BLOCK_G)
        at = pos + g % TOKENS  # each query row's position
        d = tl.arange(0, BLOCK_D)
        g_live = g < GROUP
        d_live = d < DIM
        qt = tl.load(  # row g is query head g // TOKENS of token g % TOKENS
            q
            + head * stride_qh
            + (g // TOKENS)[:, None] * stride_qg
            + (g % TOKENS)[:, None] * stride_qt
            + d[None, :],
            mask=g_live[:, None] & d_live[None, :],
            other=0.0,
        )
        if F32:
            qt = qt.to(tl.float32)
        k_base = keys + head * stride_kh
        v_base = values + head * stride_vh
        best = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        # Starting at lo (not at a block boundary) leaves every tile's first key visible, so the
        # running max is finite after the first tile; a split wholly past the position (or before
        # the window) loads nothing. TILES is a constant: tiles past hi are masked out entirely.
        if lo < hi:
            for tile in range(TILES):
                n = lo + tile * BLOCK + tl.arange(0, BLOCK)
                live = n < hi
                kt = tl.load(
                    k_base + n[:, None] * stride_kn + d[None, :],
                    mask=live[:, None] & d_live[None, :],
                    other=0.0,
                )
                if F32:
                    s = tl.dot(qt, tl.trans(kt.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(qt, tl.trans(kt))
                if TOKENS == 1:
                    s = tl.where(live[None, :], s * qk_scale, float("-inf"))
                else:
                    seen = live[None, :] & (n[None, :] <= at[:, None])
                    if WINDOWED:
                        seen = seen & (n[None, :] > at[:, None] - window)
                    s = tl.where(seen, s * qk_scale, float("-inf"))
                new_best = tl.maximum(best, tl.max(s, axis=1))
                ref = new_best
                if TOKENS > 1:
                    # A row may have seen no key yet (its position is earlier than this split):
                    # exponents taken from 0 there keep fade and p at 0 rather than NaN.
                    ref = tl.where(new_best == float("-inf"), 0.0, new_best)
                fade = tl.exp2(best - ref)
                p = tl.exp2(s - ref[:, None])
                total = total * fade + tl.sum(p, axis=1)
                vt = tl.load(
                    v_base + n[:, None] * stride_vn + d[None, :],
                    mask=live[:, None] & d_live[None, :],
                    other=0.0,
                )
                if F32:
                    acc = acc * fade[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * fade[:, None] + tl.dot(p.to(vt.dtype), vt)
                best = new_best

        row = (head * splits + split) * GROUP + g
        tl.store(part_max + row, best, mask=g_live)
        tl.store(part_sum + row, total, mask=g_live)
        tl.store(part_acc + row[:, None] * DIM + d[None, :], acc, mask=g_live[:, None] & d_live[None, :])

    @triton.jit
    def combine_kernel(
        part_max,
        part_sum,
        part_acc,
        out,
        splits,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
        ordered=None,
        ORDER_KIND: tl.constexpr = 0,
        ORDER_G: tl.constexpr = 1,
        TOKENS: tl.constexpr = 1,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        head = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_live = s < splits
        d_live = d < DIM
        row = (head * splits + s) * GROUP + g
        best = tl.load(part_max + row, mask=s_live, other=float("-inf"))
        top = tl.max(best, axis=0)
        # Empty splits carry -inf: their weight is exactly 0 (and the top is finite, because the
        # key at the position itself is always visible).
        weight = tl.where(best == float("-inf"), 0.0, tl.exp2(best - top))
        total = tl.sum(tl.load(part_sum + row, mask=s_live, other=0.0) * weight, axis=0)
        acc = tl.load(
            part_acc + row[:, None] * DIM + d[None, :], mask=s_live[:, None] & d_live[None, :], other=0.0
        )
        result = tl.sum(acc * weight[:, None], axis=0) / total
        col = (head * GROUP + g) * DIM + d
        if TOKENS == 1:
            tl.store(out + col, result.to(out.dtype.element_ty), mask=d_live)
        else:  # out [T, H, D]: row g is head head * G + g // TOKENS of token g % TOKENS
            heads = tl.num_programs(0) * (GROUP // TOKENS)
            at = ((g % TOKENS) * heads + head * (GROUP // TOKENS) + g // TOKENS) * DIM + d
            tl.store(out + at, result.to(out.dtype.element_ty), mask=d_live)
        if ORDER_KIND != 0:
            value = result.to(out.dtype.element_ty).to(tl.float32)
            tl.store(ordered + read_slot(col, ORDER_KIND, ORDER_G), value, mask=d_live)

    def launch(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        pos: torch.Tensor,
        scale: float,
        window: int | None,
        ordered: torch.Tensor | None = None,
        order_kind: int = 0,
        order_groups: int = 1,
        tokens: int = 1,
    ) -> torch.Tensor:
        kv_heads, span, dim = keys.shape
        group = q.shape[1] if tokens == 1 else q.shape[1] // kv_heads * tokens  # query rows a kv head
        if tokens == 1:
            q_strides = (q.stride(0), q.stride(1), 0)
        else:  # [T, H, D]: kv head h's query heads are h * G .. h * G + G - 1
            q_strides = (group // tokens * q.stride(1), q.stride(1), q.stride(0))
        if q.stride(2) != 1 or keys.stride(2) != 1 or values.stride(2) != 1:
            raise ValueError("decode_attention needs the head dimension contiguous")
        sms = _sm_count(q.device.index or 0) if q.is_cuda else DEFAULT_SMS
        block = BLOCK_N
        splits, chunk = plan_splits(span, kv_heads, sms, block)
        part_max = torch.empty((kv_heads, splits, group), device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((kv_heads, splits, group, dim), device=q.device, dtype=torch.float32)
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        block_d = max(16, triton.next_power_of_2(dim))
        # float32 stays float32 (no TF32), like the eager matmuls; Triton's CPU interpreter multiplies
        # bfloat16 tiles wrongly (numpy has no bfloat16), so there they are widened too.
        f32 = q.dtype == torch.float32 or (not q.is_cuda and q.dtype == torch.bfloat16)
        use_pdl = pdl(q)
        split_kernel[(kv_heads, splits)](
            q,
            keys,
            values,
            pos,
            part_max,
            part_sum,
            part_acc,
            scale * 1.4426950408889634,
            span,
            0 if window is None else window,
            chunk,
            splits,
            *q_strides,
            keys.stride(0),
            keys.stride(1),
            values.stride(0),
            values.stride(1),
            GROUP=group,
            DIM=dim,
            BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot's smallest tile
            BLOCK_D=block_d,
            BLOCK=block,
            TILES=chunk // block,
            WINDOWED=window is not None,
            F32=f32,
            PDL=use_pdl,
            TOKENS=tokens,
            launch_pdl=use_pdl,
            # Pipelined float32 tiles take up to 140 KB of shared memory at head size 128: more
            # than consumer GPUs have (~100 KB). Unpipelined: 45 KB. (bf16 takes <= 41 KB anyway.)
            **({"num_stages": 1} if f32 else {}),
        )
        combine_kernel[(kv_heads, group)](
            part_max,
            part_sum,
            part_acc,
            out,
            splits,
            GROUP=group,
            DIM=dim,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
            BLOCK_D=block_d,
            PDL=use_pdl,
            ordered=ordered,
            ORDER_KIND=order_kind if ordered is not None else 0,
            ORDER_G=order_groups,
            TOKENS=tokens,
            launch_pdl=use_pdl,
        )
        return out

    return on_its_device(launch)
