"""quant/gguf_cpu.py and its C kernels: for every GGUF type they cover, on both the AVX-512 and the
portable kernels, the matmul equals gguf_matmul.reference_matmul (dequantize, float32 matmul) to
accumulation-order error, for decode (T = 1, 2, 7) and prefill (T = 64, one tile and many), rows
that do not split evenly over threads, row slices of a weight and strided outputs; the C dequantizer
equals the torch reference bit for bit. Weights come from gguf-py's quantizer where it has one for
the type, random valid blocks otherwise, and from the real SmolLM2 GGUF that ds4desk embeds."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from ds4desk.engine.api import EngineFailure
from ds4desk.engine.formats import GGUF_TYPES, GgufType, gguf_packed_bytes
from ds4desk.engine.kernels.quant import gguf as reference
from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.engine.kernels.quant.gguf_matmul import gguf_matmul, reference_matmul
from ds4desk.engine.loading.default_model import default_model_path

needs_extension = pytest.mark.skipif(not gguf_cpu.available(), reason="the C extension is not built")


@pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("gcc") is None, reason="the build needs Linux and GCC"
)
def test_the_extension_is_built_where_gcc_is() -> None:
    """The extension is optional (an install without a compiler still works), so a build that
    failed would only show as skipped tests: where GCC is, it must have been built and imported."""
    assert gguf_cpu.available(), "pip install -e . did not build ds4desk/engine/kernels/quant/_gguf_cpu"
    assert gguf_cpu.kernel_isa() in ("avx512", "portable")


COVERED = [t for t in GGUF_TYPES.values() if gguf_cpu.covers(t.type_id, torch.float32)]


def quantizable(kind: GgufType) -> bool:
    try:
        quants.quantize(
            np.zeros((1, kind.block_values), dtype=np.float32), gguf.GGMLQuantizationType(kind.type_id)
        )
    except NotImplementedError:
        return False
    return True


def packed_weight(kind: GgufType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row_bytes]: gguf-py's quantization of random weights where it can quantize the
    type, else random blocks with finite scales of varied magnitude."""
    rng = np.random.default_rng(seed)
    if quantizable(kind):
        weights = rng.standard_normal((rows, cols)).astype(np.float32)
        weights *= np.exp2(rng.integers(-6, 3, (rows, 1))).astype(np.float32)
        raw = quants.quantize(weights, gguf.GGMLQuantizationType(kind.type_id)).view(np.uint8)
        return torch.from_numpy(raw.reshape(rows, -1).copy())
    if kind.name in ("F16", "BF16"):
        values = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
        dtype = torch.float16 if kind.name == "F16" else torch.bfloat16
        return values.to(dtype).view(torch.uint8).reshape(rows, -1).clone()
    blocks = rng.integers(0, 256, (rows * cols // kind.block_values, kind.block_bytes), dtype=np.uint8)
    for at in kind.fp16_scales:
        scales = rng.uniform(0.5, 1.0, len(blocks)) * np.exp2(rng.integers(-12, 2, len(blocks)))
        scales *= rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind.name == "MXFP4":
        blocks[:, 0] = rng.integers(110, 135, len(blocks))
    return torch.from_numpy(blocks.reshape(rows, -1))


def assert_close_to_reference(
    x: torch.Tensor, raw: torch.Tensor, kind: GgufType, cols: int, got: torch.Tensor, rounded: bool = False
):
    """Accumulation-order error: relative to the sum of |x||w| of each output, as float32 sums allow.
    `rounded`: a bfloat16 product (BF16_PREFILL): x and the weights rounded to bfloat16 (2^-9 of each
    value at most), float32 sums, the result rounded (2^-9 of it)."""
    rows = raw.shape[0]
    want = reference_matmul(x, raw, kind.type_id, cols, torch.empty(x.shape[0], rows))
    w = reference.dequantize(raw.contiguous(), kind.type_id, (rows, cols))
    sums = x.abs() @ w.abs().t()
    bound = (1.01 * 2**-8 * sums + 2**-9 * want.abs() if rounded else 1e-5 * sums) + 1e-30
    assert got.shape == want.shape and torch.isfinite(want).all()
    excess = ((got - want).abs() / bound).max().item()
    assert excess <= 1.0, f"{kind.name}: error {excess:.3g} x the bound"


@needs_extension
def test_the_kernels_cover_the_quantized_types() -> None:
    names = {t.name for t in COVERED}
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"} <= names
    assert {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16"} <= names
    # F32 goes to the reference (its bytes are the float weight); other activations are not read.
    assert not gguf_cpu.covers(0, torch.float32)
    assert not gguf_cpu.covers(3, torch.bfloat16) and not gguf_cpu.covers(3, torch.float16)


@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_extension
def test_dequantize_is_the_reference_bit_for_bit(kind: GgufType, isa: str) -> None:
    cols = 2 * max(kind.block_values, 32) if kind.block_values < 256 else 512
    raw = packed_weight(kind, 13, cols, seed=kind.type_id)
    want = reference.dequantize(raw, kind.type_id, (13, cols))
    got = gguf_cpu.dequantize(raw, kind.type_id, cols)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), kind.name


# rows: one row, rows that do not split into equal 4-row thread chunks, more rows than cols.
SHAPES = [(1, 1), (37, 2), (130, 3)]  # (rows, blocks of 256 values per row)


@pytest.mark.parametrize("tokens", [1, 2, 7, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_extension
def test_matmul_is_the_reference(kind: GgufType, shape: tuple[int, int], tokens: int, isa: str) -> None:
    rows, cols = shape[0], shape[1] * 256
    raw = packed_weight(kind, rows, cols, seed=rows * 1000 + kind.type_id)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    out = torch.full((tokens, rows), float("nan"))
    got = gguf_cpu.matmul(x, raw, kind.type_id, cols, out)
    assert got is out
    assert_close_to_reference(x, raw, kind, cols, out)


@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_extension
def test_row_slices_strided_outputs_and_small_tiles(kind: GgufType, isa: str, monkeypatch) -> None:
    rows, cols = 50, 512
    raw = packed_weight(kind, rows, cols, seed=7)
    part = raw[5:44]  # a row slice: its rows keep the whole weight's stride
    for tokens in (3, 20):
        x = torch.randn(tokens, cols)
        wide = torch.full((tokens, 60), float("nan"))
        out = wide[:, 10:49]  # rows of the output are 60 floats apart
        gguf_cpu.matmul(x, part, kind.type_id, cols, out)
        assert_close_to_reference(x, part, kind, cols, out)
        assert wide[:, :10].isnan().all() and wide[:, 49:].isnan().all()
    # Prefill in tiles of 3 rows (39 rows: 13 tiles), each dequantized into the scratch.
    monkeypatch.setattr(gguf_cpu, "TILE_VALUES", 3 * cols)
    x = torch.randn(33, cols)
    with gguf_cpu.PACKED_GEMM.force(False):
        got = gguf_cpu.matmul(x, part, kind.type_id, cols, torch.empty(33, 39))
    assert_close_to_reference(x, part, kind, cols, got)


@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_extension
def test_prefill_gemm_at_the_edges_of_its_blocks(kind: GgufType, isa: str) -> None:
    """Prefill's packed GEMM takes the tokens in blocks of 32 (the last one partly empty) and groups of
    blocks (512 tokens at 512 columns), the rows in panels of 12 (the last one short): token counts on
    both sides of a block's and a group's edge, 37 rows (three panels and one of one row), a row
    slice and a strided output. With the AVX-512 kernels the GEMM itself runs (the extension says
    so); the portable build, PACKED_GEMM off and, on Intel CPUs, more than GEMM_MAX_T tokens take the
    tiles."""
    rows, cols = 37, 512
    raw = packed_weight(kind, rows + 3, cols, seed=kind.type_id + 11)[3:]
    for tokens in (17, 31, 32, 33, 100, 600):
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
        for packed in (True, False):
            wide = torch.full((tokens, rows + 8), float("nan"))
            out = wide[:, 4 : 4 + rows]
            with gguf_cpu.PACKED_GEMM.force(packed):
                gguf_cpu.matmul(x, raw, kind.type_id, cols, out)
            assert_close_to_reference(x, raw, kind, cols, out)
            assert wide[:, :4].isnan().all() and wide[:, 4 + rows :].isnan().all()
        direct = torch.full((tokens, rows), float("nan"))
        ran = gguf_cpu._ext.gemm(
            kind.type_id, raw.data_ptr(), raw.stride(0), rows, cols, x.data_ptr(), tokens, cols,
            direct.data_ptr(), rows, 2,
        )  # fmt: skip
        assert ran == (isa == "avx512")
        if ran:
            assert_close_to_reference(x, raw, kind, cols, direct)


class _Recorder:
    """The extension with its calls recorded by name."""

    def __init__(self, ext: object) -> None:
        self.ext, self.called = ext, []

    def __getattr__(self, name: str) -> object:
        function = getattr(self.ext, name)

        def recorded(*args: object) -> object:
            self.called.append(name)
            return function(*args)

        return recorded


@pytest.mark.parametrize(
    ("identity", "gemm_takes_600"),
    [
        (("AuthenticAMD", 26), True),
        (("AuthenticAMD", 25), False),
        (("GenuineIntel", 6), False),
        (("", 0), False),
    ],
)
@needs_extension
def test_long_prefills_take_the_gemm_on_zen_5_and_the_tiles_elsewhere(
    monkeypatch: pytest.MonkeyPatch, identity: tuple[str, int], gemm_takes_600: bool
) -> None:
    """MKL's float32 GEMM runs AVX-512 on Intel CPUs (the tiles win past GEMM_MAX_T rows there) and
    AVX2 on AMD ones, where a Zen 5's full-width AVX-512 GEMM wins at every length: the route follows
    the vendor and the family."""
    if gguf_cpu.kernel_isa() != "avx512":
        pytest.skip("the portable build has no packed GEMM")
    kind = next(t for t in GGUF_TYPES.values() if t.name == "Q4_K")
    raw = packed_weight(kind, 24, 512, seed=3)
    monkeypatch.setattr(gguf_cpu, "cpu_identity", lambda: identity)
    gguf_cpu._gemm_max_t.cache_clear()
    recorder = _Recorder(gguf_cpu._ext)
    monkeypatch.setattr(gguf_cpu, "_ext", recorder)
    try:
        for tokens in (100, gguf_cpu.GEMM_MAX_T + 1, 600):
            recorder.called.clear()
            x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens))
            out = torch.empty(tokens, 24)
            gguf_cpu.matmul(x, raw, kind.type_id, 512, out)
            assert_close_to_reference(x, raw, kind, 512, out)
            tiles = "dequantize" in recorder.called
            assert tiles == (tokens > gguf_cpu.GEMM_MAX_T and not gemm_takes_600), (tokens, recorder.called)
    finally:
        gguf_cpu._gemm_max_t.cache_clear()


def test_the_cpu_identity_is_the_systems() -> None:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    fields = [line.split(":", 1) for line in lines if ":" in line]
    vendors = [value.strip() for name, value in fields if name.strip() == "vendor_id"]
    families = [int(value) for name, value in fields if name.strip() == "cpu family"]
    if not vendors or not families:
        pytest.skip("no vendor_id and cpu family in /proc/cpuinfo here")
    assert gguf_cpu.cpu_identity() == (vendors[0], families[0])


needs_bf16 = pytest.mark.skipif(
    not (gguf_cpu.available() and gguf_cpu.bf16_products_run_fast()), reason="this CPU has no AVX-512 BF16"
)


@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_bf16
def test_bfloat16_tiles_are_the_reference_rounded_to_nearest_even(kind: GgufType) -> None:
    cols = 2 * max(kind.block_values, 32) if kind.block_values < 256 else 512
    raw = packed_weight(kind, 13, cols, seed=kind.type_id + 50)
    want = reference.dequantize(raw, kind.type_id, (13, cols)).to(torch.bfloat16)
    got = gguf_cpu.dequantize(raw, kind.type_id, cols, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), kind.name


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_bf16
def test_bfloat16_prefill_is_the_reference_within_its_bound(kind: GgufType, shape: tuple[int, int]) -> None:
    rows, cols = shape[0], shape[1] * 256
    raw = packed_weight(kind, rows, cols, seed=rows * 1000 + kind.type_id)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(rows))
    with gguf_cpu.BF16_PREFILL.force(True):
        got = gguf_cpu.matmul(x, raw, kind.type_id, cols, torch.full((64, rows), float("nan")))
    assert torch.equal(got, got.bfloat16().float())  # the bfloat16 product ran
    assert_close_to_reference(x, raw, kind, cols, got, rounded=True)


@pytest.mark.parametrize("threads", [1, 2])
@needs_extension
def test_any_thread_count_gives_the_reference(threads: int) -> None:
    kind = GGUF_TYPES[3]  # Q4_1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        raw = packed_weight(kind, 301, 576, seed=threads)
        for tokens in (1, 5):
            x = torch.randn(tokens, 576)
            assert_close_to_reference(
                x, raw, kind, 576, gguf_cpu.matmul(x, raw, 3, 576, torch.empty(tokens, 301))
            )
    finally:
        torch.set_num_threads(before)


@needs_extension
def test_malformed_operands_are_refused() -> None:
    raw = packed_weight(GGUF_TYPES[3], 4, 64, seed=1)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError):
        gguf_cpu.matmul(x, raw[:, :-1], 3, 64, torch.empty(1, 4))  # rows one byte short
    with pytest.raises(ValueError):
        gguf_cpu.matmul(torch.randn(1, 32), raw, 3, 64, torch.empty(1, 4))  # x of the wrong width
    with pytest.raises(ValueError):
        gguf_cpu.matmul(x, raw, 3, 64, torch.empty(2, 4))  # out of the wrong shape
    with pytest.raises(ValueError):
        gguf_cpu.matmul(x.double(), raw, 3, 64, torch.empty(1, 4, dtype=torch.float64))


