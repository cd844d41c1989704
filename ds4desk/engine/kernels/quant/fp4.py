"""Products on DeepSeek-V4's packed FP4 experts without a dense copy of them.

The storage form: `packed` uint8 [E, N, K/2] (element 2b in the low nibble, 2b + 1 in the high one;
bit 3 the sign, bits 0-2 index (0, .5, 1, 1.5, 2, 3, 4, 6)), `scale` uint8 [E, N, K/32], the UE8M0
byte s meaning 2^(s - 127) for 32 consecutive values of a row.

At batch 1 a decode step reads every picked expert's weights once, so these are bandwidth problems:
on NVIDIA GPUs Triton kernels read the packed bytes and widen them in registers (never a bf16 copy
in memory), reading the expert ids on the device; prefill's rows, sorted by expert, go through a
grouped kernel that widens weight tiles in registers. Everywhere else (CPU, ROCm, no Triton, odd
shapes) the experts are dequantized to x's dtype (`fp4_dequantize_many`) and multiplied
(`reference_experts_gemv`, `reference_grouped_matmul`), with the same math.

The GEMV and the dequantization go through torch custom ops, so a CUDA graph capture and a
dispatch-level op counter (bench/count_ops.py) see one op each. None of them syncs with the host:
the expert ids are read inside the kernel, and every shape decision depends on shapes only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ds4desk.engine.formats import E2M1_VALUES, FP4_BLOCK
from ds4desk.engine.kernels.launch import Switch, Where, on_its_device, pdl
from ds4desk.engine.kernels.quant.common import device_sms, nvidia_cuda

# The e2m1 values of the 16 nibbles: bits 0-2 index the magnitudes, bit 3 is the sign.
_E2M1_SIGNED = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)

# Default: the Triton kernels where they can run (NVIDIA CUDA tensors, Triton importable, shapes they
# take). Forced on: whenever the shapes allow, whatever the device (with TRITON_INTERPRET=1 Triton's
# interpreter runs them on CPU tensors: what the tests use without a GPU); off: the torch forms.
SWITCH = Switch("quant.fp4", "the FP4 experts' GEMV, dequantization and grouped product kernels", nvidia_cuda)


def enabled(where: Where) -> bool:
    """Whether the FP4 Triton kernels run for tensors on `where`, shapes permitting (see SWITCH)."""
    return SWITCH.on(where) and _kernels() is not None


def fp4_experts_gemv(
    x: torch.Tensor,
    experts: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Row s of the result is x[s] @ W[experts[s]]ᵀ (x[0] for every s when x is one row).

    x [S, K] or [1, K] (bfloat16 or float32), experts int64 [S] on x's device, packed uint8
    [E, N, K/2], scale uint8 [E, N, K/32] -> [S, N] in x.dtype. With swiglu_limit, x is [S, 2K]
    (gate | up of each slot) and row s's input is SiLU(min(gate, limit)) · clamp(up, ±limit), rounded
    to x.dtype (DeepSeek-V4's clamped SwiGLU, inside the kernel: never stored)."""
    _, n, k = _check_fp4(packed, scale)
    slots = experts.shape[0]
    width = k if swiglu_limit is None else 2 * k
    if experts.dim() != 1 or x.dim() != 2 or x.shape[1] != width or x.shape[0] not in (1, slots):
        raise ValueError(
            f"fp4_experts_gemv: x must be [{slots} or 1, {width}] and experts [S], "
            f"got x {list(x.shape)}, experts {list(experts.shape)}"
        )
    if experts.device != x.device or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"fp4_experts_gemv: experts must be int64 on {x.device}, got {experts.dtype} on {experts.device}"
        )
    if slots == 0:
        return x.new_empty((0, n))
    plain = packed.is_contiguous() and scale.is_contiguous()
    if plain and enabled(x) and n % 16 == 0 and k % 64 == 0:
        return _fp4_gemv_op(x.contiguous(), experts, packed, scale, swiglu_limit)
    return reference_experts_gemv(x, experts, packed, scale, swiglu_limit)


