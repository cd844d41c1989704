"""DeepSeek-V4's fused decode indexer pick (v4_decode_index): the reference is the model's former
math, the custom op is one op, bad arguments get a clear error, the Triton kernels (on CUDA, or
Triton's CPU interpreter) score as the reference does and select exactly the top k (ties: the first
entries), and the model's graphable steps through the op equal its eager steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import decode_index as v4_decode_index
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.models.deepseek_v4.test_graphable import Stepper, relative_error, step_op_names, tokens
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import source_from_folder
from tests.engine.triton_check import run_triton_check


def inputs(
    heads: int, dim: int, total: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, dim, generator=gen).to(dtype)
    keys = torch.randn(total, dim, generator=gen).to(dtype)
    weights = torch.randn(1, heads, generator=gen) / heads  # both signs: negative scores too
    return q, keys, weights


def scores_of(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, pos: int, rate: int
) -> torch.Tensor:
    """The reference's float32 scores [E] (the model's former lines, with its `ready` from steps)."""
    part = torch.relu_(torch.mm(q, keys.t()).float())
    steps = torch.arange(keys.shape[0] * rate, device=keys.device)
    ready = steps[rate - 1 :: rate]
    return torch.where(ready <= pos, torch.mm(weights, part), -math.inf).view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("total", "pos", "rate", "k"), [(40, 200, 4, 8), (30, 50, 4, 20)])
def test_the_reference_is_the_former_math(
    dtype: torch.dtype, total: int, pos: int, rate: int, k: int
) -> None:
    q, keys, weights = inputs(4, 16, total, dtype, seed=total)
    picks = v4_decode_index.reference(q, keys, weights, torch.tensor([pos]), rate, k)
    expected = scores_of(q, keys, weights, pos, rate).topk(k).indices
    assert picks.dtype == torch.int64 and torch.equal(picks, expected)


def test_the_reference_scales_the_projections_weights_as_the_model_did() -> None:
    """The model's former weights were the projection's output, cast to float32 and scaled
    (ops.index_weights); the reference takes the projection's output and the scale."""
    q, keys, _ = inputs(4, 16, 40, torch.bfloat16, seed=3)
    raw = (torch.randn(1, 4, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    scale = 4**-0.5 * 16**-0.5
    picks = v4_decode_index.reference(q, keys, raw, torch.tensor([120]), 4, 8, scale)
    expected = scores_of(q, keys, raw.float() * scale, 120, 4).topk(8).indices
    assert torch.equal(picks, expected)


def test_the_custom_op_is_one_op_with_the_reference_result() -> None:
    q, keys, weights = inputs(4, 16, 40, torch.bfloat16, seed=2)
    pos = torch.tensor([90])
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = v4_decode_index.decode_index(q, keys, weights, pos, 4, 8)
    assert seen.names == ["v4_decode_index"]
    assert torch.equal(ours, v4_decode_index.reference(q, keys, weights, pos, 4, 8))


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert v4_decode_index.SWITCH.forced is None
    assert not v4_decode_index.enabled(torch.zeros(1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"keys": torch.zeros(40, 8, dtype=torch.bfloat16)}, "keys must be"),
        ({"keys": torch.zeros(40, 16)}, "q's dtype"),
        ({"weights": torch.zeros(1, 3)}, "weights must be"),
        ({"weights": torch.zeros(1, 4, dtype=torch.int32)}, "weights must be"),
        ({"pos": torch.tensor([3], dtype=torch.int32)}, "pos"),
        ({"rate": 0}, "rate"),
        ({"k": 40}, "k"),
    ],
)
def test_bad_arguments_get_a_clear_error(change: dict, message: str) -> None:
    q, keys, weights = inputs(4, 16, 40, torch.bfloat16, seed=2)
    args = {"q": q, "keys": keys, "weights": weights, "pos": torch.tensor([90]), "rate": 4, "k": 8, **change}
    with pytest.raises(ValueError, match=message):
        v4_decode_index.decode_index(**args)


# --- the Triton kernels -----------------------------------------------------------------------------

_KERNEL_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import decode_index as v4_decode_index
from tests.engine.kernels.deepseek_v4.test_decode_index import inputs, scores_of, expected_picks

device = "cuda" if torch.cuda.is_available() else "cpu"
kernel = v4_decode_index._triton_kernel()
assert kernel is not None
# (heads, dim, entries, pos, rate, k): every entry visible; some hidden; fewer visible than k (hidden
# ones fill the picks); a block and head count that are no powers of two; Flash's shapes after 8k.
cases = [(4, 16, 40, 200, 4, 8), (3, 24, 100, 150, 4, 30), (2, 16, 50, 60, 4, 20)]
cases.append((64, 128, 2048, 8191, 4, 512))
for dtype, step in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)):
    for heads, dim, total, pos, rate, k in cases:
        q, keys, weights = (t.to(device) for t in inputs(heads, dim, total, dtype, seed=total))
        at = torch.tensor([pos], device=device)
        # The model's form: the projection's weights in q's dtype, the scale applied in the kernel.
        scale = 0.5 if dtype == torch.float32 else 0.25
        raw = (weights / scale).to(dtype)
        weights = raw.float() * scale
        picks = kernel(q, keys, raw, at, rate, k, scale)
        assert picks.dtype == torch.int64 and picks.shape == (k,)
        assert len(set(picks.tolist())) == k and 0 <= int(picks.min()) and int(picks.max()) < total
        # Scores equal the reference's to a product's rounding step, so a pick may swap with an entry
        # within that of the k-th largest score, never with one further below.
        ref = scores_of(q, keys, weights, pos, rate)
        products = (q.float() @ keys.float().t()).abs()
        bound = float((step * weights.abs().float() @ products).max()) + 1e-6
        kth = float(ref.topk(k).values[-1])
        assert float(ref[picks].min()) >= kth - bound or kth == float("-inf"), (dtype, total)
        visible = torch.isfinite(ref).nonzero().view(-1).tolist()
        if len(visible) <= k:  # every visible entry is picked
            assert set(visible) <= set(picks.tolist())

