"""One token's attention over the KV cache (models/decode_attention.py): the eager form, the custom op
and the Triton kernel (on CUDA, or Triton's CPU interpreter) all equal softmax attention spelled out
row by row; the dense model's graphable decode step gives the same results through it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.kernels.dense import decode_attention as da
from ds4desk.engine.loader import load_model
from ds4desk.engine.runtime import Runtime
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import save_tiny
from tests.engine.triton_check import run_triton_check

KV, G, D, SPAN, CONTEXT = 2, 4, 16, 40, 50


def spelled_out(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float, window: int | None
) -> torch.Tensor:
    """Per kv head and query head: scores over the visible rows only, softmax, weighted sum (float64)."""
    visible = [j for j in range(keys.shape[1]) if j <= pos and (window is None or j > pos - window)]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        k = keys[h, visible].double()
        v = values[h, visible].double()
        for g in range(q.shape[1]):
            scores = (k @ q[h, g].double()) * scale
            weights = torch.exp(scores - scores.max())
            out[h, g] = (weights / weights.sum()) @ v
    return out


def inputs(
    seed: int, dtype: torch.dtype = torch.float32, kv: int = KV, group: int = G, dim: int = D
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [kv, group, dim] and keys / values as the model hands them over: [kv, SPAN, dim] views of a
    [2, kv, CONTEXT, dim] cache, so their head stride is CONTEXT * dim, not SPAN * dim."""
    gen = torch.Generator().manual_seed(seed)
    cache = (2 * torch.randn(2, kv, CONTEXT, dim, generator=gen)).to(dtype)
    q = torch.randn(kv, group, dim, generator=gen).to(dtype)
    return q, cache[0, :, :SPAN], cache[1, :, :SPAN]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("pos", [0, 17, SPAN - 1])
def test_the_eager_form_equals_the_spelled_out_math(pos: int, window: int | None) -> None:
    q, keys, values = inputs(seed=pos)
    assert keys.stride(0) == CONTEXT * D  # a view of the cache, not a copy
    got = da.reference(q, keys, values, torch.tensor([pos]), D**-0.5, window)
    expected = spelled_out(q, keys, values, pos, D**-0.5, window)
    assert got.shape == (KV, G, D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # At position 0 every head reads row 0 only; later, the rows past the position must not count.
    if pos == 0:
        torch.testing.assert_close(got, values[:, :1].expand(KV, G, D))
    elif pos < SPAN - 1 or window is not None:
        everything = spelled_out(q, keys, values, SPAN - 1, D**-0.5, None)
        assert (got.double() - everything).abs().max() > 1e-2


def test_bfloat16_stays_bfloat16_and_close() -> None:
    q, keys, values = inputs(seed=1, dtype=torch.bfloat16)
    got = da.reference(q, keys, values, torch.tensor([30]), D**-0.5, 9)
    assert got.dtype == torch.bfloat16
    expected = spelled_out(q.float(), keys.float(), values.float(), 30, D**-0.5, 9)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=3e-2)


def test_the_custom_op_is_one_op_with_the_same_result() -> None:
    q, keys, values = inputs(seed=2)
    pos = torch.tensor([25])
    expected = da.reference(q, keys, values, pos, D**-0.5, 6)
    seen = OpNames()
    with da.SWITCH.force(True), torch.inference_mode(), seen:
        got = da.decode_attention(q, keys, values, pos, D**-0.5, 6)
    assert seen.names == ["decode_attention"]  # what a graph capture or an op counter sees
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.is_contiguous()


def test_the_cpu_runs_the_eager_form_by_default() -> None:
    assert da.SWITCH.forced is None and not da.enabled(torch.device("cpu"))
    q, keys, values = inputs(seed=3)
    seen = OpNames()
    with torch.inference_mode(), seen:
        got = da.decode_attention(q, keys, values, torch.tensor([11]), D**-0.5)
    assert "decode_attention" not in seen.names and "baddbmm" in seen.names
    torch.testing.assert_close(
        got.double(), spelled_out(q, keys, values, 11, D**-0.5, None), rtol=1e-5, atol=1e-5
    )


