"""DeepSeek-V4's prefill attention (v4_prefill_attention): the eager form equals the spelled-out math
(query by query: its window rows, its compressed entries, one softmax with the sink), the custom op
is one op, the Triton kernel (on CUDA, or Triton's CPU interpreter) equals the eager form for every
layer kind, and the model's prefill through the fused path equals the unfused one."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as v4_prefill_attention
from ds4desk.engine.make_tiny import TINY_CONFIG
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.synthetic import fill_random_
from tests.engine.triton_check import run_triton_check

# 24 heads: one block of 32 with 8 masked heads, or two of 16, the second partly masked.
H, D, W, K = 24, 64, 8, 8
KINDS = ("sliding", "hca", "csa")

Inputs = tuple[
    torch.Tensor,
    torch.Tensor,
    int,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor,
]


def inputs(
    kind: str,
    count: int,
    start: int,
    dtype: torch.dtype,
    seed: int = 0,
    rate: int = 2,
    shape: tuple[int, int, int, int] = (H, D, W, K),
) -> Inputs:
    """A chunk of `count` queries at positions start.. as _attention builds it: keys [W - 1 + T, d] with
    pad = W - 1 - min(start, W - 1) invisible rows; HCA every entry so far ([E, d], visible from
    (w + 1) rate - 1 on); CSA K picks per query among them, some invisible (bias -inf). `shape` is
    (heads, head dim, window, picks)."""
    heads, dim, window, topk = shape
    gen = torch.Generator().manual_seed(seed)
    pad = window - 1 - min(start, window - 1)
    q = torch.randn(count, heads, dim, generator=gen)
    keys = torch.randn(window - 1 + count, dim, generator=gen)
    keys[:pad] = 0.0  # as _attention's zero padding
    sinks = torch.randn(heads, generator=gen)
    entries = picks = bias = None
    if kind != "sliding":
        total = max(1, (start + count) // rate)
        entries = torch.randn(total, dim, generator=gen).to(dtype)
        ready = ((torch.arange(start, start + count) + 1) // rate).unsqueeze(1)
        visible = torch.arange(total).unsqueeze(0) < ready  # [T, E]
        if kind == "csa":
            picks = torch.randint(0, total, (count, topk), generator=gen)
            visible = visible.gather(1, picks)
        bias = torch.zeros(visible.shape).masked_fill_(~visible, -math.inf)
    return q.to(dtype), keys.to(dtype), pad, entries, picks, bias, sinks


def spelled_out(
    q, keys, pad, entries, picks, bias, sinks, scale: float
) -> torch.Tensor:  # float64, query by query
    count, heads, _ = q.shape
    window = keys.shape[0] - count + 1
    rows = []
    for t in range(count):
        seen = keys[t + max(0, pad - t) : t + window].double()  # the visible window rows
        logits = [q[t].double() @ seen.t() * scale]
        values = [seen]
        if entries is not None:
            mine = entries if picks is None else entries[picks[t]]
            logits.append(q[t].double() @ mine.double().t() * scale + bias[t].double())
            values.append(mine.double())
        all_logits = torch.cat([*logits, sinks.double().view(heads, 1)], dim=1)
        probs = torch.softmax(all_logits, dim=1)[:, :-1]  # the sink takes its share, adds nothing
        rows.append(probs @ torch.cat(values))
    return torch.stack(rows)


CASES = [(kind, count, start) for kind in KINDS for count, start in ((5, 0), (11, 3), (6, 20))]


@pytest.mark.parametrize(("kind", "count", "start"), CASES)
def test_the_eager_form_equals_the_spelled_out_math(kind: str, count: int, start: int) -> None:
    args = inputs(kind, count, start, torch.float32, seed=count + start)
    scale = D**-0.5
    out = v4_prefill_attention.reference(*args, scale)
    assert out.shape == (count, H, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), spelled_out(*args, scale), rtol=1e-5, atol=1e-5)


def test_the_eager_form_keeps_the_model_dtype() -> None:
    args = inputs("csa", 7, 9, torch.bfloat16)
    out = v4_prefill_attention.reference(*args, D**-0.5)
    assert out.dtype == torch.bfloat16
    ref = spelled_out(*args, D**-0.5)
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", KINDS)
def test_the_custom_op_is_one_op_with_the_same_result(kind: str) -> None:
    args = inputs(kind, 6, 2, torch.float32)
    expected = v4_prefill_attention.reference(*args, 0.125)
    seen = OpNames()
    with v4_prefill_attention.SWITCH.force(True), torch.inference_mode(), seen:
        out = v4_prefill_attention.prefill_attention(*args, 0.125)
    assert seen.names == ["v4_prefill_attention"]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "count", "start"), CASES)
def test_a_pad_on_the_device_equals_the_host_pad(kind: str, count: int, start: int) -> None:
    """Through the custom op (forced, the eager form on the CPU) and the eager form itself."""
    q, keys, pad, *rest = inputs(kind, count, start, torch.float32, seed=count)
    ref = v4_prefill_attention.reference(q, keys, pad, *rest, 0.125)
    pad_at = torch.tensor([pad])
    assert torch.equal(v4_prefill_attention.reference(q, keys, pad_at, *rest, 0.125), ref)
    with v4_prefill_attention.SWITCH.force(True):
        assert torch.equal(v4_prefill_attention.prefill_attention(q, keys, pad_at, *rest, 0.125), ref)


def test_the_cpu_runs_the_eager_form_by_default() -> None:
    assert v4_prefill_attention.SWITCH.forced is None and not v4_prefill_attention.enabled(torch.zeros(1))
    seen = OpNames()
    with torch.inference_mode(), seen:
        v4_prefill_attention.prefill_attention(*inputs("hca", 4, 0, torch.float32), 0.125)
    assert "v4_prefill_attention" not in seen.names and "bmm" in seen.names


_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as v4_prefill_attention
from tests.engine.kernels.deepseek_v4.test_prefill_attention import CASES, D, inputs

kernel = v4_prefill_attention._triton_kernel()
assert kernel is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
scale = D**-0.5
# bf16: one rounding of outputs near 2 is 1.6e-2; the eager form rounds its scores to bf16 too.
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 4e-2)):
    for kind, count, start in CASES:
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in inputs(kind, count, start, dtype)]
        ref = v4_prefill_attention.reference(*args, scale)
        # The few-query default, the long-chunk blocking, and one head block against two.
        for config in ({}, dict(v4_prefill_attention.LAUNCH_CONFIG), {"block_h": 16, "block_n": 16}):
            out = kernel(*args, scale, **config)
            assert out.dtype == dtype and out.shape == ref.shape
            what = f"{kind} {count} {start} {dtype} {config}"
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=what)
        # The pad read from the device (a CUDA graph's prompt piece): the same numbers.
        pad_at = torch.tensor([args[2]], device=device)
        at = kernel(*args[:2], pad_at, *args[3:], scale)
        assert torch.equal(at, kernel(*args, scale)), (kind, count, start, dtype)
        assert torch.equal(v4_prefill_attention.reference(*args[:2], pad_at, *args[3:], scale), ref)
if device == "cuda":  # Flash's heads, head dim, window and picks (the interpreter is too slow for them)
    flash = (64, 512, 128, 512)
    for kind, rate in (("sliding", 4), ("hca", 16), ("csa", 4)):
        for start in (0, 700):
            args = inputs(kind, 200, start, torch.bfloat16, rate=rate, shape=flash)
            args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
            scale = 512**-0.5
            # Both against the float32 math on the same bf16 inputs: the kernel is no less exact than
            # the eager form (which rounds its scores to bf16).
            upcast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            exact = v4_prefill_attention.reference(*upcast, scale)
            eager = v4_prefill_attention.reference(*args, scale).float()
            out = kernel(*args, scale).float()
            assert out.isfinite().all()
            eager_error = float((eager - exact).norm() / exact.norm())
            error = float((out - exact).norm() / exact.norm())
            assert error < 1.5 * eager_error + 1e-3, (kind, start, error, eager_error)
print("triton ok")
"""


