"""DeepSeek-V4's one-token router and expert mix (models/v4_route.py): the eager form equals the
router math written out, the custom ops are one op each, and the Triton kernels (on CUDA, or
Triton's CPU interpreter) equal the eager form for hash- and score-routed layers."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import route as v4_route
from tests.engine.op_names import OpNames
from tests.engine.triton_check import run_triton_check


def written_out(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    token: int,
    k: int,
    scale: float,
) -> tuple[list[int], list[float]]:
    """Fact sheet: scores sqrt(softplus); hash layers take the table's row, the others the top k of
    score + bias; the picks' scores normalised to sum 1, times the scaling factor."""
    scores = [float(torch.tensor(z).double().exp().log1p().sqrt()) for z in logits[0].tolist()]
    if table is not None:
        chosen = table[token].tolist()
    else:
        assert bias is not None
        ranked = [s + float(b) for s, b in zip(scores, bias.tolist(), strict=True)]
        chosen = sorted(range(len(scores)), key=lambda e: -ranked[e])[:k]
    total = sum(scores[e] for e in chosen)
    return chosen, [scores[e] / total * scale for e in chosen]


def inputs(experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(1, experts, generator=gen)).to(torch.bfloat16)
    bias = 0.5 * torch.randn(experts, generator=gen)
    table = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(10)])
    return logits, bias, table


@pytest.mark.parametrize(("experts", "k"), [(8, 6), (256, 6), (16, 3)])
@pytest.mark.parametrize("hashed", [False, True])
def test_the_eager_router_equals_the_written_out_math(experts: int, k: int, hashed: bool) -> None:
    logits, bias, table = inputs(experts, k, seed=experts + k)
    chosen, weights = v4_route.reference_route(
        logits, None if hashed else bias, table if hashed else None, torch.tensor([7]), k, 1.5
    )
    want_chosen, want_weights = written_out(
        logits, None if hashed else bias, table if hashed else None, 7, k, 1.5
    )
    assert chosen.tolist() == want_chosen
    torch.testing.assert_close(
        weights.double(), torch.tensor(want_weights, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


def test_the_eager_mix_sums_the_weighted_picks() -> None:
    y = torch.randn(6, 40).to(torch.bfloat16)
    weights = torch.rand(6)
    want = sum(float(weights[i]) * y[i].double() for i in range(6))
    got = v4_route.reference_mix(weights, y)
    assert got.shape == (1, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[0].double(), want, rtol=1e-2, atol=1e-2)
    # Prefill's rows: weights [T, k] and the (token, slot)-ordered outputs [T k, D].
    rows = torch.rand(3, 2)
    many = v4_route.reference_mix(rows, y)
    assert many.shape == (3, 40)
    for t in range(3):
        want = rows[t, 0] * y[2 * t].double() + rows[t, 1] * y[2 * t + 1].double()
        torch.testing.assert_close(many[t].double(), want, rtol=1e-2, atol=1e-2)


def test_the_custom_ops_are_one_op_each() -> None:
    logits, bias, _ = inputs(8, 6, seed=1)
    seen = OpNames()
    with v4_route.SWITCH.force(True), torch.inference_mode(), seen:
        chosen, weights = v4_route.route(logits, bias, None, torch.tensor([0]), 6, 1.5)
        mixed = v4_route.mix(weights, torch.randn(6, 32))
    assert seen.names.count("v4_route") == 1 and seen.names.count("v4_mix") == 1
    assert "topk" not in seen.names and "softplus" not in seen.names
    want = v4_route.reference_route(logits, bias, None, torch.tensor([0]), 6, 1.5)
    assert torch.equal(chosen, want[0]) and torch.equal(weights, want[1])
    assert mixed.shape == (1, 32)


def test_the_router_lays_out_the_experts_input_in_passing() -> None:
    logits, bias, _ = inputs(16, 3, seed=4)
    x = torch.randn(1, 300).to(torch.bfloat16)
    order = torch.randperm(300)
    want = v4_route.reference_route(logits, bias, None, torch.tensor([0]), 3, 1.5)
    for forced in (True, False):
        x_read, seen = torch.full_like(x, float("nan")), OpNames()
        with v4_route.SWITCH.force(forced), torch.inference_mode(), seen:
            chosen, weights = v4_route.route(
                logits, bias, None, torch.tensor([0]), 3, 1.5, (x, order, x_read)
            )
        assert (
            torch.equal(x_read, x[:, order])
            and torch.equal(chosen, want[0])
            and torch.equal(weights, want[1])
        )
        assert ("index_select" in seen.names) != forced  # the custom op does it inside
    with pytest.raises(ValueError, match="reorder"):
        v4_route.route(logits, bias, None, torch.tensor([0]), 3, 1.5, (x, order[:-1], x_read))
    with pytest.raises(ValueError, match="contiguous"):
        v4_route.route(logits, bias, None, torch.tensor([0]), 3, 1.5, (x, order.int(), x_read))


def test_the_cpu_runs_the_eager_form_by_default() -> None:
    assert v4_route.SWITCH.forced is None and not v4_route.enabled(torch.zeros(1))


_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import route as v4_route
from tests.engine.kernels.deepseek_v4.test_route import inputs

kernels = v4_route._kernels()
assert kernels is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
cases = 0
for experts, k in ((8, 6), (256, 6), (16, 3), (64, 8)):
    logits, bias, table = (t.to(device) for t in inputs(experts, k, seed=experts * k))
    for hashed in (False, True):
        for token in (0, 9):
            at = torch.tensor([token], device=device)
            args = (None if hashed else bias, table if hashed else None, at, k, 1.5)
            chosen, weights = kernels.route(logits, *args)
            want_chosen, want_weights = v4_route.reference_route(logits, *args)
            assert chosen.tolist() == want_chosen.tolist(), (experts, k, hashed, chosen, want_chosen)
            torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
            # With the experts' input order written in passing (2,500 columns: a partial last block).
            x = torch.randn(1, 2500, device=device).to(torch.bfloat16)
            order = torch.randperm(2500, device=device)
            x_read = torch.full_like(x, float("nan"))
            again = kernels.route(logits, *args, x, order, x_read)
            assert torch.equal(again[0], chosen) and torch.equal(again[1], weights)
            assert torch.equal(x_read, x[:, order])
            cases += 1
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        y = torch.randn(k, 3000, device=device).to(dtype)  # a partial last block
        got = kernels.mix(weights, y)
        want = v4_route.reference_mix(weights, y).float()
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        rows = torch.rand(5, k, device=device)  # prefill: five tokens' picks
        y = torch.randn(5 * k, 3000, device=device).to(dtype)
        got = kernels.mix(rows, y)
        assert got.shape == (5, 3000)
        torch.testing.assert_close(got.float(), v4_route.reference_mix(rows, y).float(), rtol=tol, atol=tol)
        cases += 1
print("triton ok", cases)
"""


def test_the_triton_kernels_equal_the_eager_form() -> None:
    assert "triton ok 24" in run_triton_check(_TRITON_CHECK)