def test_mismatched_shapes_are_a_clear_error() -> None:
    q, keys, values = inputs(seed=4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        da.decode_attention(q, keys, values[:, :, :8], torch.tensor([3]), D**-0.5)


def test_splits_fill_the_gpu_and_cover_the_span() -> None:
    for span in (40, 256, 512, 1000, 4096, 32768):
        splits, chunk = da.plan_splits(span, 8, 132)
        assert chunk % da.BLOCK_N == 0 and splits * chunk >= span > (splits - 1) * chunk
        assert 8 * splits >= 132 or chunk == da.BLOCK_N  # enough programs, unless blocks run out
    assert da.plan_splits(4096, 8, 132) == (32, 128)


_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.dense import decode_attention as da
from tests.engine.kernels.dense.test_decode_attention import D, SPAN, inputs, spelled_out

kernel = da._triton_kernel()
assert kernel is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
cases = 0
POSITIONS = ((0, None), (15, None), (16, 5), (33, None), (SPAN - 1, None), (SPAN - 1, 7), (37, 30))
# (block, sms): one split of three partial tiles; two splits of two tiles; three splits of one tile.
for block, sms in ((16, 1), (16, 2), (16, 132)):
    da.BLOCK_N = block
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)):
        for pos, window in POSITIONS:
            q, keys, values = (t.to(device) for t in inputs(seed=pos + block + sms, dtype=dtype))
            at = torch.tensor([pos], device=device)
            got = kernel(q, keys, values, at, D**-0.5, window)
            assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
            assert torch.isfinite(got).all()
            expected = da.reference(q, keys, values, at, D**-0.5, window)
            exact = spelled_out(*(t.cpu().float() for t in (q, keys, values)), pos, D**-0.5, window)
            torch.testing.assert_close(got.cpu().double(), exact, rtol=tol, atol=tol)
            torch.testing.assert_close(got.float(), expected.float(), rtol=2 * tol, atol=2 * tol)
            cases += 1
# A group and a head size that are not powers of two (padded tiles), bfloat16, a window.
da.BLOCK_N = 16
q, keys, values = (t.to(device) for t in inputs(seed=9, dtype=torch.bfloat16, kv=3, group=3, dim=24))
got = kernel(q, keys, values, torch.tensor([29], device=device), 24**-0.5, 11)
exact = spelled_out(q.cpu().float(), keys.cpu().float(), values.cpu().float(), 29, 24**-0.5, 11)
torch.testing.assert_close(got.cpu().double(), exact, rtol=3e-2, atol=3e-2)
print("triton ok", cases)
"""


_TOKENS_CHECK = """
import torch
from ds4desk.engine.kernels.dense import decode_attention as da
from tests.engine.kernels.dense import test_decode_attention as layouts
from tests.engine.kernels.dense.test_decode_attention import D, SPAN, inputs, spelled_out_tokens

