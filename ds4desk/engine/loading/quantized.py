"""Reading (and, for make-tiny, writing) the block-quantized weights of official DeepSeek checkpoints.

Two encodings, both with UE8M0 scales: a bare exponent byte s meaning 2^(s-127) (0xFF is NaN).
- fp8_block128: FP8 e4m3 values, one scale per 128x128 block: W[i,j] = q[i,j] * 2^(S[i//128, j//128]-127).
- fp4_block32: FP4 e2m1 values packed two per byte (element 2b in the low nibble, 2b+1 in the high
  one), one scale per 32 consecutive values of a row: W[i,j] = v[i,j] * 2^(S[i, j//32]-127).

Every tensor is dequantized to float32 on its own, so loading never holds a second model copy.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.formats import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E8M0_NAN, FP4_BLOCK, FP8_BLOCK
from ds4desk.engine.loading.quant_checks import check_quantized
from ds4desk.engine.loading.source import TensorEntry


def _fail(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def e8m0_to_float(scale: torch.Tensor, what: str) -> torch.Tensor:
    """2^(s-127) per byte as float32; a NaN byte (0xFF) is a broken file, not a weight."""
    exponent = scale.view(torch.uint8).to(torch.int32)
    if bool((exponent == E8M0_NAN).any()):
        raise _fail(f"{what} holds the UE8M0 NaN byte 0xFF")
    one = torch.ones((), dtype=torch.float32, device=scale.device)
    return torch.ldexp(one, (exponent - 127).to(torch.float32))


def dequantize_fp8_block128(q: torch.Tensor, scale: torch.Tensor, what: str = "FP8 weight") -> torch.Tensor:
    rows, cols = q.shape
    factor = e8m0_to_float(scale, f"the scale of {what}")
    factor = factor.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return q.view(torch.float8_e4m3fn).to(torch.float32) * factor


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols/2] bytes -> [rows, cols] float32 e2m1 values (no scale)."""
    data = packed.view(torch.uint8).to(torch.int64)
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(data.shape[0], -1)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    magnitude = table[nibbles & 7]
    return torch.where((nibbles & 8) != 0, -magnitude, magnitude)


def dequantize_fp4_block32(
    packed: torch.Tensor, scale: torch.Tensor, what: str = "FP4 weight"
) -> torch.Tensor:
    values = unpack_fp4(packed)
    factor = e8m0_to_float(scale, f"the scale of {what}").repeat_interleave(FP4_BLOCK, 1)
    return values * factor[:, : values.shape[1]]