# The selection alone, on scores given to it: exactly the top k, ties broken by entry order.
scores_kernel, select_kernel = v4_decode_index._jit_kernels()
gen = torch.Generator().manual_seed(7)
for total, k in ((40, 8), (300, 100), (2048, 512)):
    distinct = torch.randn(total, generator=gen) * 10
    ties = torch.randint(-3, 4, (total,), generator=gen).float()  # heavy ties, -0.0 and 0.0 among them
    ties[::7] = -float("inf")
    ties[ties == 0] = -0.0
    for scores in (distinct, ties):
        scores = scores.to(device)
        for bits in (1, 2, 4):
            picks = torch.full((k,), -1, dtype=torch.int64, device=device)
            span = 1 << (total - 1).bit_length()
            select_kernel[(1,)](scores, picks, total, K=k, EP=span, BITS=bits, PDL=False)
            assert sorted(picks.tolist()) == expected_picks(scores, k), (total, k, bits)
print("triton ok")
"""


def expected_picks(scores: torch.Tensor, k: int) -> list[int]:
    """The k largest scores' entries, ties at the k-th value taken in entry order (sorted)."""
    order = sorted(range(scores.shape[0]), key=lambda e: (-float(scores[e]), e))
    return sorted(order[:k])


def test_the_triton_kernels_equal_the_reference() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


# --- the model's decode step ------------------------------------------------------------------------

# make_tiny: index_topk 6 at rate 4, so a span of 48 gives 12 candidate rows (past 6: the pick runs).
CONTEXT = 48


def model_pair(folder: Path, device: torch.device) -> tuple[ModelSource, list[DeepseekV4Model]]:
    """make_tiny's checkpoint in `folder` and two models of it, each with its own cache."""
    make_tiny("deepseek_v4", folder, seed=4)
    source = source_from_folder(folder)
    models = []
    for _ in range(2):
        model = load_model(source, device, torch.float32).model
        assert isinstance(model, DeepseekV4Model)
        model.allocate_cache(CONTEXT)
        models.append(model)
    return source, models


def fused_steps_equal_eager_steps(folder: Path, device: torch.device, prefill: int, stop: int) -> None:
    """Graphable steps with the op forced on for one model, off for the other, from the same prefill."""
    source, models = model_pair(folder, device)
    ids = tokens(source, stop, seed=17)
    with torch.inference_mode():
        steppers = []
        for model in models:
            model.forward(torch.tensor(ids[:prefill], device=device), 0, "none")
            steppers.append(Stepper(model))
        for pos in range(prefill, stop):
            with v4_decode_index.SWITCH.force(True):
                ours = steppers[0].step(ids[pos], pos, CONTEXT)
            with v4_decode_index.SWITCH.force(False):
                ref = steppers[1].step(ids[pos], pos, CONTEXT)
            # The same entries, attended in another order (entry order, not the top-k's).
            assert relative_error(ours, ref) < 1e-5, pos


def test_the_models_steps_through_the_op_equal_its_eager_steps(tmp_path: Path) -> None:
    """On the CPU the op's body is the reference: the wiring and arguments the model hands it."""
    fused_steps_equal_eager_steps(tmp_path, torch.device("cpu"), prefill=5, stop=CONTEXT)


def test_the_op_runs_once_a_csa_layer_with_fewer_ops(tmp_path: Path) -> None:
    source, models = model_pair(tmp_path, torch.device("cpu"))
    ids = tokens(source, 12, seed=19)
    recorded = step_op_names(models[0], models[1], v4_decode_index, ids, 3, 12, CONTEXT)
    # make_tiny: CSA, HCA, CSA layers after a sliding one.
    assert all(recorded[(True, pos)].count("v4_decode_index") == 2 for pos in range(3, 12))
    # The indexer's top-k went in both CSA layers (the routers' stay).
    assert recorded[(False, 3)].count("topk") - recorded[(True, 3)].count("topk") == 2
    assert len(recorded[(True, 3)]) < len(recorded[(False, 3)])


_MODEL_CHECK = """
import sys
from pathlib import Path
import torch
from ds4desk.engine.kernels.deepseek_v4 import decode_index as v4_decode_index
from tests.engine.kernels.deepseek_v4.test_decode_index import fused_steps_equal_eager_steps

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
v4_decode_index.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernels on CPU tensors
fused_steps_equal_eager_steps(Path(sys.argv[1]), device, prefill=5, stop=30)
print("model ok")
"""


def test_the_models_steps_through_the_triton_kernels_equal_its_eager_steps(tmp_path: Path) -> None:
    stdout = run_triton_check(_MODEL_CHECK.replace("sys.argv[1]", repr(str(tmp_path))))
    assert "model ok" in stdout
