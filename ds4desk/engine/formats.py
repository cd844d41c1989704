"""The weight formats ds4desk reads, as plain constants: block sizes, encodings and code tables.

Torch-free, and the one place both sides take them from: `loading/` decodes checkpoints with them,
`kernels/` multiplies packed weights with them, `models/` sizes the packed parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# DeepSeek's FP8 weights: float8_e4m3 values, one float32-valued (UE8M0) scale per 128 x 128 block.
FP8_BLOCK = 128
# DeepSeek's FP4 routed experts: two e2m1 values a byte, one UE8M0 scale per 32 values of a row.
FP4_BLOCK = 32
# The eight magnitudes an e2m1 code's low three bits select (the fourth bit is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = E2M1_VALUES[-1]
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
E8M0_NAN = 255  # the one UE8M0 code that is not a power of two

# How a checkpoint tensor is stored: as its dtype says, or block-quantized with a scale tensor.
ENCODINGS = ("plain", "fp8_block128", "fp4_block32")
SCALE_DTYPES = frozenset({"F8_E8M0", "U8"})  # a UE8M0 byte; some writers label it plain U8
FP4_DTYPES = frozenset({"I8", "U8"})  # the official files store packed FP4 pairs as I8


# --- GGUF ------------------------------------------------------------------------------------------
# The GGML tensor types ds4desk reads from a GGUF file. A row of a tensor is a run of blocks, each
# block a fixed number of values packed into a fixed number of bytes; the numbers below are the GGML
# format's own (type ids are fixed by the file format and never reused).

GGUF_SUPER_BLOCK = 256  # the values in one block of the "K" types and IQ4_XS


@dataclass(frozen=True, slots=True)
class GgufType:
    name: str  # as GGML spells it: "Q4_K", "MXFP4", ...
    type_id: int  # the number a GGUF tensor header stores
    block_values: int  # weights per block
    block_bytes: int  # bytes one block takes
    # Byte offsets of the block's fp16 scales (d, and dmin / m where the type has one): where random
    # test bytes must be made finite.
    fp16_scales: tuple[int, ...] = ()


GGUF_TYPES: dict[int, GgufType] = {
    t.type_id: t
    for t in (
        GgufType("F32", 0, 1, 4),
        GgufType("F16", 1, 1, 2),
        GgufType("BF16", 30, 1, 2),
        # fp16 scale d, 32 4-bit codes: d * (q - 8)
        GgufType("Q4_0", 2, 32, 18, (0,)),
        # fp16 scale d and minimum m, 32 4-bit codes: d * q + m
        GgufType("Q4_1", 3, 32, 20, (0, 2)),
        # fp16 d, 32 fifth bits, 32 4-bit codes: d * (q - 16)
        GgufType("Q5_0", 6, 32, 22, (0,)),
        # fp16 d and m, 32 fifth bits, 32 4-bit codes: d * q + m
        GgufType("Q5_1", 7, 32, 24, (0, 2)),
        # fp16 d, 32 int8 codes: d * q
        GgufType("Q8_0", 8, 32, 34, (0,)),
        # 16 sub-blocks of 16 values, each with a 4-bit scale and a 4-bit minimum; 2-bit codes
        GgufType("Q2_K", 10, GGUF_SUPER_BLOCK, 84, (80, 82)),
        # 16 sub-blocks of 16 values with signed 6-bit scales; 3-bit codes (2 low bits + 1 high bit)
        GgufType("Q3_K", 11, GGUF_SUPER_BLOCK, 110, (108,)),
        # 8 sub-blocks of 32 values, each with a 6-bit scale and a 6-bit minimum; 4-bit codes
        GgufType("Q4_K", 12, GGUF_SUPER_BLOCK, 144, (0, 2)),
        # as Q4_K with a fifth bit per code
        GgufType("Q5_K", 13, GGUF_SUPER_BLOCK, 176, (0, 2)),
        # 16 sub-blocks of 16 values with int8 scales; 6-bit codes (4 low bits + 2 high bits)
        GgufType("Q6_K", 14, GGUF_SUPER_BLOCK, 210, (208,)),
        # fp16 d, 32 4-bit indices into IQ4_NL_VALUES: d * value
        GgufType("IQ4_NL", 20, 32, 18, (0,)),
        # 8 sub-blocks of 32 values with signed 6-bit scales; 4-bit indices into IQ4_NL_VALUES
        GgufType("IQ4_XS", 23, GGUF_SUPER_BLOCK, 136, (0,)),
        # one UE8M0 exponent byte, 32 e2m1 codes (the OCP microscaling FP4 format)
        GgufType("MXFP4", 39, 32, 17),
    )
}

# The 16 values an IQ4_NL / IQ4_XS code selects (a non-uniform grid, denser near zero).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# GGML types a GGUF file may hold that ds4desk refuses, so the refusal can name them. Ids missing
# from both tables belong to types GGML has since removed or added after these were written.
GGUF_REFUSED_TYPE_NAMES: dict[int, str] = {
    9: "Q8_1",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    21: "IQ3_S",
    22: "IQ2_S",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    40: "NVFP4",
    41: "Q1_0",
}


# Q8_0 as a GPU holds it: each row's blocks split into the row's codes (the blocks' code bytes in
# order), then the blocks' heads (their fp16 scales). The same bytes, rearranged at load
# (kernels/quant/gguf.device_rows), so a GEMV streams the codes in 16-byte loads where a 34-byte block
# aligns them to 2. Not a GGML type: its id is negative, which no GGUF header (an unsigned field) can
# hold. (Q4_K in such a layout measured slower: its codes are 16-byte aligned already.)
Q8_0_ROWS = GgufType("Q8_0_ROWS", -8, 32, 34)
# A row layout by the id of the file's type: (the layout, the head bytes that open each block).
ROW_LAYOUTS: dict[int, tuple[GgufType, int]] = {8: (Q8_0_ROWS, 2)}
# The other way: a layout's id -> (the file type's id, the head bytes).
ROW_LAYOUT_SOURCES = {layout.type_id: (file_id, head) for file_id, (layout, head) in ROW_LAYOUTS.items()}


def gguf_type(type_id: int) -> GgufType:
    """The accepted GGUF type with this id (or a device row layout); a ValueError naming the type for
    any other."""
    source = ROW_LAYOUT_SOURCES.get(type_id)
    accepted = GGUF_TYPES.get(type_id) if source is None else ROW_LAYOUTS[source[0]][0]
    if accepted is not None:
        return accepted
    refused = GGUF_REFUSED_TYPE_NAMES.get(type_id)
    what = f"{refused} (type id {type_id})" if refused else f"unknown type id {type_id}"
    names = ", ".join(t.name for t in GGUF_TYPES.values())
    raise ValueError(f"GGUF tensor type {what} is not supported; ds4desk reads {names}")


def gguf_packed_bytes(type_id: int, shape: Sequence[int]) -> int:
    """The bytes a tensor of `shape` (torch order: the last dimension is the row, GGUF's ne[0]) takes
    in GGUF type `type_id`; a ValueError if the type is refused or a row is not whole blocks."""
    kind = gguf_type(type_id)
    if not shape or any(d < 0 for d in shape):
        raise ValueError(f"a {kind.name} tensor needs a shape of non-negative sizes, got {tuple(shape)}")
    row = shape[-1]
    if row % kind.block_values:
        raise ValueError(
            f"a {kind.name} row of {row} values is not a whole number of {kind.block_values}-value blocks"
        )
    values = 1
    for d in shape:
        values *= d
    return values // kind.block_values * kind.block_bytes