def reference_experts_gemv(
    x: torch.Tensor,
    experts: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The torch form of fp4_experts_gemv (same arguments, checked there): the picked experts
    dequantized to x's dtype, then a batched product."""
    slots, k = experts.shape[0], 2 * packed.shape[2]
    if swiglu_limit is not None:
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)).to(x.dtype)
    weights = fp4_dequantize_many(packed.index_select(0, experts), scale.index_select(0, experts), x.dtype)
    if x.shape[0] == 1:
        x = x.expand(slots, k)
    return torch.bmm(weights, x.unsqueeze(-1)).squeeze(-1)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's packed uint8 [N, K/2] and scale uint8 [N, K/32] -> W [N, K] in dtype."""
    if packed.dim() != 2:
        raise ValueError(f"fp4_dequantize: packed must be one expert's [N, K/2], got {list(packed.shape)}")
    k = _check_fp4(packed.unsqueeze(0), scale.unsqueeze(0))[2]
    if enabled(packed) and k % 64 == 0:
        return _fp4_dequantize_op(packed, scale, dtype)
    return fp4_dequantize_many(packed.unsqueeze(0), scale.unsqueeze(0), dtype)[0]


def fp4_dequantize_many(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch form for experts [E, N, K/2] / [E, N, K/32] -> [E, N, K] in dtype (no host sync: no
    check for the NaN scale byte, which the loader rejects)."""
    e, n, half = packed.shape
    data = packed.view(torch.uint8).to(torch.int32)
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).view(e, n, 2 * half)
    values = _e2m1_table(packed.device).index_select(0, nibbles.view(-1)).view(e, n, 2 * half)
    one = torch.ones((), dtype=torch.float32, device=packed.device)
    factor = torch.ldexp(one, scale.view(torch.uint8).to(torch.float32) - 127)
    values = values.view(e, n, -1, FP4_BLOCK) * factor.unsqueeze(-1)
    return values.view(e, n, 2 * half).to(dtype)


def _check_fp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    if packed.dim() != 3 or packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(
            f"FP4 experts must be uint8 [E, N, K/2] with uint8 scales, got {packed.dtype} "
            f"{list(packed.shape)} / {scale.dtype}"
        )
    e, n, half = packed.shape
    k = 2 * half
    if k % FP4_BLOCK or tuple(scale.shape) != (e, n, k // FP4_BLOCK):
        raise ValueError(
            f"FP4 experts [E, N, K/2] = {list(packed.shape)} need K a multiple of {FP4_BLOCK} and scales "
            f"[{e}, {n}, {k // FP4_BLOCK}], got {list(scale.shape)}"
        )
    return e, n, k


# Built on first use, which is eager (a graph capture is always preceded by a warm-up step).
_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    if device not in _TABLES:
        _TABLES[device] = torch.tensor(_E2M1_SIGNED, dtype=torch.float32, device=device)
    return _TABLES[device]


@torch.library.custom_op("ds4desk::fp4_experts_gemv", mutates_args=())
def _fp4_gemv_op(
    x: torch.Tensor,
    experts: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    kernels = _kernels()
    assert kernels is not None
    return kernels.fp4_gemv(x, experts, packed, scale, swiglu_limit)


@_fp4_gemv_op.register_fake
def _(x, experts, packed, scale, swiglu_limit):
    return x.new_empty((experts.shape[0], packed.shape[1]))


@torch.library.custom_op("ds4desk::fp4_dequantize", mutates_args=())
def _fp4_dequantize_op(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    kernels = _kernels()
    assert kernels is not None
    return kernels.fp4_dequantize(packed, scale, dtype)


@_fp4_dequantize_op.register_fake
def _(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty((packed.shape[0], 2 * packed.shape[1]), dtype=dtype)


def fp4_grouped_matmul(
    x: torch.Tensor, group_sizes: list[int], packed: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Prefill through the experts: x [R, K] (rows sorted by expert, group_sizes[e] of them for
    expert e, a host list of length E), packed uint8 [E, N, K/2], scale uint8 [E, N, K/32] -> [R, N]
    in x.dtype, row r = x[r] @ W[its expert]ᵀ. The Triton kernel widens weight tiles in registers
    (no bf16 copy of an expert); the torch form dequantizes one expert at a time."""
    e, n, k = _check_fp4(packed, scale)
    if len(group_sizes) != e or any(size < 0 for size in group_sizes) or sum(group_sizes) != x.shape[0]:
        raise ValueError(
            f"fp4_grouped_matmul: group_sizes must be {e} counts adding up to the {x.shape[0]} rows of x"
        )
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp4_grouped_matmul: x must be [R, {k}], got {list(x.shape)}")
    plain = packed.is_contiguous() and scale.is_contiguous()
    fits = n % GROUPED_BLOCK[1] == 0 and k % GROUPED_BLOCK[2] == 0 and x.shape[0] > 0
    if plain and fits and enabled(x):
        return _grouped_triton(x.contiguous(), group_sizes, packed, scale)
    return reference_grouped_matmul(x, group_sizes, packed, scale)


def reference_grouped_matmul(
    x: torch.Tensor, group_sizes: list[int], packed: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The torch form of fp4_grouped_matmul (same arguments, checked there): one expert at a time,
    dequantized (fp4_dequantize) and multiplied."""
    out = x.new_empty((x.shape[0], packed.shape[1]))
    start = 0
    for expert, size in enumerate(group_sizes):
        if size:
            weight = fp4_dequantize(packed[expert], scale[expert], x.dtype)
            torch.matmul(x[start : start + size], weight.t(), out=out[start : start + size])
        start += size
    return out


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped kernel: the H200 sweep's best at
# Flash's prefill shapes (`python3 bench/quant_kernels.py --grouped-only`: 1.35-1.46x the 64-wide tiles).
GROUPED_BLOCK = (128, 128, 64, 8, 3)


def _grouped_triton(
    x: torch.Tensor, group_sizes: list[int], packed: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    block_m = GROUPED_BLOCK[0]
    # The tile -> (expert, first row, end row) map, built on the host from the host's group sizes.
    tiles: list[int] = []
    start = 0
    for expert, size in enumerate(group_sizes):
        for first in range(start, start + size, block_m):
            tiles += [expert, first, start + size]
        start += size
    table = torch.tensor(tiles, dtype=torch.int32).view(-1, 3).to(x.device)
    kernels = _kernels()
    assert kernels is not None
    return kernels.fp4_grouped(x, table, packed, scale)


# --- the Triton kernels ----------------------------------------------------------------------------


class _Kernels:
    """The Triton launchers (see _kernels)."""

    fp4_gemv: Callable[..., torch.Tensor]
    fp4_dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    fp4_grouped: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Launch settings the benchmark may force: {"fp4": (block_n, block_k, warps, stages)}; None uses the
# heuristic below.
OVERRIDES: dict[str, tuple[int, ...] | None] = {"fp4": None}


def fp4_config(slots: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for the FP4 experts GEMV: 16 rows by 256 values, the
    best of `bench/quant_kernels.py --decode-only` on both of Flash's expert shapes (22 / 42 µs against
    27 / 52 µs for 32 rows). The nibble decode is ALU work (~12 integer ops a byte), so few values a
    thread leave registers for the pipelined loads."""
    if OVERRIDES["fp4"] is not None:
        return tuple(OVERRIDES["fp4"])  # type: ignore[return-value]
    return 16, 256 if k % 256 == 0 else 64, 4, 3


@functools.cache
def _kernels() -> _Kernels | None:
    """The Triton launchers, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the torch forms run
        return None

    # FP4 decoding, written out in both kernels below (the interpreter cannot call a nested jit
    # function). A nibble's e2m1 bits (e, m) placed as fp16's lowest exponent bits and top mantissa bit
    # read 2^(e-15)(1 + m/2), or m 2^-15 as a subnormal for e = 0: the value times 2^-14, exactly, with
    # no table and no special case. The 2^14 goes into the block factor 2^(s - 127), built as the
    # float32 bits of biased exponent s + 14.
    @triton.jit
    def fp4_gemv_kernel(
        x,
        X_STRIDE,
        experts,
        packed,
        scale,
        out,
        N,
        limit,
        K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWIGLU: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Tiles of [BLOCK_N rows, G groups of 32 values = 16 bytes]: each group's sum gets its scale.
        G: tl.constexpr = BLOCK_K // 32
        pid_n = tl.program_id(0)
        slot = tl.program_id(1)
        if PDL:  # the expert ids come from the kernel before: wait for it before reading them
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        e = tl.load(experts + slot).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.arange(0, G)
        byte = g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16]
        half = K // 2
        groups = K // 32
        rows = e * N + n.to(tl.int64)
        p_rows = packed + rows[:, None, None] * half + byte[None, :, :]
        s_rows = scale + rows[:, None] * groups + g[None, :]
        x_row = x + slot * X_STRIDE + 2 * byte
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            p = tl.load(p_rows + k0 // 2).to(tl.uint16)
            if SWIGLU:  # the input is SiLU(min(gate, limit)) · clamp(up, ±limit), rounded to x's dtype
                g_even = tl.minimum(tl.load(x_row + k0).to(tl.float32), limit)
                g_odd = tl.minimum(tl.load(x_row + k0 + 1).to(tl.float32), limit)
                u_even = tl.load(x_row + K + k0).to(tl.float32)
                u_odd = tl.load(x_row + K + k0 + 1).to(tl.float32)
                u_even = tl.minimum(tl.maximum(u_even, -limit), limit)
                u_odd = tl.minimum(tl.maximum(u_odd, -limit), limit)
                x_even = (g_even * tl.sigmoid(g_even) * u_even).to(x.dtype.element_ty).to(tl.float32)
                x_odd = (g_odd * tl.sigmoid(g_odd) * u_odd).to(x.dtype.element_ty).to(tl.float32)
            else:
                x_even = tl.load(x_row + k0).to(tl.float32)
                x_odd = tl.load(x_row + k0 + 1).to(tl.float32)
            lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (((p & 0x80) << 8) | ((p & 0x70) << 5)).to(tl.float16, bitcast=True).to(tl.float32)
            dots = lo * x_even[None, :, :] + hi * x_odd[None, :, :]
            factor = ((tl.load(s_rows + k0 // 32).to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
            acc += tl.sum(tl.sum(dots, axis=2) * factor, axis=1)
        tl.store(out + slot * N + n, acc.to(out.dtype.element_ty))

    @triton.jit
    def fp4_dequantize_kernel(packed, scale, out, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        G: tl.constexpr = BLOCK_K // 32
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        g = tl.arange(0, G)
        byte = g[:, None] * 16 + tl.arange(0, 16)[None, :]
        rows = n.to(tl.int64)
        p = tl.load(packed + rows[:, None, None] * (K // 2) + k0 // 2 + byte[None, :, :]).to(tl.uint16)
        sc = tl.load(scale + rows[:, None] * (K // 32) + k0 // 32 + g[None, :])
        factor = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
        lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32) * factor
        hi = (((p & 0x80) << 8) | ((p & 0x70) << 5)).to(tl.float16, bitcast=True).to(tl.float32) * factor
        values = tl.interleave(lo, hi)  # [BLOCK_N, G, 32]: element 2b from the low nibble
        col = g[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(out + rows[:, None, None] * K + k0 + col[None, :, :], values.to(out.dtype.element_ty))

    @triton.jit
    def fp4_grouped_kernel(
        x,
        tiles,
        packed,
        scale,
        out,
        N,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        G: tl.constexpr = BLOCK_K // 32
        expert = tl.load(tiles + tl.program_id(0) * 3).to(tl.int64)
        first = tl.load(tiles + tl.program_id(0) * 3 + 1)
        end = tl.load(tiles + tl.program_id(0) * 3 + 2)
        r = first + tl.arange(0, BLOCK_M)
        live = r < end
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.arange(0, G)
        byte = g[:, None] * 16 + tl.arange(0, 16)[None, :]
        w_rows = expert * N + n.to(tl.int64)
        p_rows = packed + w_rows[:, None, None] * (K // 2) + byte[None, :, :]
        s_rows = scale + w_rows[:, None] * (K // 32) + g[None, :]
        x_rows = x + r.to(tl.int64)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(K // BLOCK_K):
            k0 = step * BLOCK_K
            p = tl.load(p_rows + k0 // 2).to(tl.uint16)
            sc = tl.load(s_rows + k0 // 32)
            factor = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
            lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32) * factor
            hi = (((p & 0x80) << 8) | ((p & 0x70) << 5)).to(tl.float16, bitcast=True).to(tl.float32) * factor
            w = tl.reshape(tl.interleave(lo, hi), (BLOCK_N, BLOCK_K))
            xv = tl.load(x_rows + k0, mask=live[:, None], other=0.0)
            if DOT_F32:
                acc += tl.dot(xv.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # the weights are exact in bfloat16 (2 significant bits times a power of two)
                acc += tl.dot(xv.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        at = out + r.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(at, acc.to(out.dtype.element_ty), mask=live[:, None])

    def fp4_grouped(
        x: torch.Tensor, tiles: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        n, k = packed.shape[1], 2 * packed.shape[2]
        block_m, block_n, block_k, warps, stages = GROUPED_BLOCK
        out = torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
        dot_f32 = x.dtype == torch.float32 or not x.is_cuda
        fp4_grouped_kernel[(tiles.shape[0], n // block_n)](
            x,
            tiles,
            packed,
            scale,
            out,
            n,
            k,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            DOT_F32=dot_f32,
            num_warps=warps,
            num_stages=stages,
        )
        return out

    def fp4_gemv(
        x: torch.Tensor,
        experts: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        swiglu_limit: float | None,
    ) -> torch.Tensor:
        slots = experts.shape[0]
        n, k = packed.shape[1], 2 * packed.shape[2]
        block_n, block_k, warps, stages = fp4_config(slots, n, k, device_sms(x))
        out = torch.empty((slots, n), device=x.device, dtype=x.dtype)
        stride = 0 if x.shape[0] == 1 else x.shape[1]
        use_pdl = pdl(x)
        fp4_gemv_kernel[(n // block_n, slots)](
            x,
            stride,
            experts,
            packed,
            scale,
            out,
            n,
            0.0 if swiglu_limit is None else swiglu_limit,
            k,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SWIGLU=swiglu_limit is not None,
            PDL=use_pdl,
            num_warps=warps,
            num_stages=stages,
            launch_pdl=use_pdl,
        )
        return out

    def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, k = packed.shape[0], 2 * packed.shape[1]
        block_k = 256 if k % 256 == 0 else 64
        block_n = 16 if n % 16 == 0 else 1
        out = torch.empty((n, k), device=packed.device, dtype=dtype)
        fp4_dequantize_kernel[(n // block_n, k // block_k)](
            packed.contiguous(), scale.contiguous(), out, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4
        )
        return out

    kernels = _Kernels()
    kernels.fp4_gemv = on_its_device(fp4_gemv)
    kernels.fp4_dequantize = on_its_device(fp4_dequantize)
    kernels.fp4_grouped = on_its_device(fp4_grouped)
    return kernels
