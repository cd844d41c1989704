"""A Qwen3.5 MoE folder as the app meets it: the engine's greedy tokens against transformers'
generate, a snapshot restored and continued against an uninterrupted run (the runtime and the
engine's chat follow-up), and `ds4desk check` on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds4desk.engine import Engine, GenerateRequest, LoadRequest
from ds4desk.engine.api import FinishReason, SamplingParams, SaveSnapshot
from ds4desk.engine.loader import load_model
from ds4desk.engine.preflight import check_model
from ds4desk.engine.runtime import RunOutcome, Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore, state_layout
from tests.engine.models.qwen3_5.tiny import SPECIAL, TINY_MOE, save_tiny_moe
from tests.engine.tiny_dense import source_from_folder

CPU = torch.device("cpu")
CONTEXT = 128
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(60)]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
IDS = {name: i for i, name in enumerate(SPECIAL)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("qwen3_5_moe-folder")
    hf, _ = save_tiny_moe(folder, seed=11)
    return hf, folder


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine()
    yield engine
    engine.close()


def greedy_reference(hf: torch.nn.Module, ids: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_engine_greedy_generation_matches_transformers(saved, engine: Engine) -> None:
    hf, folder = saved
    ids = [(i * 53 + 7) % 290 + 5 for i in range(37)]
    loaded = engine.load(LoadRequest(path=str(folder), device="cpu", dtype="float32", context=256, chunk=16))
    assert loaded.ok and loaded.info is not None
    assert (loaded.info.family, loaded.info.architecture) == ("qwen3_5", "Qwen3_5MoeForCausalLM")
    result = engine.generate(
        GenerateRequest(prompt_tokens=ids, sampling=SamplingParams(), max_new_tokens=20, stop_tokens=[])
    )
    assert result.ok and result.finish_reason == FinishReason.LENGTH
    assert result.tokens == greedy_reference(hf, ids, 20)


def run(
    rt: Runtime, prompt: list[int], store: SnapshotStore | None = None, save: SaveSnapshot | None = None
) -> RunOutcome:
    return rt.generate(prompt, SAMPLED, 12, set(), lambda _t: None, lambda: False, None, store, True, save)


@pytest.mark.parametrize(("chunk", "at"), [(1, 13), (8, 13), (8, 40)])
def test_restore_then_continue_equals_an_uninterrupted_run(saved, chunk: int, at: int) -> None:
    """Sampled (so every logit matters, not just the top one): the snapshot's state continued
    gives the tokens and log-probabilities of a run that never stopped."""
    _, folder = saved
    model = load_model(source_from_folder(folder), CPU, torch.float32).model
    rt = Runtime(model, CPU, context=CONTEXT, chunk=chunk)
    identity = ModelIdentity(
        "tiny-qwen3_5_moe", "float32", CONTEXT, state_layout(rt.model, CONTEXT), TINY_MOE["vocab_size"]
    )
    store = SnapshotStore(identity)
    first = run(rt, PROMPT[:45], store, SaveSnapshot(at=at))
    assert first.snapshot_slot is not None and store.get(first.snapshot_slot).tokens == tuple(PROMPT[:at])
    restored = run(rt, PROMPT, store)
    uninterrupted = run(rt, PROMPT)
    assert (restored.stats.reused_tokens, restored.stats.prefill_tokens) == (at, len(PROMPT) - at)
    assert restored.tokens == uninterrupted.tokens
    # Restoring moves the prefill chunk edges: float32 sums in another order, a few 1e-6 apart.
    assert restored.logprobs == pytest.approx(uninterrupted.logprobs, rel=1e-5, abs=1e-5)


def test_a_chat_follow_up_from_the_snapshot_equals_a_cold_run(saved, engine: Engine) -> None:
    _, folder = saved
    assert engine.load(LoadRequest(path=str(folder), device="cpu", dtype="float32", context=256)).ok
    ids = [(i * 29 + 5) % 290 + 5 for i in range(24)]
    first = engine.generate(
        GenerateRequest(prompt_tokens=ids, max_new_tokens=8, stop_tokens=[], save_snapshot=SaveSnapshot())
    )
    assert first.ok and first.snapshot_slot is not None
    prompt = [*first.prompt_tokens, *first.tokens[:-1]]
    tokens = [*prompt, IDS["<|im_end|>"], 10, 11, 12]
    warm = engine.generate(GenerateRequest(prompt_tokens=tokens, max_new_tokens=6, stop_tokens=[]))
    cold = engine.generate(
        GenerateRequest(prompt_tokens=tokens, max_new_tokens=6, stop_tokens=[], use_snapshots=False)
    )
    assert warm.stats.reused_tokens == len(prompt) and warm.stats.prefill_tokens == 4
    assert cold.stats.reused_tokens == 0 and warm.tokens == cold.tokens


def test_ds4desk_check_reports_the_family_and_the_parameters(saved) -> None:
    hf, folder = saved
    report = check_model(folder, device="cpu")
    assert (report.family, report.architecture) == ("qwen3_5", "Qwen3_5MoeForCausalLM")
    # Every expert counts (the stored parameters, not the active ones): transformers' own count.
    assert report.parameters == hf.num_parameters()
    # Stored as three weights an expert; transformers holds two fused tensors a layer.
    layers, experts = TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts"]
    assert report.tensor_count == len(hf.state_dict()) - 2 * layers + 3 * experts * layers
    text = report.describe()
    assert "Qwen3_5MoeForCausalLM (qwen3_5 family)" in text
    assert report.context_length == TINY_MOE["max_position_embeddings"]