def smollm2_gguf() -> Path | None:
    try:
        return default_model_path()
    except EngineFailure:
        return None


@pytest.mark.skipif(smollm2_gguf() is None, reason="the embedded SmolLM2 GGUF is not installed")
@needs_extension
def test_the_real_smollm2_weights_through_the_dispatcher() -> None:
    """The file's own Q4_1 projections and Q8_0 embedding (the tied head), through gguf_matmul."""
    reader = gguf.GGUFReader(smollm2_gguf())
    tensors = {t.name: t for t in reader.tensors}
    checked = set()
    for name in ("blk.0.attn_k.weight", "blk.3.ffn_down.weight", "blk.29.ffn_up.weight", "token_embd.weight"):
        tensor = tensors[name]
        cols, rows = (int(n) for n in tensor.shape[:2])
        kind = GGUF_TYPES[int(tensor.tensor_type)]
        data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        assert data.shape[1] * rows == gguf_packed_bytes(kind.type_id, (rows, cols))
        raw = torch.from_numpy(data[:3000].copy())  # the head's first rows keep the reference quick
        checked.add(kind.name)
        for tokens in (1, 7, 40):
            x = torch.randn(tokens, cols)
            got = gguf_matmul(x, raw, kind.type_id, cols)
            rounded = tokens > gguf_cpu.GEMV_MAX_T and gguf_cpu.BF16_PREFILL.on(x)
            assert_close_to_reference(x, raw, kind, cols, got, rounded=rounded)
    assert checked == {"Q4_1", "Q8_0"}


