"""The weight formats ds4desk reads, as plain constants: block sizes, encodings and code tables.

Torch-free, and the one place both sides take them from: `loading/` decodes checkpoints with them,
`kernels/` multiplies packed weights with them, `models/` sizes the packed parameters.
"""

from __future__ import annotations

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
