"""The reference dequantization of GGUF weights: packed GGML blocks to float32, in plain torch ops.

Every packed-weight kernel that reads GGUF blocks (GPU or CPU) is held to `dequantize`: on the same
bytes it must give these values. It runs on CPU and CUDA tensors alike, on a whole tensor at once
(each block type is decoded by tensor ops over all blocks, never a loop over them), and keeps GGML's
order of float32 operations (a scale is first multiplied by its sub-block's scale, then by the code),
so its results equal GGML's bit for bit rather than approximately.

Blocks are little-endian, as GGUF files are. Inside a block, codes narrower than a byte are packed
"planar": a byte's low nibble (or its lowest bit pair, its lowest bit) belongs to one run of values
and its higher bits to the next runs, not to the next value. `_bits` unpacks such fields; each
decoder below says which run each field goes to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ds4desk.engine.formats import (
    E2M1_VALUES,
    IQ4_NL_VALUES,
    ROW_LAYOUT_SOURCES,
    ROW_LAYOUTS,
    GgufType,
    gguf_packed_bytes,
    gguf_type,
)

# MXFP4 as GGML decodes it: the e2m1 values doubled, which makes them integers, and the scale halved
# to match (see `_mxfp4`). Built from integers so that code 8 ("-0") gives +0.0 as GGML's does.
_E2M1_DOUBLED = tuple(int(2 * v) for v in E2M1_VALUES)
_MXFP4_DOUBLED_VALUES = _E2M1_DOUBLED + tuple(-v for v in _E2M1_DOUBLED)


def dequantize(raw: torch.Tensor, type_id: int, shape: Sequence[int]) -> torch.Tensor:
    """The float32 values of a GGUF tensor of `shape` (torch order: the last dimension is a row,
    GGUF's ne[0]) stored in GGML type `type_id` as the uint8 bytes `raw` (any layout holding exactly
    those bytes in order, such as [rows, row_bytes]), on raw's device.

    A ValueError for a type ds4desk does not read, a row that is not whole blocks, or bytes that do
    not match the shape."""
    kind = gguf_type(type_id)
    expected = gguf_packed_bytes(type_id, shape)
    if raw.dtype != torch.uint8:
        raise ValueError(f"a {kind.name} tensor's bytes must be uint8, got {raw.dtype}")
    if raw.numel() != expected:
        raise ValueError(
            f"a {kind.name} tensor of shape {tuple(shape)} takes {expected} bytes, got {raw.numel()}"
        )
    if kind.type_id in ROW_LAYOUT_SOURCES:  # a device row layout: its blocks put back together
        file_id, head = ROW_LAYOUT_SOURCES[kind.type_id]
        raw = _blocks_of_rows(raw.reshape(-1, gguf_packed_bytes(type_id, shape[-1:])), kind, head)
        kind = gguf_type(file_id)
    blocks = raw.reshape(-1, kind.block_bytes).contiguous()
    return _DECODERS[kind.name](blocks).reshape(tuple(shape))


def device_rows(raw: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """Rows [rows, row_bytes] of a file type with a row layout (formats.ROW_LAYOUTS) rearranged into
    it: each row's code bytes, block after block, then its blocks' heads. A new tensor of the same
    shape and bytes."""
    layout, head = ROW_LAYOUTS[type_id]
    row_bytes = gguf_packed_bytes(type_id, (cols,))
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes:
        raise ValueError(
            f"device_rows takes {layout.name[:-5]} rows of {cols} values, got {raw.dtype} {list(raw.shape)}"
        )
    by_block = raw.reshape(raw.shape[0], -1, layout.block_bytes)
    codes = by_block[:, :, head:].flatten(1)
    return torch.cat([codes, by_block[:, :, :head].flatten(1)], dim=1)


def _blocks_of_rows(rows: torch.Tensor, layout: GgufType, head: int) -> torch.Tensor:
    """device_rows undone: [rows, row_bytes] of a row layout back to the file's blocks."""
    blocks = rows.shape[1] // layout.block_bytes
    codes = rows[:, : blocks * (layout.block_bytes - head)].reshape(rows.shape[0], blocks, -1)
    heads = rows[:, blocks * (layout.block_bytes - head) :].reshape(rows.shape[0], blocks, head)
    return torch.cat([heads, codes], dim=2)


