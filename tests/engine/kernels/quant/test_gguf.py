"""quant/gguf.py and the GGUF tables of formats.py: every accepted GGML type dequantizes to exactly
(bit for bit) what gguf-py's numpy decoder gives for the same bytes, from random valid blocks and,
where gguf-py can quantize the type, from blocks it quantized; the type ids and block sizes are
GGML's; every other type and every malformed tensor is refused with a message naming it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from ds4desk.engine.formats import (
    E2M1_VALUES,
    GGUF_REFUSED_TYPE_NAMES,
    GGUF_SUPER_BLOCK,
    GGUF_TYPES,
    IQ4_NL_VALUES,
    ROW_LAYOUTS,
    GgufType,
    gguf_packed_bytes,
    gguf_type,
)
from ds4desk.engine.kernels.quant.gguf import dequantize, device_rows

TYPES = list(GGUF_TYPES.values())
BY_NAME = {t.name: t for t in TYPES}

# The plain float types: (bit width, exponent mask) of the values.
FLOAT_BITS = {"F32": (32, 0x7F800000), "F16": (16, 0x7C00), "BF16": (16, 0x7F80)}


def ggml(kind: GgufType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(kind.type_id)


def finite_float_bits(rng: np.random.Generator, count: int, width: int, exponent: int) -> np.ndarray:
    """Random bit patterns of finite floats, of every exponent (subnormals and the largest too):
    random bits, with one exponent bit cleared where they were all set (infinity or NaN)."""
    dtype = np.uint32 if width == 32 else np.uint16
    bits = rng.integers(0, 1 << width, count, dtype=np.uint64).astype(dtype)
    top_exponent_bit = dtype(exponent & ~(exponent >> 1))
    return np.where(bits & exponent == exponent, bits & ~top_exponent_bit, bits).astype(dtype)


def random_blocks(kind: GgufType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Valid random bytes of a tensor of `shape`: random codes, finite random fp16 scales."""
    rng = np.random.default_rng(seed)
    n_values = int(np.prod(shape))
    if kind.name in FLOAT_BITS:
        width, exponent = FLOAT_BITS[kind.name]
        raw = finite_float_bits(rng, n_values, width, exponent).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, (n_values // kind.block_values, kind.block_bytes), dtype=np.uint8)
        for at in kind.fp16_scales:
            blocks[:, at : at + 2] = (
                finite_float_bits(rng, len(blocks), 16, 0x7C00).view(np.uint8).reshape(-1, 2)
            )
        raw = blocks
    row_bytes = gguf_packed_bytes(kind.type_id, shape) // (n_values // shape[-1])
    return raw.reshape(-1, row_bytes)


def assert_same_as_gguf(raw: np.ndarray, kind: GgufType, shape: tuple[int, ...]) -> None:
    want = torch.from_numpy(quants.dequantize(raw, ggml(kind)).reshape(shape).copy())
    got = dequantize(torch.from_numpy(raw), kind.type_id, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert not got.isnan().any() and not want.isnan().any()
    # Bit for bit (so +0.0 and -0.0 differ too), not merely within a tolerance.
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), kind.name


# --- the tables ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_type_ids_and_block_sizes_are_ggmls(kind: GgufType) -> None:
    assert gguf.GGMLQuantizationType[kind.name].value == kind.type_id
    assert gguf.GGML_QUANT_SIZES[ggml(kind)] == (kind.block_values, kind.block_bytes)
    assert gguf_type(kind.type_id) is kind


def test_the_sixteen_accepted_types() -> None:
    names = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
    names |= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}
    assert set(BY_NAME) == names
    assert GGUF_SUPER_BLOCK == gguf.QK_K


def test_refused_type_names_are_ggmls() -> None:
    assert not set(GGUF_REFUSED_TYPE_NAMES) & set(GGUF_TYPES)
    for type_id, name in GGUF_REFUSED_TYPE_NAMES.items():
        assert gguf.GGMLQuantizationType[name].value == type_id