class ShardReader:
    """Opens each safetensors file once (safe_open mmaps it) for the tensors read from it."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.close()

    def get(self, file: Path, key: str) -> torch.Tensor:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            self._handles[file] = handle
        return handle.get_tensor(key)


def _read_one(
    reader: ShardReader, name: str, entry: TensorEntry, device: torch.device | None = None
) -> torch.Tensor:
    key = entry.key or name
    stored = reader.get(entry.file, key)
    if entry.encoding == "plain":
        if tuple(stored.shape) != tuple(entry.shape):
            raise _fail(
                f"{entry.file.name}: {key} has shape {list(stored.shape)}, expected {list(entry.shape)}"
            )
        return stored
    check_quantized(name, entry)
    assert entry.scale is not None  # check_quantized guarantees it
    scale = reader.get(entry.scale.file, entry.scale.key or f"{key}.scale")
    if device is not None:
        # Dequantize where the weight goes: the packed bytes cross the bus, not the float32s.
        stored, scale = stored.to(device), scale.to(device)
    if entry.encoding == "fp8_block128":
        return dequantize_fp8_block128(stored, scale, f"{entry.file.name}: {key}")
    return dequantize_fp4_block32(stored, scale, f"{entry.file.name}: {key}")


def read_tensor(reader: ShardReader, name: str, entry: TensorEntry) -> torch.Tensor:
    """The tensor the model calls `name`, in its logical shape: plain tensors as stored, quantized
    ones dequantized to float32, multi-part ones assembled (one model tensor at a time)."""
    if not entry.parts:
        return _read_one(reader, name, entry)
    pieces = [_read_one(reader, name, part).reshape(-1) for part in entry.parts]
    if sum(p.numel() for p in pieces) != math.prod(entry.shape):
        raise _fail(f"tensor {name}: its {len(pieces)} parts do not add up to shape {list(entry.shape)}")
    dtype = torch.float32 if any(p.is_floating_point() for p in pieces) else pieces[0].dtype
    return torch.cat([p.to(dtype) for p in pieces]).view(entry.shape)


def copy_tensor_into(reader: ShardReader, name: str, entry: TensorEntry, target: torch.Tensor) -> None:
    """Fill `target` (the model's parameter) from `entry`. A multi-part tensor is written part by
    part into its slice, so a layer's stacked experts never exist as one float32 host tensor
    (for DeepSeek-V4-Flash that would be 16 GB per layer)."""
    if not entry.parts:
        target.copy_(_read_one(reader, name, entry, target.device))
        return
    if tuple(target.shape) != tuple(entry.shape) or not target.is_contiguous():
        raise _fail(f"internal: tensor {name} cannot take its {len(entry.parts)} parts in place")
    flat = target.view(-1)
    offset = 0
    for part in entry.parts:
        size = math.prod(part.shape)
        if offset + size > flat.numel():
            raise _fail(f"tensor {name}: its {len(entry.parts)} parts overflow shape {list(entry.shape)}")
        flat.narrow(0, offset, size).copy_(_read_one(reader, name, part, target.device).reshape(-1))
        offset += size
    if offset != flat.numel():
        raise _fail(f"tensor {name}: its {len(entry.parts)} parts do not add up to shape {list(entry.shape)}")


def quantize_fp8_block128(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 values, UE8M0 scales) such that dequantize_fp8_block128 gives back ~weight: each
    128x128 block gets the smallest power of two that keeps its largest value within e4m3's 448."""
    rows, cols = weight.shape
    w = weight.detach().to(torch.float32)
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK)
    padded[:rows, :cols] = w
    amax = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK).abs().amax(dim=(1, 3))
    exponent = _scale_exponent(amax, E4M3_MAX)
    factor = torch.ldexp(torch.ones(()), exponent.to(torch.float32))
    full = factor.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp4_block32(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed I8 pairs, UE8M0 scales) for a [rows, cols] weight, cols a multiple of 32; values
    round to the nearest e2m1 magnitude."""
    rows, cols = weight.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"FP4 rows must be a multiple of {FP4_BLOCK} long, got {cols}")
    w = weight.detach().to(torch.float32)
    amax = w.view(rows, cols // FP4_BLOCK, FP4_BLOCK).abs().amax(dim=2)
    exponent = _scale_exponent(amax, E2M1_MAX)
    v = w / torch.ldexp(torch.ones(()), exponent.to(torch.float32)).repeat_interleave(FP4_BLOCK, 1)
    table = torch.tensor(E2M1_VALUES)
    code = (v.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    nibble = code | torch.where(v < 0, 8, 0)
    pairs = nibble.view(rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _scale_exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    # ceil(log2(amax / top)); an all-zero block gets 2^0. Clamped to what a UE8M0 byte can hold.
    safe = torch.where(amax > 0, amax, torch.full_like(amax, top))
    return torch.ceil(torch.log2(safe / top)).clamp(-127, 127).to(torch.int32)


def copy_packed_into(
    reader: ShardReader, name: str, entry: TensorEntry, target: torch.Tensor, scale_target: torch.Tensor
) -> None:
    """Fill a parameter the model keeps quantized with the stored bytes as they are: FP8 values and
    their block multipliers as float32, or packed FP4 pairs and their exponent bytes (stacked experts
    part by part). Nothing is dequantized, so the load moves a quarter of bf16's bytes."""
    parts = entry.parts or (entry,)
    values, scales = target.view(-1).view(torch.uint8), scale_target.view(-1)
    value_at = scale_at = 0
    for part in parts:
        check_quantized(name, part)
        assert part.scale is not None  # check_quantized guarantees it
        key = part.key or name
        what = f"{part.file.name}: {key}"
        stored = reader.get(part.file, key).view(torch.uint8).reshape(-1)
        scale = reader.get(part.scale.file, part.scale.key or f"{key}.scale")
        exponents = e8m0_to_float(scale, f"the scale of {what}")  # refuses NaN bytes
        if part.encoding == "fp8_block128":
            if len(parts) != 1 or target.dtype != torch.float8_e4m3fn:
                raise _fail(f"internal: tensor {name} cannot keep its FP8 values")
            scale_target.copy_(exponents)
            values.copy_(stored)
            return
        raw = scale.view(torch.uint8).reshape(-1)
        if value_at + stored.numel() > values.numel() or scale_at + raw.numel() > scales.numel():
            raise _fail(f"tensor {name}: its {len(parts)} parts overflow shape {list(entry.shape)}")
        values.narrow(0, value_at, stored.numel()).copy_(stored)
        scales.narrow(0, scale_at, raw.numel()).copy_(raw)
        value_at += stored.numel()
        scale_at += raw.numel()
    if value_at != values.numel() or scale_at != scales.numel():
        raise _fail(f"tensor {name}: its {len(parts)} parts do not add up to shape {list(entry.shape)}")