def test_the_triton_kernel_equals_the_eager_form() -> None:
    """Sliding, HCA and CSA chunks at position 0 (pad > 0), 3 (pad > 0, some ring rows) and 20
    (pad = 0), float32 and bf16. On CUDA the real kernel; without a GPU, Triton's interpreter."""
    stdout = run_triton_check(_TRITON_CHECK)
    assert "triton ok" in stdout


# --- in the model ----------------------------------------------------------------------------------

CHUNKS = (3, 13, 24)  # ends 3, 16, 40: pad > 0 at 0 and at 3, pad = 0 after; CSA rows past index_topk


def tiny_model(dtype: torch.dtype, device: str = "cpu") -> DeepseekV4Model:
    """make-tiny's DeepSeek-V4 geometry (every layer kind) with random weights, built in memory."""
    with torch.device("meta"):
        model = DeepseekV4Model(DeepseekV4Config.from_hf(TINY_CONFIG), dtype)
    model.materialize(torch.device(device))
    fill_random_(model, seed=5)
    model.finish_loading()
    model.allocate_cache(64)
    return model


def prefill(model: DeepseekV4Model, chunks: tuple[int, ...] = CHUNKS) -> torch.Tensor:
    ids = torch.randint(
        0, TINY_CONFIG["vocab_size"], (sum(chunks),), generator=torch.Generator().manual_seed(7)
    )
    parts, start = [], 0
    with torch.inference_mode():
        for size in chunks:
            parts.append(model.forward(ids[start : start + size].to(model.device), start, "all"))
            start += size
    return torch.cat(parts).float().cpu()


