"""Everything around the decode loop keeps working with speculation on for DeepSeek-V4 (its ring,
compressors and compressed rows rolled back after every rejection): max_tokens, stop tokens,
cancel, snapshots (after the answer and inside the prompt, the state itself compared), the
thinking budget's forced close, seeded sampling. The cases are test_runtime_features.py's, run
here on tiny V4 models with a draft that mostly does not agree (another V4) and prompt lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.runtime import Runtime
from tests.engine.speculative.test_runtime_features import (
    test_a_snapshot_after_the_answer_holds_the_same_state,
    test_a_snapshot_inside_the_prompt,
    test_a_stop_token_ends_the_answer_where_it_would_without_speculation,
    test_cancel_stops_at_the_same_token,
    test_max_tokens_is_never_passed,
    test_sampled_runs_are_reproducible_with_a_seed,
    test_the_thinking_budget_forces_its_close_exactly,
)
from tests.engine.speculative.tiny_pairs import runtime
from tests.engine.speculative.tiny_v4_mtp import load_v4, save_tiny_v4_with_mtp

__all__ = [
    "test_a_snapshot_after_the_answer_holds_the_same_state",
    "test_a_snapshot_inside_the_prompt",
    "test_a_stop_token_ends_the_answer_where_it_would_without_speculation",
    "test_cancel_stops_at_the_same_token",
    "test_max_tokens_is_never_passed",
    "test_sampled_runs_are_reproducible_with_a_seed",
    "test_the_thinking_budget_forces_its_close_exactly",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CausalLM]:
    root: Path = tmp_path_factory.mktemp("v4-features")
    target = save_tiny_v4_with_mtp(root / "target", seed=4, template_layer=None)
    return {
        "target": load_v4(target),
        "other": load_v4(save_tiny_v4_with_mtp(root / "other", seed=14, template_layer=None)),
    }


# The always-agreeing draft is covered on the dense families; here the cases that roll back.
@pytest.fixture(params=["other", "lookup"])
def setup(request: pytest.FixtureRequest, models: dict[str, CausalLM]) -> tuple[Runtime, str]:
    """(runtime, mode): a draft model that mostly does not agree, or prompt lookup."""
    if request.param == "lookup":
        return runtime(models["target"]), "lookup"
    return runtime(models["target"], models[request.param]), "draft"