def test_code_tables_are_ggmls() -> None:
    assert quants.IQ4_NL.kvalues == IQ4_NL_VALUES
    # GGML's MXFP4 table holds the e2m1 magnitudes doubled, then their negations.
    doubled = tuple(int(2 * v) for v in E2M1_VALUES)
    assert quants.MXFP4.kvalues == doubled + tuple(-v for v in doubled)


# --- dequantization equals gguf-py's ---------------------------------------------------------------

SHAPES = [(1, 1), (7, 2), (37, 3), (2, 3, 1)]  # in blocks per row for the last dimension


@pytest.mark.parametrize("blocks_shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_random_blocks_dequantize_as_gguf_does(kind: GgufType, blocks_shape: tuple[int, ...]) -> None:
    shape = (*blocks_shape[:-1], blocks_shape[-1] * kind.block_values)
    raw = random_blocks(kind, shape, seed=kind.type_id * 100 + len(blocks_shape) + blocks_shape[0])
    assert_same_as_gguf(raw, kind, shape)


def test_mxfp4_takes_every_scale_byte_as_ggml_does() -> None:
    # Byte 0 and 1 give subnormal half scales, 255 gives 2^127: products overflow to infinity there,
    # in GGML as here, but never to NaN.
    kind = BY_NAME["MXFP4"]
    raw = random_blocks(kind, (256, 32), seed=5)
    raw[:, 0] = np.arange(256, dtype=np.uint8)
    with np.errstate(over="ignore"):
        assert_same_as_gguf(raw, kind, (256, 32))
    values = dequantize(torch.from_numpy(raw), kind.type_id, (256, 32))
    assert values[1].abs().max() > 0 and values[0][values[0] != 0].abs().min() == 2.0**-128
    assert values[255].abs().max() == float("inf")


def quantizable(kind: GgufType) -> bool:
    try:
        quants.quantize(np.zeros((1, kind.block_values), dtype=np.float32), ggml(kind))
    except NotImplementedError:
        return False
    return True


QUANTIZABLE = [t for t in TYPES if quantizable(t)]


def test_gguf_py_quantizes_the_types_it_always_has() -> None:
    names = {t.name for t in QUANTIZABLE}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"} <= names


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_weights_dequantize_as_gguf_does(kind: GgufType) -> None:
    rng = np.random.default_rng(kind.type_id)
    rows, row_blocks = 9, 4
    cols = row_blocks * max(kind.block_values, 32)
    # Blocks of very different magnitudes (a misplaced scale shows), one all-zero block (scale 0).
    weights = rng.standard_normal((rows, cols)).astype(np.float32)
    weights *= np.exp2(rng.integers(-10, 10, (rows, cols // 32))).repeat(32, axis=1).astype(np.float32)
    weights[3, :32] = 0
    raw = quants.quantize(weights, ggml(kind)).view(np.uint8).reshape(rows, -1)
    assert_same_as_gguf(raw, kind, (rows, cols))
    # And the quantization was real: the values come back near the weights.
    back = dequantize(torch.from_numpy(raw), kind.type_id, (rows, cols))
    scale = torch.from_numpy(np.abs(weights).reshape(rows, -1, 32).max(-1)).repeat_interleave(32, 1)
    assert ((back - torch.from_numpy(weights)).abs() <= 0.25 * scale).all()


def test_bytes_in_any_layout_holding_them_in_order() -> None:
    kind = BY_NAME["Q4_K"]
    raw = torch.from_numpy(random_blocks(kind, (4, 512), seed=1))
    want = dequantize(raw, kind.type_id, (4, 512))
    wider = torch.zeros(4, raw.shape[1] + 7, dtype=torch.uint8)
    wider[:, 3 : 3 + raw.shape[1]] = raw
    assert torch.equal(dequantize(wider[:, 3 : 3 + raw.shape[1]], kind.type_id, (4, 512)), want)
    assert torch.equal(dequantize(raw.flatten(), kind.type_id, (4, 512)), want)
    assert torch.equal(dequantize(raw, kind.type_id, (2, 2, 512)), want.view(2, 2, 512))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_a_gpu_dequantizes_as_the_cpu_does(kind: GgufType) -> None:
    shape = (37, 3 * kind.block_values)
    raw = torch.from_numpy(random_blocks(kind, shape, seed=kind.type_id))
    want = dequantize(raw, kind.type_id, shape)
    got = dequantize(raw.cuda(), kind.type_id, shape)
    assert got.is_cuda and torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


# --- sizes and refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_packed_bytes_are_ggufs(kind: GgufType) -> None:
    for shape in [(kind.block_values,), (3, 2 * kind.block_values), (2, 5, 4 * kind.block_values), (0, 256)]:
        want = int(np.prod(quants.quant_shape_to_byte_shape(shape, ggml(kind))))
        assert gguf_packed_bytes(kind.type_id, shape) == want


@pytest.mark.parametrize(
    ("type_id", "named"), [(16, "IQ2_XXS (type id 16)"), (40, "NVFP4"), (4, "unknown type id 4")]
)
def test_other_types_are_refused_by_name(type_id: int, named: str) -> None:
    for refuse in (
        lambda: gguf_type(type_id),
        lambda: gguf_packed_bytes(type_id, (1, 256)),
        lambda: dequantize(torch.zeros(1024, dtype=torch.uint8), type_id, (1, 256)),
    ):
        with pytest.raises(ValueError, match="not supported") as refused:
            refuse()
        assert named in str(refused.value) and "Q4_K" in str(refused.value)


def test_rows_of_partial_blocks_are_refused() -> None:
    q4_k, q8_0 = BY_NAME["Q4_K"].type_id, BY_NAME["Q8_0"].type_id
    with pytest.raises(ValueError, match="Q4_K row of 128 values is not a whole number of 256-value"):
        gguf_packed_bytes(q4_k, (4, 128))
    with pytest.raises(ValueError, match="Q8_0 row of 40 values"):
        dequantize(torch.zeros(4 * 68, dtype=torch.uint8), q8_0, (4, 40))
    with pytest.raises(ValueError, match="shape"):
        gguf_packed_bytes(q8_0, ())


def test_bytes_that_do_not_fit_the_shape_are_refused() -> None:
    q8_0 = BY_NAME["Q8_0"].type_id
    with pytest.raises(ValueError, match="takes 136 bytes, got 135"):
        dequantize(torch.zeros(135, dtype=torch.uint8), q8_0, (2, 64))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(136, dtype=torch.int8), q8_0, (2, 64))


# --- Q8_0 as a GPU holds it ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "head"), [("Q8_0", 2)])
def test_device_rows_hold_the_same_values_in_the_same_bytes(name: str, head: int) -> None:
    """device_rows moves each row's code bytes ahead of its blocks' heads: the same bytes, the same
    values, and rows of their own (any subset of rows is still whole rows)."""
    kind = BY_NAME[name]
    layout = ROW_LAYOUTS[kind.type_id][0]
    raw = torch.from_numpy(random_blocks(kind, (5, 512), seed=9))
    rows = device_rows(raw, kind.type_id, 512)
    assert rows.shape == raw.shape and rows.dtype == torch.uint8 and ROW_LAYOUTS[kind.type_id][1] == head
    assert torch.equal(rows.sort(dim=1).values, raw.sort(dim=1).values)
    want = dequantize(raw, kind.type_id, (5, 512))
    got = dequantize(rows, layout.type_id, (5, 512))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # subnormal and inf scales too
    assert torch.equal(dequantize(rows[1:3], layout.type_id, (2, 512)), want[1:3])
    blocks = raw.view(5, -1, kind.block_bytes)
    assert torch.equal(rows[:, : blocks.shape[1] * (kind.block_bytes - head)], blocks[:, :, head:].flatten(1))
    assert gguf_type(layout.type_id) is layout and layout.type_id < 0  # no GGUF header holds it
    with pytest.raises(ValueError, match=f"{name} rows of 512 values"):
        device_rows(raw[:, :-2], kind.type_id, 512)
