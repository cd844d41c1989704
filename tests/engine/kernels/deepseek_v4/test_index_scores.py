"""DeepSeek-V4's fused lightning-indexer scores (v4_index_scores): the eager reference is the model's
former math exactly, the custom op is one op, bad arguments get a clear error, the Triton kernel (on
CUDA, or Triton's CPU interpreter) equals the reference, and a prefill through the op equals the
eager one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from ds4desk.engine.loader import load_model
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import source_from_folder
from tests.engine.triton_check import run_triton_check


def inputs(
    count: int, total: int, heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(count, heads, dim, generator=gen).to(dtype)
    keys = torch.randn(total, dim, generator=gen).to(dtype)
    weights = torch.randn(count, heads, generator=gen) / heads
    return q, keys, weights


def former_math(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, start: int, rate: int
) -> torch.Tensor:
    """deepseek_v4._index_select's scoring before the op, line for line (one head block)."""
    count, total = q.shape[0], keys.shape[0]
    scores = torch.zeros((count, total), dtype=torch.float32)
    part = torch.relu_(torch.matmul(q, keys.t()).float())
    scores.unsqueeze(1).baddbmm_(weights.unsqueeze(1), part)
    ready = ((torch.arange(start, start + count) + 1) // rate).unsqueeze(1)
    visible = torch.arange(total).unsqueeze(0) < ready
    return scores.masked_fill_(~visible, -math.inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("count", "total", "start", "rate"), [(7, 3, 5, 4), (20, 12, 0, 4), (9, 40, 300, 8)])
def test_the_reference_is_the_former_math_exactly(
    dtype: torch.dtype, count: int, total: int, start: int, rate: int
) -> None:
    q, keys, weights = inputs(count, total, 4, 16, dtype, seed=count)
    ours = v4_index_scores.reference(q, keys, weights, start, rate)
    assert torch.equal(ours, former_math(q, keys, weights, start, rate))
    assert torch.isinf(ours).any() or start + 1 >= rate * total  # some entry is still hidden


def test_the_custom_op_is_one_op_with_the_reference_result() -> None:
    q, keys, weights = inputs(10, 6, 4, 16, torch.bfloat16, seed=2)
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = v4_index_scores.index_scores(q, keys, weights, 8, 4)
    assert seen.names == ["v4_index_scores"]
    assert torch.equal(ours, v4_index_scores.reference(q, keys, weights, 8, 4))


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert v4_index_scores.SWITCH.forced is None
    assert not v4_index_scores.enabled(torch.zeros(1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"keys": torch.zeros(6, 8)}, "keys must be"),
        ({"keys": torch.zeros(6, 16)}, "q's dtype"),
        ({"weights": torch.zeros(10, 3)}, "weights must be"),
        ({"weights": torch.zeros(10, 4, dtype=torch.bfloat16)}, "weights must be"),
        ({"rate": 0}, "rate"),
    ],
)
def test_bad_arguments_get_a_clear_error(change: dict, message: str) -> None:
    q, keys, weights = inputs(10, 6, 4, 16, torch.bfloat16, seed=2)
    args = {"q": q, "keys": keys, "weights": weights, "start": 0, "rate": 4, **change}
    with pytest.raises(ValueError, match=message):
        v4_index_scores.index_scores(**args)


# --- the Triton kernel ------------------------------------------------------------------------------

_KERNEL_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from tests.engine.kernels.deepseek_v4.test_index_scores import inputs

device = "cuda" if torch.cuda.is_available() else "cpu"
kernel = v4_index_scores._triton_kernel()
assert kernel is not None
# (tokens, entries, heads, dim, start, rate): partial blocks both ways and a dim that is no power of
# two; a first chunk whose later entry blocks no query sees (skipped); Flash's indexer (64 x 128).
cases = [(5, 3, 4, 16, 11, 4), (70, 150, 3, 24, 37, 4), (20, 200, 2, 16, 0, 1), (40, 64, 64, 128, 230, 4)]
# Both round each head's product to the input dtype, but from sums taken in another order: a product
# may land one rounding step apart (2^-7 of it in bf16), so the bound is that step on Σ_h |w_h s_h|.
for dtype, step in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)):
    for count, total, heads, dim, start, rate in cases:
        q, keys, weights = (t.to(device) for t in inputs(count, total, heads, dim, dtype, seed=count))
        ours = kernel(q, keys, weights, start, rate)
        ref = v4_index_scores.reference(q, keys, weights, start, rate)
        assert ours.dtype == torch.float32 and ours.shape == (count, total)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))  # the same entries hidden
        finite = torch.isfinite(ref)
        assert finite.any()
        products = torch.einsum("thd,ed->the", q.float(), keys.float()).abs()
        bound = step * torch.einsum("th,the->te", weights.abs(), products) + 1e-6
        assert bool(((ours - ref).abs()[finite] <= bound[finite]).all()), (dtype, count, total)
        assert not torch.equal(ours[finite], torch.zeros_like(ours[finite]))
print("triton ok")
"""


def test_the_triton_kernel_equals_the_reference() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


# --- the model's prefill ----------------------------------------------------------------------------


def prefill(folder: Path, fused: bool | None, device: str = "cpu") -> torch.Tensor:
    """All logits of a 40-token prompt in chunks of 16 with the op forced on (True) or off (False)."""
    model = load_model(source_from_folder(folder), torch.device(device), torch.float32).model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(64)
    ids = torch.tensor([(5 * i + 2) % 50 for i in range(40)], device=device)
    with v4_index_scores.SWITCH.force(fused), torch.inference_mode():
        return torch.cat([model.forward(ids[s : s + 16], s, "all") for s in range(0, 40, 16)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_v4")
    make_tiny("deepseek_v4", folder, seed=6)
    return folder


def test_the_models_prefill_through_the_op_equals_the_eager_one(tiny: Path) -> None:
    """On the CPU the op's body is the reference: the wiring, arguments and dtypes the model hands it."""
    eager = prefill(tiny, False)
    seen = OpNames()
    with seen:
        fused = prefill(tiny, True)
    # The chunks ending at 32 and 40 (8 and 10 entries at rate 4) x 2 CSA layers: the first chunk's
    # 4 entries are no more than index_topk (6), so its queries attend to all of them unscored.
    assert seen.names.count("v4_index_scores") == 2 * 2
    assert torch.equal(fused, eager)


def test_the_models_prefill_through_the_kernel_equals_the_eager_one(tiny: Path) -> None:
    script = f"""
import pathlib, torch
from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from tests.engine.kernels.deepseek_v4.test_index_scores import prefill

folder = pathlib.Path({str(tiny)!r})
device = "cuda" if torch.cuda.is_available() else "cpu"
eager = prefill(folder, False, device)
v4_index_scores.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernel on CPU tensors
torch.testing.assert_close(prefill(folder, True, device), eager, rtol=1e-4, atol=1e-4)
print("prefill ok")
"""
    assert "prefill ok" in run_triton_check(script)