kernel = da._triton_kernel()
assert kernel is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
cases = 0
# Splits of 16 keys: at 14 the tokens' positions 14..17 straddle two, so the first rows see no key
# of the second split (an empty partial that must weigh nothing, not NaN).
for block, sms in ((16, 1), (16, 132)):
    da.BLOCK_N = block
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for pos, window in ((0, None), (14, None), (14, 5), (SPAN - 4, None)):
            q, keys, values = (t.to(device) for t in inputs(seed=pos + sms, dtype=dtype, group=2 * 4))
            at = torch.tensor([pos], device=device)
            # The tokens' heads as a slice of wider rows (q of a fused q|k|v projection).
            wide = torch.zeros(4, q.numel() // 4 + 40, dtype=dtype, device=device)
            wide[:, : q.numel() // 4] = layouts.as_tokens(q, 4).reshape(4, -1)
            tokens = wide[:, : q.numel() // 4].view(4, -1, D)
            got = layouts.as_rows(kernel(tokens, keys, values, at, D**-0.5, window, tokens=4), keys.shape[0])
            assert torch.isfinite(got).all()
            exact = spelled_out_tokens(*(t.cpu().float() for t in (q, keys, values)), pos, 4, D**-0.5, window)
            torch.testing.assert_close(got.cpu().double(), exact, rtol=tol, atol=tol)
            cases += 1
print("tokens ok", cases)
"""


def as_tokens(rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """A kv head's query rows [KV, G * T, D] (row g * T + t) as the tokens' heads [T, KV * G, D]."""
    kv, count, dim = rows.shape
    return rows.view(kv, count // tokens, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, -1, dim)


def as_rows(heads: torch.Tensor, kv: int) -> torch.Tensor:
    """The inverse of as_tokens: [T, KV * G, D] -> [KV, G * T, D]."""
    tokens, _, dim = heads.shape
    return heads.view(tokens, kv, -1, dim).permute(1, 2, 0, 3).reshape(kv, -1, dim)


def spelled_out_tokens(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: int,
    tokens: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """spelled_out for q [KV, G * T, D]: row g * T + t is a query at pos + t."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(q.shape[1]):
        one = spelled_out(q[:, row : row + 1], keys, values, pos + row % tokens, scale, window)
        out[:, row : row + 1] = one
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_a_few_tokens_each_see_up_to_their_own_position(window: int | None) -> None:
    """tokens = 4: the tokens' heads [T, H, D] (a slice of wider rows for the kernel), every query
    masked at its own position, in the eager form and the Triton kernel (interpreter or GPU); a q
    that is not that many tokens and a read-order copy of several tokens are refused."""
    q, keys, values = inputs(seed=2, group=8)
    at = torch.tensor([14])
    heads = as_tokens(q, 4)
    got = da.decode_attention(heads, keys, values, at, D**-0.5, window, tokens=4)
    assert got.shape == heads.shape
    got = as_rows(got, KV)
    exact = spelled_out_tokens(q, keys, values, 14, 4, D**-0.5, window)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    one_token = spelled_out(q, keys, values, 14, D**-0.5, window)
    assert (got.double() - one_token).abs().max() > 1e-2  # the later tokens see more keys
    with pytest.raises(ValueError, match="not 3 tokens"):
        da.decode_attention(heads, keys, values, at, D**-0.5, None, tokens=3)
    with pytest.raises(ValueError, match="one token only"):
        da.decode_attention(heads, keys, values, at, D**-0.5, None, (torch.zeros(q.numel()), 12, 2), tokens=4)
    stdout = run_triton_check(_TOKENS_CHECK)
    assert "tokens ok 16" in stdout


def test_the_triton_kernel_equals_the_fallback() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter (the same kernel source, run by
    numpy). Skipped where Triton is not installed."""
    stdout = run_triton_check(_TRITON_CHECK)
    assert "triton ok 63" in stdout


_ORDERED_CHECK = """
import torch
from ds4desk.engine.formats import GGUF_TYPES
from ds4desk.engine.kernels.dense import decode_attention as da
from ds4desk.engine.kernels.quant import gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_launch
from ds4desk.engine.kernels.quant import gguf_tiles

by_name = {t.name: t for t in GGUF_TYPES.values()}
da.SWITCH.forced = gt.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(5)
kv, group, dim, span = 2, 4, 64, 40  # a row of 512 values: 8 groups of 64
for dtype in (torch.bfloat16, torch.float32):
    shapes = ((kv, group, dim), (kv, span, dim), (kv, span, dim))
    q, keys, values = (torch.randn(*s, generator=gen).to(device, dtype) for s in shapes)
    at = torch.tensor([30], device=device)
    for name, groups in (("Q4_K", 8), ("Q4_K", 2), ("Q6_K", 4)):
        kind = by_name[name].type_id
        buffer = torch.zeros(kv * group * dim, device=device)
        out = da.decode_attention(q, keys, values, at, dim**-0.5, None, (buffer, kind, groups))
        # What o's own input kernel would have made of the attention output (gt.gemv's COPY mode).
        want = torch.empty_like(buffer)
        order = (kind, groups, out.numel() // 64)
        copy = gguf_tiles.INPUT_COPY
        gguf_launch.kernels().prepare(out.reshape(1, -1), None, 0.0, out.numel(), want, copy, order)
        assert torch.equal(buffer, want), (name, groups, dtype)
        print("checked", name, groups, dtype, flush=True)
print("ordered ok")
"""


def test_the_attention_writes_the_o_input_in_read_order() -> None:
    """The fused attention's read-order copy of its output (for the o projection's one-row GEMV) is
    exactly what o's input kernel makes of the output: on Triton's kernel (interpreter or GPU), and
    on the custom op's eager body (torch's read_order_index)."""
    stdout = run_triton_check(_ORDERED_CHECK)
    assert "ordered ok" in stdout and stdout.count("checked") == 6
    from ds4desk.engine.formats import GGUF_TYPES

    q, keys, values = inputs(seed=3, dim=64)
    for name in ("Q4_K", "Q6_K"):
        kind = next(t.type_id for t in GGUF_TYPES.values() if t.name == name)
        buffer = torch.zeros(q.numel())
        with da.SWITCH.force(True):
            out = da.decode_attention(q, keys, values, torch.tensor([20]), 0.125, None, (buffer, kind, 2))
        index = da.read_order_index(kind, 2, q.numel(), q.device)
        assert sorted(index.tolist()) == list(range(q.numel())), name
        assert torch.equal(buffer[index], out.flatten()), name


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("decode-attn-tiny")
    return {family: save_tiny(family, root / family)[1] for family in ("llama", "mistral")}


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 8
def test_the_graphable_step_through_the_op_equals_matmul(
    sources, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU with the op forced on (its body is the eager form there): the "triton" step calls it
    once per layer, never builds the -inf bias, and gives the "matmul" step's logits, past the window."""
    device = torch.device("cpu")
    models = {name: load_model(sources[family], device, torch.float32).model for name in ("matmul", "triton")}
    for name, model in models.items():
        model.decode_attention = name
        model.allocate_cache(64)
    monkeypatch.setattr(da.SWITCH, "forced", True)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    token_buf = torch.zeros(1, dtype=torch.long)
    pos_buf = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        logits = {name: model.forward(prompt, 0, "last") for name, model in models.items()}
        for pos in range(9, 30):
            token = int(torch.argmax(logits["matmul"]))
            token_buf.fill_(token)
            pos_buf.fill_(pos)
            for name, model in models.items():
                seen = OpNames()
                with seen:
                    logits[name] = model.decode_graphable(token_buf, pos_buf, 64)
                calls = seen.names.count("decode_attention")
                assert calls == (len(model._plans) if name == "triton" else 0)
                assert ("masked_fill_" in seen.names) == (name == "matmul")
            torch.testing.assert_close(logits["triton"], logits["matmul"], rtol=1e-5, atol=1e-5)


def test_triton_is_the_default_and_falls_back_on_the_cpu(sources) -> None:
    model = load_model(sources["llama"], torch.device("cpu"), torch.float32).model
    assert model.decode_attention == "triton"
    model.allocate_cache(32)
    seen = OpNames()
    with torch.inference_mode(), seen:
        model.forward(torch.tensor([1, 2, 3]), 0, "last")
        out = model.decode_graphable(torch.tensor([4]), torch.tensor([3]), 32)
    assert "decode_attention" not in seen.names and "baddbmm" in seen.names
    assert out.shape == (256,) and torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_replayed_graphs_with_the_kernel_give_the_matmul_tokens(tmp_path: Path, family: str) -> None:
    """On a GPU: greedy decode through captured graphs with the Triton kernel equals the one with the
    matmul attention, token for token, across a span bucket boundary (240 + 32 > 256)."""
    source = save_tiny(family, tmp_path / family, max_position_embeddings=1024)[1]
    device = torch.device("cuda")
    assert da.enabled(device)
    prompt = [int(t) for t in torch.randint(0, 256, (240,), generator=torch.Generator().manual_seed(5))]
    results = {}
    for attention in ("matmul", "triton"):
        model = load_model(source, device, torch.float32).model
        model.decode_attention = attention
        runtime = Runtime(model, device, context=1024, chunk=64, graphs=True)
        assert runtime.graphs is not None  # captured, not the eager fallback
        out = runtime.generate(
            prompt, SamplingParams(temperature=0.0), 32, set(), lambda _t: None, lambda: False
        )
        assert len(out.tokens) == 32
        results[attention] = (out.tokens, out.logprobs)
        runtime.close()
    assert results["triton"][0] == results["matmul"][0]
    diffs = [abs(a - b) for a, b in zip(results["triton"][1], results["matmul"][1], strict=True)]
    assert max(diffs) < 1e-3
