"""Picking a token from a row of logits (engine/sampling.py): the token and its log-probability under
the raw logits, with no read back to the host on the way (on a GPU each read waits for the device in
the middle of the launches that follow a forward)."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.sampling import make_generator, sample
from tests.engine.op_names import OpNames


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(1.0, top_k=5, seed=3)])
def test_a_pick_and_its_logprob_stay_on_the_device(params: SamplingParams) -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 3
    seen = OpNames()
    with seen:
        token, logprob = sample(logits, params, make_generator(params, logits.device))
    assert "_local_scalar_dense" not in seen.names, seen.names  # what .item() and x[0-d tensor] run
    assert token.dim() == 0 and logprob.dim() == 0
    if params.greedy:
        assert int(token) == int(torch.argmax(logits))
    assert float(logprob) == pytest.approx(float(torch.log_softmax(logits, dim=0)[int(token)]), abs=1e-6)
