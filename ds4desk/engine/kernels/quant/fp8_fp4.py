"""Matrix products on DeepSeek-V4's quantized weights without a dense copy of them.

Two storage forms (fact sheet §8):
- FP8 linear: `weight` float8_e4m3fn [N, K], `scale` float32 [ceil(N/128), ceil(K/128)], a multiplier
  per 128 x 128 block: W[i, j] = weight[i, j] * scale[i // 128, j // 128].
- FP4 experts: `packed` uint8 [E, N, K/2] (element 2b in the low nibble, 2b + 1 in the high one; bit 3
  the sign, bits 0-2 index (0, .5, 1, 1.5, 2, 3, 4, 6)), `scale` uint8 [E, N, K/32], the UE8M0 byte s
  meaning 2^(s - 127) for 32 consecutive values of a row.

At batch 1 a decode step reads every weight once, so these are bandwidth problems: on NVIDIA GPUs
Triton kernels read the quantized bytes and widen them in registers (never a bf16 copy in memory).
Prefill with more than 16 rows on an H100/H200 runs FP8 x FP8 on the tensor cores (torch._scaled_mm)
with the official runtime's activation quantization. Everywhere else (CPU, ROCm, no Triton, odd
shapes) the weights are dequantized to x's dtype and multiplied, with the same math.

The Triton paths go through torch custom ops, so a CUDA graph capture and a dispatch-level op
counter (bench/count_ops.py) see one op each. None of them syncs with the host: the expert ids are
read inside the kernel, and every shape decision depends on shapes only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ds4desk.engine.formats import E2M1_VALUES, FP4_BLOCK, FP8_BLOCK
from ds4desk.engine.kernels.launch import on_its_device, pdl

# None: the Triton kernels where they can run (NVIDIA CUDA tensors, Triton importable, shapes they
# take); False: never; True: whenever the shapes allow, whatever the device (with TRITON_INTERPRET=1
# Triton's interpreter runs them on CPU tensors: what the tests use without a GPU).
TRITON: bool | None = None
# None: torch._scaled_mm for FP8 prefill where it is verified (compute capability 9.0, N and K
# multiples of 128, more than 16 rows); False: never; True: on any CUDA device where shapes allow.
SCALED_MM: bool | None = None

GEMV_MAX_ROWS = 16
_E4M3_MAX = 448.0
# The e2m1 values of the 16 nibbles: bits 0-2 index the magnitudes, bit 3 is the sign.
_E2M1_SIGNED = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _nvidia(t: torch.Tensor) -> bool:
    # NVIDIA only: the kernels were written for Hopper (H100/H200) and never tried on ROCm, where
    # t.is_cuda is also true.
    return t.is_cuda and torch.version.hip is None


def _use_triton(t: torch.Tensor) -> bool:
    if TRITON is False:
        return False
    if TRITON is None and not _nvidia(t):
        return False
    return _kernels() is not None


# --- FP8 linear ------------------------------------------------------------------------------------


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bfloat16 or float32) @ Wᵀ -> [..., N] in x.dtype, for weight float8_e4m3fn [N, K]
    and scale float32 [ceil(N/128), ceil(K/128)]."""
    n, k = _check_fp8(x, weight, scale)
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    plain = weight.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32
    if m <= GEMV_MAX_ROWS and plain and k % FP8_BLOCK == 0 and n % 16 == 0 and _use_triton(rows):
        out = _fp8_gemv_op(rows.contiguous(), weight, scale)
    elif plain and _use_scaled_mm(rows, n, k):
        out = _fp8_scaled_mm(rows, weight, scale)
    else:
        out = rows @ fp8_dequantize(weight, scale, x.dtype).t()
    return out.reshape(*lead, n)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight float8_e4m3fn [N, K] times its block scale [ceil(N/128), ceil(K/128)] -> [N, K] in dtype."""
    n, k = weight.shape
    factor = scale.to(torch.float32).repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)
    return (weight.to(torch.float32) * factor[:, :k]).to(dtype)


def fp8_row_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether fp8_row_ runs for one row x (the Triton kernel; whole 128 x 128 blocks)."""
    n, k = weight.shape
    return (
        FP8_ROW
        and x.shape[0] == 1
        and x.is_contiguous()
        and weight.dtype == torch.float8_e4m3fn
        and weight.is_contiguous()
        and scale.is_contiguous()
        and scale.dtype == torch.float32
        and n % FP8_BLOCK == 0
        and k % FP8_BLOCK == 0
        and _use_triton(x)
    )