def test_bfloat16_prefill_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS4DESK_CPU_BF16_PREFILL", raising=False)
    assert not gguf_cpu.BF16_PREFILL.on(torch.zeros(1))
    monkeypatch.setenv("DS4DESK_CPU_BF16_PREFILL", "1")
    assert gguf_cpu.BF16_PREFILL.on(torch.zeros(1)) == gguf_cpu.bf16_products_run_fast()


@pytest.mark.skipif(smollm2_gguf() is None, reason="the embedded SmolLM2 GGUF is not installed")
@needs_bf16
def test_bfloat16_prefill_of_the_real_smollm2_keeps_its_next_tokens() -> None:
    """What the opt-in costs on a real model and real text: every position's logits of a 97-token
    prompt against the float32 products' (measured: the same top-1 everywhere, mean KL 4e-4)."""
    from ds4desk.engine.loader import load_model
    from ds4desk.engine.loading.detect import read_source
    from ds4desk.engine.tokenizer import ChatTokenizer

    source = read_source(str(smollm2_gguf()))
    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type with an oil-based ink and a screw press. Within decades, printing "
        "shops had spread across Europe, books became cheaper, and literacy rose. "
    ) * 2
    ids = torch.tensor(ChatTokenizer.from_source(source).encode(text))
    assert len(ids) > gguf_cpu.GEMV_MAX_T  # prefill's path, not the GEMV's
    with torch.inference_mode():
        model = load_model(source, torch.device("cpu"), torch.float32).model
        model.allocate_cache(len(ids) + 8)
        with gguf_cpu.BF16_PREFILL.force(False):
            exact = model.forward(ids, 0, "all").float()
        with gguf_cpu.BF16_PREFILL.force(True):
            rounded = model.forward(ids, 0, "all").float()
    assert not torch.equal(exact, rounded)  # the rounding ran
    assert (exact.argmax(-1) == rounded.argmax(-1)).float().mean() >= 0.95
    log_p, log_q = exact.log_softmax(-1), rounded.log_softmax(-1)
    assert (log_p.exp() * (log_p - log_q)).sum(-1).mean() < 5e-3