def test_the_model_through_the_op_equals_the_eager_model() -> None:
    """On the CPU with the op forced on (its body is the eager form there): one op per layer and
    chunk, the same logits."""
    model = tiny_model(torch.float32)
    eager = prefill(model)
    seen = OpNames()
    with v4_prefill_attention.SWITCH.force(True), seen:
        fused = prefill(model)
    assert seen.names.count("v4_prefill_attention") == len(CHUNKS) * TINY_CONFIG["num_hidden_layers"]
    assert "unfold" not in seen.names  # the eager windows were built inside the op only
    torch.testing.assert_close(fused, eager, rtol=0, atol=0)
    assert eager.std() > 0.01


_MODEL_CHECK = """
import torch
from ds4desk.engine.models.deepseek_v4 import attention as v4_attention
from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as v4_prefill_attention
from tests.engine.kernels.deepseek_v4.test_prefill_attention import prefill, tiny_model

kernel = v4_prefill_attention._triton_kernel()
assert kernel is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
calls = []

def through_the_kernel(*args):
    calls.append(args[3] is not None)
    return kernel(*args)

for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
    model = tiny_model(dtype, device)
    v4_prefill_attention.SWITCH.forced = False
    eager = prefill(model)
    v4_attention.prefill_attention = through_the_kernel
    fused = prefill(model)
    v4_attention.prefill_attention = v4_prefill_attention.prefill_attention
    error = float((fused - eager).norm() / eager.norm())
    assert error < bound, (dtype, error)
    print(dtype, error)
assert len(calls) == 2 * 3 * 4 and sum(calls) == 2 * 3 * 3  # 4 layers, 3 with compressed entries
print("model ok")
"""


def test_the_model_through_the_triton_kernel_equals_the_eager_model() -> None:
    """Chunked prefill (pad > 0 and pad = 0, sliding, CSA and HCA layers) with attention through the
    Triton kernel, float32 and bf16, against the eager model."""
    stdout = run_triton_check(_MODEL_CHECK)
    assert "model ok" in stdout