def fp8_row_(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    swiglu_limit: float | None = None,
    residual: bool = False,
) -> torch.Tensor:
    """out [1, N] = x @ Wᵀ (residual: out += x @ Wᵀ, rounded once) in one kernel, where fp8_row_fits.
    With swiglu_limit, x is [1, 2K] gate | up and the input is SiLU(min(gate, limit)) · clamp(up,
    ±limit), rounded to x.dtype: the shared expert's activation is never stored."""
    kernels = _kernels()
    assert kernels is not None
    return kernels.fp8_row(x, weight, scale, out, swiglu_limit, residual)


def _check_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_linear: weight must be float8_e4m3fn [N, K], got {weight.dtype} {list(weight.shape)}"
        )
    n, k = weight.shape
    blocks = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if tuple(scale.shape) != blocks:
        raise ValueError(
            f"fp8_linear: scale must be {list(blocks)} for weight [{n}, {k}], got {list(scale.shape)}"
        )
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} columns, the weight {k}")
    return n, k


def _use_scaled_mm(rows: torch.Tensor, n: int, k: int) -> bool:
    if SCALED_MM is False or not rows.is_cuda or n % FP8_BLOCK or k % FP8_BLOCK:
        return False
    if rows.shape[0] <= GEMV_MAX_ROWS and SCALED_MM is None:
        return False
    if SCALED_MM:
        return True
    # The layouts below were verified on an H200 (torch 2.11); other architectures want others.
    return _nvidia(rows) and torch.cuda.get_device_capability(rows.device) == (9, 0)


def quantize_activation(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The official runtime's activation quantization: rows [M, K] (K a multiple of 128) -> (e4m3 [M, K],
    float32 scales [M, K/128]), each 1 x 128 block divided by 2^ceil(log2(amax / 448)) (1 for an
    all-zero block), so rows ≈ values * scales repeated 128 times along K."""
    m, k = rows.shape
    blocks = rows.to(torch.float32).view(m, k // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # ceil(log2(ratio)) exactly (log2 may be an ulp off on a GPU): ratio = f 2^e with f in [0.5, 1).
    mantissa, exponent = torch.frexp(amax / _E4M3_MAX)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    ones = torch.ones_like(amax)
    scales = torch.where(amax > 0, torch.ldexp(ones, exponent), ones)
    values = (blocks / scales.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(m, k), scales


def _fp8_scaled_mm(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m = rows.shape[0]
    padded = (m + 3) // 4 * 4  # _scaled_mm wants M a multiple of 4 here
    kernels = _kernels() if _use_triton(rows) else None
    if kernels is not None:  # one pass, the scales written column-major
        xq, xs = kernels.act_quant(rows.contiguous(), padded)
    else:
        if padded != m:
            rows = torch.cat([rows, rows.new_zeros((padded - m, rows.shape[1]))])
        xq, xs = quantize_activation(rows)
        xs = xs.t().contiguous().t()
    out = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=xs,  # column-major [M, K/128]: the layout the kernel accepts
        scale_b=scale.t(),  # the plain transposed view of the contiguous [N/128, K/128]
        out_dtype=torch.bfloat16,
    )
    return out[:m].to(rows.dtype)


@torch.library.custom_op("ds4desk::fp8_gemv", mutates_args=())
def _fp8_gemv_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    kernels = _kernels()
    assert kernels is not None  # only called where _use_triton said so
    return kernels.fp8_gemv(x, weight, scale)


@_fp8_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


# --- FP4 experts -----------------------------------------------------------------------------------


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
    if plain and _use_triton(x) and n % 16 == 0 and k % 64 == 0:
        return _fp4_gemv_op(x.contiguous(), experts, packed, scale, swiglu_limit)
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
    if _use_triton(packed) and k % 64 == 0:
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
    if plain and fits and _use_triton(x):
        return _grouped_triton(x.contiguous(), group_sizes, packed, scale)
    out = x.new_empty((x.shape[0], n))
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

    fp8_gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    fp8_row: Callable[..., torch.Tensor]
    fp4_gemv: Callable[..., torch.Tensor]
    fp4_dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    act_quant: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fp4_grouped: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Launch settings the benchmark may force: {"fp8": (block_n, split_k, warps, stages), "fp8_row":
# (block_n, block_k, warps), "fp4": (block_n, block_k, warps, stages)}; None uses the heuristics below.
OVERRIDES: dict[str, tuple[int, ...] | None] = {"fp8": None, "fp8_row": None, "fp4": None}


# One-row FP8 GEMVs on the row kernel (False: the split-K kernel; bench/quant_kernels.py times both).
FP8_ROW = True


def fp8_row_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the one-row FP8 GEMV: as the bf16 decode GEMV
    (decode_kernels.gemv_config), many programs of a few rows by a long run of columns, so no shape
    needs K split into parts and a second kernel to add them up. BLOCK_N divides 128 (a tile's rows
    share one row of scales), BLOCK_K is whole 128-column blocks. The H200 sweep (`bench/quant_kernels.py
    --decode-only`, docs/BENCHMARKS.md) on Flash's shapes: 4 rows a tile for up to 4096 rows of 4096+
    columns (8 warps below 2048 rows), 16 for the 32,768-row q_b, 8 otherwise; 1024 columns always."""
    if OVERRIDES["fp8_row"] is not None:
        return tuple(OVERRIDES["fp8_row"])  # type: ignore[return-value]
    block_k = next(size for size in (1024, 512, 256, 128) if k % size == 0)
    if n <= 4096 and k >= 4096:
        return 4, block_k, 8 if n < 2048 else 4
    return (16 if n >= 32768 else 8), block_k, 4


