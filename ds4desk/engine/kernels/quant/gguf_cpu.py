"""CPU matmuls on GGUF-packed weights: y = x @ dequantize(W)ᵀ for float32 x, read from the blocks.

The kernels are C (gguf_cpu.c, built by setup.py into `_gguf_cpu`), called with raw data pointers
after this module has checked every dtype, shape and stride, and with the GIL released:

- a few rows of x (decode, a verify step: T <= GEMV_MAX_T): passes over the packed rows that decode
  each block in registers and multiply it into up to eight rows of x at a time, split over torch's
  threads. They read the packed bytes once per pass and never make a float copy of the weight; each
  row of y gets the same sums in the same order whatever T is, so a verify step's logits are bit
  for bit a decode step's.
- prefill (AVX-512 builds; up to GEMM_MAX_T rows of x but on AMD Zen 5): a GEMM in C whose threads
  each decode a panel of 12 packed rows into their own caches and multiply it with every row of x
  while it is there; no float copy of the weight reaches memory.
- longer x elsewhere (and the portable build): a tile of rows dequantized into a bounded
  scratch, then torch.mm (oneDNN / MKL) on it, tile by tile, so a prompt goes as fast as it would on
  float weights.

All three dequantize with the same float32 operations as the reference (quant/gguf.py), so they differ
from `gguf_matmul.reference_matmul` only in the order of the sums.

BF16_PREFILL, opt-in (a load's `cpu_prefill="bfloat16"`, which Runtime turns on around that model's
prompts; DS4DESK_CPU_BF16_PREFILL=1 for the whole process; on a CPU with AVX-512 BF16 only), trades
that for speed: prefill's tiles are those values rounded to bfloat16 and so is x; oneDNN's bfloat16 product
sums in float32 and rounds its result to bfloat16. The products run about 3x faster on Zen 4 and a
small model's prefill 1.4-2.1x (docs/BENCHMARKS.md, CPU GGUF), but the logits move: it is off by
default because the model tests' oracles (transformers on the same values, and top-1 agreement
with llama.cpp) hold prefill to float32 error, and these roundings fail them.

`FusedLayer` runs a whole decoder layer for one token in one C call (the GEMVs above plus norms,
RoPE, the cache write and attention): on a small model the torch calls between the GEMVs cost as
much as the GEMVs. models/cpu_decode.py builds one per layer from the families' plans.

Where the extension was not built (no C compiler at install time), `covers` is False for every type
and gguf_matmul falls back to the reference; a log line at import says so.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4desk.engine.formats import GGUF_TYPES
from ds4desk.engine.kernels.launch import Switch, Where

log = logging.getLogger(__name__)

try:  # torch is imported first on purpose: the extension then shares its OpenMP runtime (see the C file)
    from ds4desk.engine.kernels.quant import _gguf_cpu as _ext
except ImportError as error:  # an install without a C compiler
    _ext = None
    log.info("GGUF CPU kernels are not built (%s): packed CPU matmuls use the torch reference", error)

# Up to this many rows of x, the fused GEMV kernel; beyond, dequantized tiles and torch.mm. 16 covers
# a verify step of MAX_TOKENS (SmolLM2's Q8_0 head, one thread: 9.9 ms at T = 12 and 13.9 ms at
# T = 16 in the kernel's passes, against 24.8 and 33.5 ms dequantized).
GEMV_MAX_T = 16
# On an Intel CPU, up to this many rows of x, prefill's packed GEMM (AVX-512); beyond, dequantized
# tiles and torch.mm, whose float32 product (MKL's AVX-512 kernels) keeps more of the cores' peak on
# long inputs. On Gemma-3-270M's layer 0 (two cores of a Xeon with AVX-512): the GEMM's products take
# 0.42x the tiles' time at 32 rows, 0.75x at 128, 0.90x at 256, 1.02x at 384 and 1.04x at 512. On AMD
# CPUs MKL runs its AVX2 kernels (93 GFLOP/s a core of a Zen 5, about half its AVX-512 peak), and on a
# Zen 5 the GEMM takes every prefill: a 512-token Gemma prompt 1,150 against 700 tok/s on the tiles
# (docs/BENCHMARKS.md, CPU GGUF).
GEMM_MAX_T = 320
# Floats in one prefill tile of dequantized rows (8 MiB), which bounds the scratch.
TILE_VALUES = 1 << 21

# Every GGUF type but F32 (whose bytes already are the float32 weight the reference multiplies).
_ROW_BYTES: dict[int, tuple[int, int]] = {
    t.type_id: (t.block_values, t.block_bytes) for t in GGUF_TYPES.values() if t.name != "F32"
}
_scratches = threading.local()
_F32, _U8 = torch.float32, torch.uint8


def available() -> bool:
    """Whether the C extension was built and imported."""
    return _ext is not None


def kernel_isa() -> str:
    """The instruction set the kernels run with: "avx512", "portable", or "missing"."""
    return _ext.kernel_isa() if _ext is not None else "missing"


def bf16_products_run_fast() -> bool:
    """Whether the CPU multiplies bfloat16 natively (where the bfloat16 prefill pays) and the AVX-512
    decoders, which write bfloat16 tiles, run."""
    return kernel_isa() == "avx512" and _ext.has_avx512_bf16()


def _bf16_prefill_asked(where: Where) -> bool:
    return os.environ.get("DS4DESK_CPU_BF16_PREFILL") == "1" and bf16_products_run_fast()


BF16_PREFILL = Switch(
    "quant.gguf_cpu_bf16",
    "CPU prefill products on GGUF weights in bfloat16 (tiles and x rounded; float32 sums); opt-in",
    _bf16_prefill_asked,
)


# DS4DESK_CPU_GEMM=0 turns the packed GEMM off for a process (the benchmark's peer): prefill then
# multiplies dequantized tiles with torch.mm. Read once, since the check runs for every matmul.
_PACKED_GEMM_ASKED = os.environ.get("DS4DESK_CPU_GEMM", "1") != "0"

PACKED_GEMM = Switch(
    "quant.gguf_cpu_gemm",
    "prefill's float32 products on packed rows in C (each thread decodes a panel of rows and multiplies "
    "it with every token while it is in its caches), not dequantized tiles and torch.mm; AVX-512 only",
    lambda where: _PACKED_GEMM_ASKED,
)


def covers(type_id: int, dtype: torch.dtype) -> bool:
    """Whether `matmul` runs this type for activations of `dtype`."""
    return _ext is not None and dtype == torch.float32 and type_id in _ROW_BYTES


def matmul(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """x [T, cols] float32 times the packed [rows, cols] weight (uint8 [rows, row_bytes]) transposed,
    written into out [T, rows] float32 and returned. A ValueError for anything that does not fit."""
    # Decode calls this ~200 times a token, so the checks below are the cheap forms of each test
    # (a torch attribute costs ~0.1 us, `x.device.type` ~0.5 us); they guard the raw pointers.
    assert _ext is not None, "gguf_cpu.matmul called without the extension: check covers() first"
    block_values, block_bytes = _ROW_BYTES[type_id]
    x_shape, w_shape = x.shape, weight.shape
    if (
        len(x_shape) != 2
        or len(w_shape) != 2
        or x_shape[1] != cols
        or x.dtype is not _F32
        or out.dtype is not _F32
        or weight.dtype is not _U8
        or cols % block_values
        or w_shape[1] != cols // block_values * block_bytes
        or out.shape != (x_shape[0], w_shape[0])
        or not (x.is_cpu and weight.is_cpu and out.is_cpu)
    ):
        raise ValueError(
            f"gguf_cpu.matmul: x {tuple(x_shape)} {x.dtype}, weight {tuple(w_shape)} {weight.dtype}, "
            f"out {tuple(out.shape)} {out.dtype} do not fit a type {type_id} weight of {cols} columns"
        )
    tokens, rows = x_shape[0], w_shape[0]
    if tokens == 0 or rows == 0:
        return out
    x_strides = x.stride()
    if x_strides[1] != 1:
        x, x_strides = x.contiguous(), (cols, 1)
    w_strides = weight.stride()
    if w_strides[1] != 1:
        weight, w_strides = weight.contiguous(), (w_shape[1], 1)
    # The kernels write rows of y with a row stride: anything else gets a contiguous stand-in.
    out_strides = out.stride()
    target = out
    if out_strides[1] != 1 or (out_strides[0] < rows and tokens > 1):
        target, out_strides = torch.empty((tokens, rows), dtype=_F32), (rows, 1)
    threads = torch.get_num_threads()
    args = (
        type_id,
        weight.data_ptr(),
        w_strides[0],
        rows,
        cols,
        x.data_ptr(),
        tokens,
        x_strides[0],
        target.data_ptr(),
        out_strides[0],
        threads,
    )
    if tokens <= GEMV_MAX_T:
        _ext.gemv(*args)
    elif tokens > _gemm_max_t() or BF16_PREFILL.on(x) or not PACKED_GEMM.on(x) or not _ext.gemm(*args):
        _tiled_matmul(x, weight, type_id, cols, target, threads)
    if target is not out:
        out.copy_(target)
    return out


@functools.cache
def _gemm_max_t() -> int:
    """The most rows of x the packed GEMM takes on this CPU (see GEMM_MAX_T): no limit on AMD Zen 5
    and later (CPU family 26 on), whose AVX-512 units are full width. Zen 4 (family 25, AVX-512 as two
    256-bit halves) was not measured against the tiles: it keeps GEMM_MAX_T, as Intel and unknown
    CPUs do."""
    vendor, family = cpu_identity()
    return sys.maxsize if vendor == "AuthenticAMD" and family >= 26 else GEMM_MAX_T


def cpu_identity() -> tuple[str, int]:
    """The x86 vendor string ("GenuineIntel", "AuthenticAMD") and CPU family, or ("", 0) where they
    cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        # Windows: "AMD64 Family 26 Model 2 Stepping 1, AuthenticAMD".
        words = platform.processor().replace(",", " ").split()
        if "Family" in words[:-1]:
            fields["cpu family"] = words[words.index("Family") + 1]
        fields["vendor_id"] = next((w for w in words if w in ("GenuineIntel", "AuthenticAMD")), "")
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