# --- unpacking helpers -----------------------------------------------------------------------------


def _bits(packed: torch.Tensor, fields: int, width: int) -> torch.Tensor:
    """uint8 [..., k] -> uint8 [..., fields, k]: field i of every byte, bits [width*i, width*(i+1))."""
    shifts = torch.arange(0, fields * width, width, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-2) >> shifts.view(fields, 1)) & ((1 << width) - 1)


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as float32 [blocks, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _lookup(table: Sequence[int], codes: torch.Tensor) -> torch.Tensor:
    """The float32 value `table` gives each code."""
    return torch.tensor(table, dtype=torch.float32, device=codes.device)[codes.long()]


# --- plain floats ----------------------------------------------------------------------------------


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.bfloat16).float()


# --- 32-value blocks: one fp16 scale (and minimum) -------------------------------------------------
# Value j < 16 is the low nibble of code byte j, value j >= 16 the high nibble of byte j - 16.


def _nibbles32(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 16] -> the 32 4-bit codes in value order, uint8 [blocks, 32]."""
    return _bits(codes, 2, 4).flatten(1)


def _fifth_bits32(high: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 4] (a little-endian uint32) -> bit j for value j, uint8 [blocks, 32]."""
    return _bits(high, 8, 1).transpose(1, 2).flatten(1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d (fp16) | 16 code bytes; value = d * (q - 8)
    d = _fp16(blocks, 0)
    q = _nibbles32(blocks[:, 2:18])
    return d * (q.float() - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d, m (fp16) | 16 code bytes; value = d * q + m
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    q = _nibbles32(blocks[:, 4:20])
    return d * q.float() + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # d (fp16) | 4 bytes of fifth bits | 16 code bytes; value = d * (q - 16)
    d = _fp16(blocks, 0)
    q = _nibbles32(blocks[:, 6:22]) | (_fifth_bits32(blocks[:, 2:6]) << 4)
    return d * (q.float() - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # d, m (fp16) | 4 bytes of fifth bits | 16 code bytes; value = d * q + m
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    q = _nibbles32(blocks[:, 8:24]) | (_fifth_bits32(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d (fp16) | 32 int8 codes; value = q * d
    d = _fp16(blocks, 0)
    return blocks[:, 2:34].view(torch.int8).float() * d


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # d (fp16) | 16 code bytes; value = d * IQ4_NL_VALUES[q]
    d = _fp16(blocks, 0)
    return d * _lookup(IQ4_NL_VALUES, _nibbles32(blocks[:, 2:18]))


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # e (UE8M0) | 16 code bytes; value = 2^(e - 127) * e2m1[q], computed as GGML does:
    # 2^(e - 128) * (2 * e2m1[q]). The half scale of e = 0 and 1 is a float32 subnormal, and e = 255
    # gives 2^127 (GGML gives this format no NaN scale).
    e = blocks[:, :1].to(torch.int32)
    half_scale = torch.where(e < 2, (e + 1) << 21, (e - 1) << 23).view(torch.float32)
    return half_scale * _lookup(_MXFP4_DOUBLED_VALUES, _nibbles32(blocks[:, 1:17]))


# --- 256-value super-blocks ------------------------------------------------------------------------
# One fp16 scale d (and minimum scale dmin) per super-block, and small integer scales per sub-block
# of 16 or 32 values: a value is (d * sub_scale) * q [- dmin * sub_min].


def _scaled(sub_scale: torch.Tensor, q: torch.Tensor, sub_min: torch.Tensor | None = None) -> torch.Tensor:
    """float32 scales [blocks, S] (and minimums) applied to codes (or code values) [blocks, 256], in
    S sub-blocks of 256 / S values."""
    n, subs = sub_scale.shape
    values = sub_scale.unsqueeze(-1) * q.float().view(n, subs, -1)
    if sub_min is not None:
        values = values - sub_min.unsqueeze(-1)
    return values.view(n, -1)


def _crumbs_by_halves(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 64] of 2-bit codes -> [blocks, 256]: each half of 128 values takes 32 bytes,
    bits 2i..2i+1 of byte b giving its value 32i + b."""
    return _bits(codes.view(-1, 2, 32), 4, 2).flatten(1)


def _high_bits(high: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 32] -> [blocks, 256]: bit i of byte b is value 32i + b's."""
    return _bits(high, 8, 1).flatten(1)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 16 scale bytes (low nibble: sub-block scale, high: its minimum) | 64 code bytes | d | dmin
    scales = blocks[:, 0:16]
    d, dmin = _fp16(blocks, 80), _fp16(blocks, 82)
    q = _crumbs_by_halves(blocks[:, 16:80])
    return _scaled(d * (scales & 0x0F).float(), q, dmin * (scales >> 4).float())


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # 32 bytes of high bits | 64 bytes of low bit pairs | 12 scale bytes | d
    # A code is its two low bits, less 4 where its high bit is clear. The 16 6-bit scales, less 32:
    # low nibbles in bytes 0-7 (scales 0-7 the low nibbles, 8-15 the high ones), top bit pairs in
    # bytes 8-11 (scale i takes bits 2*(i // 4) of byte 8 + i % 4).
    packed = blocks[:, 96:108]
    low = _bits(packed[:, 0:8], 2, 4).flatten(1)
    top = _bits(packed[:, 8:12], 4, 2).flatten(1)
    sub_scale = (low | (top << 4)).float() - 32
    d = _fp16(blocks, 108)
    high_clear = _high_bits(blocks[:, 0:32]) == 0
    q = _crumbs_by_halves(blocks[:, 32:96]).float() - 4 * high_clear.float()
    return _scaled(d * sub_scale, q)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit sub-block scales and eight 6-bit minimums, float32.
    Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); sub-blocks 4-7
    take the low (scale) and high (minimum) nibble of bytes 8-11 and, as bits 4-5, the top bit pairs
    of bytes 0-3 (scales) and 4-7 (minimums)."""
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)), dim=1)
    mins = torch.cat((second & 0x3F, (third >> 4) | ((second >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _nibbles_by_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 128] -> [blocks, 256]: each 32 bytes hold two sub-blocks of 32, the low
    nibbles the first, the high nibbles the second."""
    return _bits(codes.view(-1, 4, 32), 2, 4).flatten(1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # d | dmin | 12 scale bytes | 128 code bytes
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _nibbles_by_pairs(blocks[:, 16:144])
    return _scaled(d * scales, q, dmin * mins)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # d | dmin | 12 scale bytes | 32 bytes of fifth bits | 128 code bytes
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _nibbles_by_pairs(blocks[:, 48:176]) | (_high_bits(blocks[:, 16:48]) << 4)
    return _scaled(d * scales, q, dmin * mins)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles | 64 bytes of high bit pairs | 16 int8 sub-block scales | d
    # Each half of 128 values takes 64 low-nibble bytes (value p: byte p % 64, the high nibble from
    # p = 64 on) and 32 high-pair bytes (value p: byte p % 32, bits 2 * (p // 32)); a code is less 32.
    low = _bits(blocks[:, 0:128].view(-1, 2, 64), 2, 4).flatten(1)
    high = _bits(blocks[:, 128:192].view(-1, 2, 32), 4, 2).flatten(1)
    sub_scale = blocks[:, 192:208].view(torch.int8).float()
    d = _fp16(blocks, 208)
    return _scaled(d * sub_scale, (low | (high << 4)).float() - 32)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # d | 2 bytes of scale bit pairs | 4 bytes of scale nibbles | 128 code bytes
    # Eight 6-bit sub-block scales, less 32: sub-block i's low 4 bits are nibble i % 2 of byte i // 2,
    # its top 2 bits are bits 2 * (i % 4) of byte i // 4 of the pairs. Codes as Q4_K's, but each 16
    # bytes hold one sub-block (low nibbles its first 16 values) and index IQ4_NL_VALUES.
    d = _fp16(blocks, 0)
    top = _bits(blocks[:, 2:4], 4, 2).transpose(1, 2).flatten(1)
    low = _bits(blocks[:, 4:8], 2, 4).transpose(1, 2).flatten(1)
    sub_scale = (low | (top << 4)).float() - 32
    codes = _bits(blocks[:, 8:136].view(-1, 8, 16), 2, 4).flatten(1)
    return _scaled(d * sub_scale, _lookup(IQ4_NL_VALUES, codes))


_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32,
    "F16": _f16,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
}