def fp8_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, SPLIT_K, num_warps, num_stages) for the FP8 GEMV. The H200 sweep (bench/quant_kernels.py
    --sweep, docs/BENCHMARKS.md) was fastest with about four programs per SM: tiles of 32 rows where
    that leaves 64 tiles or more, else 16 (with 8 warps), and K split into parts of at least four
    128-column blocks until there are that many programs."""
    if OVERRIDES["fp8"] is not None:
        return tuple(OVERRIDES["fp8"])  # type: ignore[return-value]
    block_n = 32 if n // 32 >= 64 else 16
    while n % block_n:
        block_n //= 2
    programs = n // block_n
    split = 1
    while programs * split < 4 * sms and k // (FP8_BLOCK * 2 * split) >= 4:
        split *= 2
    return block_n, split, 8 if block_n <= 16 else 4, 4


def fp4_config(slots: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for the FP4 experts GEMV: 16 rows by 256 values, the
    best of `bench/quant_kernels.py --decode-only` on both of Flash's expert shapes (22 / 42 µs against
    27 / 52 µs for 32 rows). The nibble decode is ALU work (~12 integer ops a byte), so few values a
    thread leave registers for the pipelined loads."""
    if OVERRIDES["fp4"] is not None:
        return tuple(OVERRIDES["fp4"])  # type: ignore[return-value]
    return 16, 256 if k % 256 == 0 else 64, 4, 3


def _device_sms(t: torch.Tensor) -> int:
    return _sm_count(t.device.index or 0) if t.is_cuda else 132