def dequantize(weight: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype = _F32) -> torch.Tensor:
    """The [rows, cols] weight decoded by the C kernels (the prefill path's tile decoder): float32, or
    those values rounded to bfloat16 (the AVX-512 decoders only: where BF16_PREFILL can run)."""
    assert _ext is not None
    block_values, block_bytes = _ROW_BYTES[type_id]
    rows, row_bytes = weight.shape
    if weight.dtype != torch.uint8 or cols % block_values or row_bytes != cols // block_values * block_bytes:
        raise ValueError(f"gguf_cpu.dequantize: weight {tuple(weight.shape)} is not type {type_id} x {cols}")
    if dtype not in (_F32, torch.bfloat16):
        raise ValueError(f"gguf_cpu.dequantize: no {dtype} rows (float32 or bfloat16)")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    dst = torch.empty((rows, cols), dtype=dtype)
    _ext.dequantize(
        type_id,
        weight.data_ptr(),
        weight.stride(0),
        rows,
        cols,
        dst.data_ptr(),
        torch.get_num_threads(),
        dtype == torch.bfloat16,
    )
    return dst


def _tiled_matmul(
    x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor, threads: int
) -> None:
    """out = x @ Wᵀ as tiles of rows: each dequantized into the scratch, then one torch.mm (in
    bfloat16 where BF16_PREFILL is on)."""
    rows = weight.shape[0]
    tile = max(1, min(rows, TILE_VALUES // cols))
    rounded = BF16_PREFILL.on(x)
    dtype = torch.bfloat16 if rounded else _F32
    scratch = _scratch(tile * cols, dtype)
    x = x.to(dtype).contiguous()
    for start in range(0, rows, tile):
        stop = min(rows, start + tile)
        w = scratch[: (stop - start) * cols].view(stop - start, cols)
        _ext.dequantize(
            type_id,
            weight.data_ptr() + start * weight.stride(0),
            weight.stride(0),
            stop - start,
            cols,
            w.data_ptr(),
            threads,
            rounded,
        )
        if start == 0 and stop == rows and out.is_contiguous() and not rounded:
            torch.mm(x, w.t(), out=out)
        else:
            out[:, start:stop] = torch.mm(x, w.t())


def _scratch(count: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch of at least `count` values of `dtype` (kept between calls: prefill calls
    this for every layer, and a fresh multi-MiB buffer would be page-faulted in every time)."""
    buffers = _scratches.__dict__.setdefault("by_dtype", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < count:
        buffer = buffers[dtype] = torch.empty(count, dtype=dtype)
    return buffer


# --- prefill's row-wise ops ---------------------------------------------------------------------
# The steps between a prompt's matmuls (RMSNorm, RoPE after the q/k norms, the gated activation),
# each one pass in C with the fused layer's own functions, where torch takes several ops and a pool
# wake-up for each: together about a tenth of Gemma-3-270M's 128-token prefill on two cores.


# DS4DESK_CPU_ROW_OPS=0 turns them off for a process (the benchmark's peer); read once, since the
# check runs for every norm of every layer.
_ROW_OPS_ASKED = os.environ.get("DS4DESK_CPU_ROW_OPS", "1") != "0"

ROW_OPS = Switch(
    "quant.gguf_cpu_rows",
    "prefill's RMSNorms, RoPE after the q/k norms and gated activation in one C pass each (CPU, float32)",
    lambda where: _ROW_OPS_ASKED,
)


def row_ops_take(x: torch.Tensor) -> bool:
    """Whether the row ops below run for x: float32 on the CPU, rows of contiguous values, the
    extension built and ROW_OPS on. Elsewhere the caller's torch ops do."""
    return _ext is not None and x.dtype is _F32 and x.is_cpu and x.stride(-1) == 1 and ROW_OPS.on(x)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] (any row stride) times weight [D] (or none), as a new [T, D]."""
    _check_rows(x, 2)
    tokens, dim = x.shape
    if weight is not None:
        _check_table(weight, (dim,))
    out = torch.empty((tokens, dim), dtype=_F32)
    _ext.norm_rows(
        x.data_ptr(), x.stride(0), tokens, 1, dim, _pointer(weight), False, eps, 0, 0, False,
        out.data_ptr(), dim, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sin_folded: bool,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """RoPE in place on x [T, H, D] (heads D apart, any token stride) with token t's row of cos and
    sin [T, D] (rotate-half; `sin_folded`: sin's first half already negated), after each head's
    RMSNorm times its row of `norm` [H, D] where there is one (Qwen3's and Gemma 3's q/k norms).
    Returns x."""
    _check_rows(x, 3)
    tokens, heads, dim = x.shape
    if x.stride(1) != dim or x.stride(0) < heads * dim or dim > 512 or dim % 2:
        raise ValueError(f"gguf_cpu.rope_: x {tuple(x.shape)} strides {x.stride()} do not fit")
    if norm is not None:
        _check_table(norm, (heads, dim))
    _check_table(cos, (tokens, dim))
    _check_table(sin, (tokens, dim))
    _ext.norm_rows(
        x.data_ptr(), x.stride(0), tokens, heads, dim, _pointer(norm), True, eps, cos.data_ptr(),
        sin.data_ptr(), sin_folded, x.data_ptr(), x.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    return x


def gated_rows(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(gate) * up for gate_up [T, 2F] (gate, then up; any row stride), as a new [T, F]."""
    _check_rows(gate_up, 2)
    tokens, width = gate_up.shape
    if width % 2 or activation not in ACTIVATIONS:
        raise ValueError(f"gguf_cpu.gated_rows: {tuple(gate_up.shape)} with {activation!r} does not fit")
    ffn = width // 2
    out = torch.empty((tokens, ffn), dtype=_F32)
    _ext.gated_rows(
        ACTIVATIONS[activation], gate_up.data_ptr(), gate_up.stride(0), tokens, ffn, out.data_ptr(), ffn,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _check_rows(x: torch.Tensor, dims: int) -> None:
    """x has `dims` dimensions, float32 on the CPU, its last one contiguous: the C side walks it from
    its data pointer with its strides."""
    if x.dim() != dims or x.dtype is not _F32 or not x.is_cpu or x.stride(-1) != 1:
        raise ValueError(f"gguf_cpu: rows {tuple(x.shape)} {x.dtype} strides {x.stride()} do not fit")


def _check_table(table: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A float32 CPU tensor of exactly `shape`, contiguous: what the C side reads through its pointer."""
    if table.shape != shape or table.dtype is not _F32 or not table.is_cpu or not table.is_contiguous():
        raise ValueError(f"gguf_cpu: a table {tuple(table.shape)} {table.dtype} where {shape} float32 goes")


def _pointer(table: torch.Tensor | None) -> int:
    return 0 if table is None else table.data_ptr()


# --- one decoder layer for one token ------------------------------------------------------------

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


@dataclass(slots=True)
class PackedPart:
    """One packed weight of a projection: uint8 [rows, row_bytes] blocks of a [rows, cols] matrix."""

    weight: torch.Tensor
    type_id: int
    cols: int


@dataclass(slots=True)
class FusedProjection:
    """x @ Wᵀ (+ bias) with W one packed weight or several laid side by side in the output."""

    parts: tuple[PackedPart, ...]
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class LayerSpec:
    """Everything one decoder layer's one-token step reads (float32 CPU tensors). The layer is
    x += post_attn(o(attention(rope(qk_norm(qkv(norm_in(x))))))), then
    x += post_ffn(down(act(gate) · up)) with gate | up = gate_up(pre_ffn(x)); a post norm left None
    adds the projection as it is (the dense family), given, it normalises first (Gemma 3)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    attention_scale: float
    activation: str  # a key of ACTIVATIONS
    sin_folded: bool  # sin holds [-sin, sin] (the dense family's tables); else rotate_half's plain sin
    window: int | None
    input_norm: torch.Tensor  # [hidden]
    pre_ffn_norm: torch.Tensor  # [hidden]
    qkv: FusedProjection  # -> (H + 2 KV) D
    o: FusedProjection  # -> hidden
    gate_up: FusedProjection  # -> 2 ffn
    down: FusedProjection  # -> hidden
    kv_cache: torch.Tensor  # [2, KV, rows, D]: position p in row p % rows
    cos: torch.Tensor  # [positions, D]
    sin: torch.Tensor  # [positions, D]
    qk_norm: torch.Tensor | None = None  # [H + KV, D]
    post_attention_norm: torch.Tensor | None = None  # [hidden]
    post_ffn_norm: torch.Tensor | None = None  # [hidden]


class FusedLayer:
    """A LayerSpec made into one C call per token (`_gguf_cpu.decode_layer`): norms, packed GEMVs,
    RoPE, the cache write, attention and residual adds without a torch call. It keeps its weights
    alive, but holds the cache and rope tables only weakly (a model that frees its cache must get
    the memory back): `reads` says whether the tensors it points into are still the given ones."""

    __slots__ = ("_cache", "_cos", "_handle", "_sin", "_weights", "hidden")

    def __init__(self, spec: LayerSpec) -> None:
        assert _ext is not None
        self._handle = _ext.make_layer(*_layer_args(spec))
        self.hidden = spec.hidden
        projections = (spec.qkv, spec.o, spec.gate_up, spec.down)
        self._weights = (
            [spec.input_norm, spec.pre_ffn_norm, spec.qk_norm, spec.post_attention_norm, spec.post_ffn_norm]
            + [part.weight for p in projections for part in p.parts]
            + [p.bias for p in projections]
        )
        self._cache, self._cos, self._sin = (
            weakref.ref(spec.kv_cache),
            weakref.ref(spec.cos),
            weakref.ref(spec.sin),
        )

    def reads(
        self, kv_cache: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> bool:
        """Whether this layer was made for exactly these (live) cache and table tensors."""
        return self._cache() is kv_cache and self._cos() is cos and self._sin() is sin

    def __call__(self, x: torch.Tensor, pos: int, threads: int) -> None:
        """x: the residual, float32 [T, hidden] contiguous on the CPU, updated in place. The caller
        checks `reads` first: the C side writes into the cache it was made with."""
        decode_layers((self,), x, pos, threads)


# The most tokens one call takes: a verify step of speculative decoding (its drafts and the token
# before them), or a short prompt. Each block of a weight is decoded once for all of them.
MAX_TOKENS = 16


def decode_layers(layers: Sequence[FusedLayer], x: torch.Tensor, pos: int, threads: int) -> None:
    """T tokens at pos.. through `layers` in order, in one C call (one wake-up of the threads for
    all of them, see "the decode team" in gguf_cpu.c); x, the residual [T, hidden] with T up to
    MAX_TOKENS, updated in place. The caller checks each layer's `reads` first."""
    hidden = layers[0].hidden
    count = x.shape[0] if x.dim() == 2 else 0
    if (
        not 1 <= count <= MAX_TOKENS
        or x.shape[1] != hidden
        or x.dtype is not _F32
        or not x.is_cpu
        or not x.is_contiguous()
    ):
        raise ValueError(
            f"decode_layers: x {tuple(x.shape)} {x.dtype} is not [1..{MAX_TOKENS}, {hidden}] float32"
        )
    assert _ext is not None
    _ext.decode_layers(tuple(layer._handle for layer in layers), x.data_ptr(), pos, threads, count)


def fused_layer(spec: LayerSpec) -> FusedLayer | None:
    """The spec as one C call per token, or None where the kernels do not run it (no extension, a
    weight type they do not decode, tensors of another dtype or device)."""
    if _ext is None or spec.activation not in ACTIVATIONS or spec.head_dim > 512 or spec.head_dim % 2:
        return None
    try:
        return FusedLayer(spec)
    except ValueError as error:
        log.debug("fused CPU decode layer not used: %s", error)
        return None


def _vector(t: torch.Tensor | None, shape: tuple[int, ...], name: str) -> int:
    """The data pointer of a float32 contiguous CPU tensor of `shape` (0 for None)."""
    if t is None:
        return 0
    if tuple(t.shape) != shape or t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"{name}: {tuple(t.shape)} {t.dtype} on {t.device}, expected {shape} float32 on the CPU"
        )
    return t.data_ptr()


def _projection_args(p: FusedProjection, cols: int, rows: int, name: str) -> tuple[object, int]:
    parts = []
    for part in p.parts:
        w = part.weight
        block = _ROW_BYTES.get(part.type_id)
        if (
            block is None
            or part.cols != cols
            or w.dtype is not _U8
            or w.dim() != 2
            or not w.is_cpu
            or w.stride(1) != 1
            or cols % block[0]
            or w.shape[1] != cols // block[0] * block[1]
        ):
            raise ValueError(
                f"{name}: a part of type {part.type_id} {tuple(w.shape)} does not fit {cols} columns"
            )
        parts.append((part.type_id, w.data_ptr(), w.stride(0), w.shape[0], cols))
    if sum(part.weight.shape[0] for part in p.parts) != rows:
        raise ValueError(f"{name}: {sum(part.weight.shape[0] for part in p.parts)} rows, expected {rows}")
    return tuple(parts), _vector(p.bias, (rows,), f"{name} bias")


def _layer_args(s: LayerSpec) -> tuple[object, ...]:
    heads, kv_heads, dim, hidden, ffn = s.heads, s.kv_heads, s.head_dim, s.hidden, s.ffn
    cache = s.kv_cache
    if cache.dim() != 4 or cache.shape[0] != 2 or cache.shape[1] != kv_heads or cache.shape[3] != dim:
        raise ValueError(f"kv_cache {tuple(cache.shape)} is not [2, {kv_heads}, rows, {dim}]")
    rows, positions = cache.shape[2], s.cos.shape[0]
    norms = (
        _vector(s.input_norm, (hidden,), "input_norm"),
        _vector(s.post_attention_norm, (hidden,), "post_attention_norm"),
        _vector(s.pre_ffn_norm, (hidden,), "pre_ffn_norm"),
        _vector(s.post_ffn_norm, (hidden,), "post_ffn_norm"),
        _vector(s.qk_norm, (heads + kv_heads, dim), "qk_norm"),
    )
    return (
        (hidden, heads, kv_heads, dim, ffn),
        s.eps,
        s.attention_scale,
        ACTIVATIONS[s.activation],
        int(s.sin_folded),
        s.window or 0,
        norms,
        _projection_args(s.qkv, hidden, (heads + 2 * kv_heads) * dim, "qkv"),
        _projection_args(s.o, heads * dim, hidden, "o"),
        _projection_args(s.gate_up, hidden, 2 * ffn, "gate_up"),
        _projection_args(s.down, ffn, hidden, "down"),
        (_vector(cache, tuple(cache.shape), "kv_cache"), rows),
        (_vector(s.cos, (positions, dim), "cos"), _vector(s.sin, (positions, dim), "sin"), positions),
    )
