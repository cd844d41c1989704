"""DeepSeek-V4's decode attention core (v4_decode_attention): the eager form equals the spelled-out
math (one softmax over visible keys and the sink, values = keys, the rope dims rotated back), the
custom op is one op, the Triton kernels (on CUDA, or Triton's CPU interpreter) equal the eager
form for sliding, HCA and CSA layers, and a tiny model's decode steps are the same through them."""

from __future__ import annotations

import math

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import decode_attention as v4_decode_attention
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check

H, D, ROPE, W, RATE = 16, 64, 16, 8, 4

Args = tuple[torch.Tensor | float | None, ...]


def inputs(
    kind: str,
    pos: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    heads: int = H,
    dim: int = D,
    entries: int = 12,
    topk: int = 6,
    window: int = W,
    rope: int = ROPE,
) -> Args:
    """decode_attention's arguments as the model builds them: the ring's slot s visible from
    position s, entry w from (w + 1) RATE - 1 (a strided view, as the model's), CSA picks in a
    shuffled order that include invisible entries when pos is small."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.arange(max(window, entries * RATE))
    q = torch.randn(heads, dim, generator=gen).to(dtype)
    ring = torch.randn(window, dim, generator=gen).to(dtype)
    extra = extra_ready = picks = None
    if kind != "sliding":
        extra = torch.randn(entries, dim, generator=gen).to(dtype)
        extra_ready = steps[RATE - 1 : entries * RATE : RATE]
        if kind == "csa":
            picks = torch.randperm(entries, generator=gen)[:topk]
    sinks = torch.randn(heads, generator=gen)
    angles = 3 * torch.randn(1, rope // 2, generator=gen)
    turn = torch.polar(torch.ones_like(angles), angles)
    return (q, ring, steps[:window], extra, extra_ready, picks, sinks, torch.tensor([pos]), dim**-0.5, turn)


def spelled_out(args: Args) -> torch.Tensor:
    """Head by head in float64: softmax over [visible keys' scaled scores | sink], the values are
    the keys, then each rope pair (x0, x1) of the last ROPE dims times e^{-iφ}."""
    q, ring, ring_ready, extra, extra_ready, picks, sinks, pos, scale, turn = args
    assert isinstance(q, torch.Tensor) and isinstance(ring, torch.Tensor) and isinstance(turn, torch.Tensor)
    keys, ready = [*ring.double()], [int(r) for r in ring_ready]  # type: ignore[union-attr]
    if isinstance(extra, torch.Tensor) and isinstance(extra_ready, torch.Tensor):
        chosen = picks.tolist() if isinstance(picks, torch.Tensor) else range(extra.shape[0])
        keys += [extra[j].double() for j in chosen]
        ready += [int(extra_ready[j]) for j in chosen]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        seen = [k for k, r in zip(keys, ready, strict=True) if r <= int(pos)]  # type: ignore[call-overload]
        logits = [float(q[h].double() @ k) * scale for k in seen] + [float(sinks[h])]  # type: ignore[index, operator]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        for w, k in zip(weights, seen, strict=False):  # the sink has no value
            out[h] += w / total * k
    dim = q.shape[1]
    for i in range(ROPE // 2):
        c, s = float(turn[0, i].real), float(turn[0, i].imag)
        x0, x1 = out[:, dim - ROPE + 2 * i].clone(), out[:, dim - ROPE + 2 * i + 1].clone()
        out[:, dim - ROPE + 2 * i] = x0 * c + x1 * s
        out[:, dim - ROPE + 2 * i + 1] = x1 * c - x0 * s
    return out


CASES = [
    ("sliding", 5),  # slots 6 and 7 not written yet
    ("sliding", 30),
    ("hca", 9),  # entries 0 and 1 visible, 2.. not
    ("hca", 60),
    ("csa", 13),  # some picks visible, some not
    ("csa", 60),
]


@pytest.mark.parametrize(("kind", "pos"), CASES)
def test_the_eager_form_equals_the_spelled_out_math(kind: str, pos: int) -> None:
    args = inputs(kind, pos, seed=pos)
    out = v4_decode_attention.reference(*args)
    expected = spelled_out(args)
    assert out.shape == (H, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # The keys mattered: not the sink alone (zeros) nor one key's row.
    assert out.abs().mean() > 0.05


def test_picks_equal_gathered_rows() -> None:
    q, ring, ring_ready, extra, extra_ready, picks, *rest = inputs("csa", 13, seed=3)
    assert isinstance(extra, torch.Tensor) and isinstance(picks, torch.Tensor)
    assert isinstance(extra_ready, torch.Tensor)
    ours = v4_decode_attention.reference(q, ring, ring_ready, extra, extra_ready, picks, *rest)
    gathered = extra.index_select(0, picks), extra_ready.index_select(0, picks)
    expected = v4_decode_attention.reference(q, ring, ring_ready, *gathered, None, *rest)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_mismatched_extras_are_refused() -> None:
    q, ring, ring_ready, extra, _, picks, *rest = inputs("csa", 13, seed=4)
    with pytest.raises(ValueError, match="extra_ready"):
        v4_decode_attention.decode_attention(q, ring, ring_ready, extra, None, picks, *rest)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_the_custom_op_is_one_op_with_the_same_result(kind: str) -> None:
    args = inputs(kind, 13, seed=5)
    expected = v4_decode_attention.reference(*args)
    seen = OpNames()
    with v4_decode_attention.SWITCH.force(True), torch.inference_mode(), seen:
        out = v4_decode_attention.decode_attention(*args)
    assert seen.names == ["v4_decode_attention"]  # what a graph capture or an op counter sees
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_the_cpu_runs_the_eager_form_by_default() -> None:
    args = inputs("hca", 13, seed=6)
    assert v4_decode_attention.SWITCH.forced is None and not v4_decode_attention.enabled(args[0])
    seen = OpNames()
    with torch.inference_mode(), seen:
        out = v4_decode_attention.decode_attention(*args)
    assert "v4_decode_attention" not in seen.names and "softmax" in seen.names
    torch.testing.assert_close(out.double(), spelled_out(args), rtol=1e-5, atol=1e-5)


_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import decode_attention as v4_decode_attention
from tests.engine.kernels.deepseek_v4.test_decode_attention import CASES, inputs

kernel = v4_decode_attention._triton_kernel()
assert kernel is not None
device = "cuda" if torch.cuda.is_available() else "cpu"


def on(args):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


tolerance = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
for dtype in (torch.float32, torch.bfloat16):
    for kind, pos in CASES:
        args = on(inputs(kind, pos, seed=pos, dtype=dtype))
        expected = v4_decode_attention.reference(*args)
        # Default blocks (one program per key block here), then many splits and value slices, then
        # 24 heads (a partial head block) with 40 entries (a partial key block).
        for knobs in ({}, dict(block_d=16, per_split=16)):
            out = kernel(*args, **knobs)
            assert out.dtype == dtype and out.shape == expected.shape
            torch.testing.assert_close(out.float(), expected.float(), **tolerance[dtype])
        args = on(inputs(kind, pos, seed=pos, dtype=dtype, heads=24, entries=40, topk=20))
        out = kernel(*args, block_d=32, per_split=32)
        expected = v4_decode_attention.reference(*args)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance[dtype])
if device == "cuda":
    # Flash's shapes (64 heads of 512, rope 64, window 128, 512 picks among 2048 entries), then the
    # kernels captured in a CUDA graph once and replayed at other positions: pos is read on the device.
    for kind in ("sliding", "hca", "csa"):
        args = list(on(inputs(kind, 1000, seed=2, dtype=torch.bfloat16, heads=64, dim=512, entries=2048,
                              topk=512, window=128, rope=64)))
        out = kernel(*args)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernel(*args)
        for at in (60, 1000, 9000):
            args[7].fill_(at)
            graph.replay()
            expected = v4_decode_attention.reference(*args)
            torch.testing.assert_close(out.float(), expected.float(), **tolerance[torch.bfloat16])
print("triton ok")
"""


def test_the_triton_kernels_equal_the_eager_form() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter (the same kernel source, run by
    numpy). Skipped where Triton is not installed."""
    stdout = run_triton_check(_TRITON_CHECK)
    assert "triton ok" in stdout


_MODEL_CHECK = """
import tempfile
from pathlib import Path

import torch
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models.deepseek_v4 import decode as v4_decode
from ds4desk.engine.kernels.deepseek_v4 import decode_attention as v4_decode_attention
from ds4desk.engine.loader import load_model
from tests.engine.tiny_dense import source_from_folder

kernel = v4_decode_attention._triton_kernel()
assert kernel is not None
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
folder = Path(tempfile.mkdtemp())
make_tiny("deepseek_v4", folder, seed=3)  # sliding, CSA (rate 4, top 6), HCA (rate 8), CSA; window 8
source = source_from_folder(folder)
ids = torch.randint(0, source.config["vocab_size"], (30,), generator=torch.Generator().manual_seed(1))
launches = []


def through_the_kernel(*args):
    launches.append(args[5] is not None)  # CSA picks given as indices
    return kernel(*args)


def steps(dtype, fused):
    # decode_attention is the name the model calls: the eager form, or the Triton kernels (on the
    # CPU that is the interpreter, which the op's own dispatch never picks).
    v4_decode.decode_attention = through_the_kernel if fused else v4_decode_attention.reference
    model = load_model(source, device, dtype).model
    model.allocate_cache(64)
    token, pos = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2))
    out = []
    with torch.inference_mode():
        model.forward(ids[:5].to(device), 0, "none")
        for at in range(5, len(ids)):  # the ring wraps, HCA and CSA rows close, early picks are invisible
            token.fill_(int(ids[at]))
            pos.fill_(at)
            out.append(model.decode_graphable(token, pos, 32).float().cpu())
            model.set_length(at + 1)
    return torch.stack(out)


for dtype, limit in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    eager, fused = steps(dtype, False), steps(dtype, True)
    error = float((fused - eager).norm() / eager.norm())
    assert error < limit, (dtype, error)
    print(dtype, error)
    assert eager.std() > 0 and not torch.equal(eager[0], eager[1])
assert True in launches and False in launches
print("model ok")
"""


def test_the_models_decode_steps_equal_through_the_kernels() -> None:
    stdout = run_triton_check(_MODEL_CHECK)
    assert "model ok" in stdout