@functools.cache
def _kernels() -> _Kernels | None:
    """The Triton launchers, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the torch forms run
        return None

    @triton.jit
    def fp8_gemv_kernel(
        x,
        w,
        s,
        out,
        M,
        N,
        K,
        KB,
        K_PART,
        STEPS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # out[m, n] = Σ_kb scale[n // 128, kb] Σ_{k in kb} x[m, k] w[n, k]; K_PART columns per program
        # along axis 1 (SPLIT > 1: float32 partial sums into out [SPLIT, M, N], added by fp8_reduce).
        BLOCK_K: tl.constexpr = 128
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        k_start = pid_k * K_PART
        w_rows = w + n.to(tl.int64)[:, None] * K + kk[None, :]
        s_rows = s + (n // 128) * KB
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for step in range(STEPS):
                k0 = k_start + step * BLOCK_K
                wt = tl.load(w_rows + k0).to(tl.float32)
                xv = tl.load(x + k0 + kk).to(tl.float32)
                acc += tl.sum(wt * xv[None, :], axis=1) * tl.load(s_rows + k0 // 128)
            target = out + pid_k * M * N + n
            tl.store(target, acc.to(out.dtype.element_ty))
        else:
            m = tl.arange(0, BLOCK_M)
            live = m < M
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            x_rows = x + m[:, None] * K + kk[None, :]
            for step in range(STEPS):
                k0 = k_start + step * BLOCK_K
                wt = tl.load(w_rows + k0)
                xv = tl.load(x_rows + k0, mask=live[:, None], other=0.0)
                if DOT_F32:
                    part = tl.dot(xv.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(xv.to(tl.bfloat16), tl.trans(wt.to(tl.bfloat16)))
                acc2 += part * tl.load(s_rows + k0 // 128)[None, :]
            target2 = out + pid_k * M * N + m[:, None] * N + n[None, :]
            tl.store(target2, acc2.to(out.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def fp8_row_kernel(
        x,
        w,
        s,
        out,
        limit,
        K: tl.constexpr,
        KB: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWIGLU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # out[n] = Σ_kb scale[n // 128, kb] Σ_{k in kb} x[k] w[n, k] for one row x: a [BLOCK_N, G, 128]
        # tile a step, each 128-column block's sums times its scale.
        G: tl.constexpr = BLOCK_K // 128
        first = tl.program_id(0) * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, G)[:, None] * 128 + tl.arange(0, 128)[None, :]  # [G, 128]
        rows = w + n.to(tl.int64)[:, None, None] * K + cols[None, :, :]
        s_row = s + (first // 128) * KB + tl.arange(0, G)
        # No earlier kernel writes the weights: the first tile streams in while that kernel ends.
        tile = tl.load(rows)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if SWIGLU:  # x is gate | up: the input is SiLU(min(gate, limit)) · clamp(up, ±limit)
                g = tl.minimum(tl.load(x + k0 + cols).to(tl.float32), limit)
                u = tl.load(x + K + k0 + cols).to(tl.float32)
                u = tl.minimum(tl.maximum(u, -limit), limit)
                xv = (g * tl.sigmoid(g) * u).to(x.dtype.element_ty).to(tl.float32)
            else:
                xv = tl.load(x + k0 + cols).to(tl.float32)
            part = tl.sum(tile.to(tl.float32) * xv[None, :, :], axis=2)
            acc += part * tl.load(s_row + k0 // 128)[None, :]
            tile = tl.load(rows + k0 + BLOCK_K, mask=k0 + BLOCK_K < K, other=0.0)
        y = tl.sum(acc, axis=1)
        if RESIDUAL:
            y += tl.load(out + n).to(tl.float32)
        tl.store(out + n, y.to(out.dtype.element_ty))

    @triton.jit
    def fp8_reduce_kernel(parts, out, TOTAL, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < TOTAL
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(SPLIT):
            acc += tl.load(parts + p * TOTAL + i, mask=live, other=0.0)
        tl.store(out + i, acc.to(out.dtype.element_ty), mask=live)

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
    def act_quant_kernel(x, xq, xs, M, M_PAD, K, BLOCK_M: tl.constexpr):
        # quantize_activation for BLOCK_M rows x one 128-column block, rows M..M_PAD-1 zero (scale 1).
        # The scale 2^ceil(log2(amax / 448)) from amax's bits, exactly (no approximate log2 or
        # division): amax = f 2^E with f in [1, 2) and 448 = 1.75 2^8, so the exponent is E - 8, plus
        # one where f > 1.75 (mantissa bits above 0x600000).
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        kb = tl.program_id(1)
        col = kb * 128 + tl.arange(0, 128)
        at = m.to(tl.int64)[:, None] * K + col[None, :]
        v = tl.load(x + at, mask=(m < M)[:, None], other=0.0).to(tl.float32)
        bits = tl.max(tl.abs(v), axis=1).to(tl.int32, bitcast=True)
        biased = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        biased = tl.where(bits == 0, 127, tl.maximum(biased, 1))  # all zero: 1
        scale = (biased << 23).to(tl.float32, bitcast=True)
        inverse = ((254 - biased) << 23).to(tl.float32, bitcast=True)
        q = tl.clamp(v * inverse[:, None], -448.0, 448.0)
        live = m < M_PAD
        tl.store(xq + at, q.to(xq.dtype.element_ty), mask=live[:, None])
        tl.store(xs + kb * M_PAD + m, scale, mask=live)  # [K/128, M_PAD]: column-major [M_PAD, K/128]

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

    def act_quant(
        rows: torch.Tensor, padded: int, dtype: torch.dtype = torch.float8_e4m3fn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # dtype float32: the values before their rounding to e4m3 (Triton's interpreter rounds some
        # values to the wrong e4m3 neighbour: the tests check the math before the conversion).
        m, k = rows.shape
        xq = torch.empty((padded, k), device=rows.device, dtype=dtype)
        xs = torch.empty((k // FP8_BLOCK, padded), device=rows.device, dtype=torch.float32)
        block_m = 16
        act_quant_kernel[(triton.cdiv(padded, block_m), k // FP8_BLOCK)](
            rows, xq, xs, m, padded, k, BLOCK_M=block_m, num_warps=4
        )
        return xq, xs.t()

    def fp8_row(
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        out: torch.Tensor | None = None,
        swiglu_limit: float | None = None,
        residual: bool = False,
    ) -> torch.Tensor:
        n, k = weight.shape
        block_n, block_k, warps = fp8_row_config(n, k)
        if out is None:
            out = torch.empty((1, n), device=x.device, dtype=x.dtype)
        use_pdl = pdl(x)
        fp8_row_kernel[(n // block_n,)](
            x,
            weight,
            scale,
            out,
            0.0 if swiglu_limit is None else swiglu_limit,
            K=k,
            KB=scale.shape[1],
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SWIGLU=swiglu_limit is not None,
            RESIDUAL=residual,
            PDL=use_pdl,
            num_warps=warps,
            launch_pdl=use_pdl,
        )
        return out

    def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        if fp8_row_fits(x, weight, scale):
            return fp8_row(x, weight, scale)
        block_n, split, warps, stages = fp8_config(m, n, k, _device_sms(x))
        while (k // FP8_BLOCK) % split:  # equal parts of whole 128-column blocks
            split -= 1
        k_part = k // split
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
        target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
        # The interpreter's dot mishandles bfloat16 (numpy has none); float32 gives the same products.
        dot_f32 = x.dtype == torch.float32 or not x.is_cuda
        fp8_gemv_kernel[(n // block_n, split)](
            x,
            weight,
            scale,
            target,
            m,
            n,
            k,
            scale.shape[1],
            k_part,
            k_part // FP8_BLOCK,
            BLOCK_M=1 if m == 1 else 16,
            BLOCK_N=block_n,
            SPLIT=split,
            DOT_F32=dot_f32,
            num_warps=warps,
            num_stages=stages,
        )
        if split > 1:
            total = m * n
            fp8_reduce_kernel[(triton.cdiv(total, 1024),)](target, out, total, SPLIT=split, BLOCK=1024)
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
        block_n, block_k, warps, stages = fp4_config(slots, n, k, _device_sms(x))
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
    kernels.fp8_gemv = on_its_device(fp8_gemv)
    kernels.fp8_row = on_its_device(fp8_row)
    kernels.fp4_gemv = on_its_device(fp4_gemv)
    kernels.fp4_dequantize = on_its_device(fp4_dequantize)
    kernels.act_quant = on_its_device(act_quant)
    kernels.fp4_grouped = on_its_device(fp4_grouped)
    return kernels
