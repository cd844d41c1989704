"""The load's warm-up stage (engine/warm_up.py) on real models: the real SmolLM2 through the real
engine thread, tiny Gemma 3 + Llama draft and tiny DeepSeek-V4 checkpoints. The warm-up is shown as
its own load stage, is inside the load's time, changes no answer (greedy, speculative, sampled,
logprobs, a follow-up from a snapshot), writes no snapshot slot, and can be cancelled."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ds4desk.engine import Engine, ErrorCode, GenerateRequest, LoadRequest, SamplingParams
from ds4desk.engine import warm_up as warm_up_module
from ds4desk.engine.api import WARM_UP_UNIT, LoadResult, SaveSnapshot
from ds4desk.engine.loader import load_model
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.warm_up import WarmUpSizes, warm_up
from tests.engine.models.gemma3 import tiny as gemma3_tiny
from tests.engine.tiny_dense import save_tiny

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
# Past one 64-token chunk, so the prefill runs in several chunks.
LONG = "The quick brown fox jumps over the lazy dog. " * 12
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234)


def requests() -> list[GenerateRequest]:
    """What a first request may be: each takes another path through the runtime."""
    return [
        GenerateRequest(messages=CHAT, max_new_tokens=12),  # greedy, prompt lookup ("auto")
        GenerateRequest(messages=CHAT, max_new_tokens=12, speculative="off"),
        GenerateRequest(raw_text=LONG, max_new_tokens=10, stop_tokens=[]),  # several prefill chunks
        GenerateRequest(messages=CHAT, max_new_tokens=10, sampling=SAMPLED, top_logprobs=3),
    ]


def same_answer(a, b) -> None:  # type: ignore[no-untyped-def]
    assert a.ok and b.ok, (a.error, b.error)
    assert a.tokens == b.tokens and len(a.tokens) > 0
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert a.stats.reused_tokens == b.stats.reused_tokens


def slot_keys(engine: Engine) -> list[tuple[object, ...]]:
    """The slots as listed, without their ages (which tick)."""
    return [(s.slot, s.tokens, s.bytes, s.hits, s.pinned, s.tag) for s in engine.slots().slots]


def load_recorded(engine: Engine, request: LoadRequest) -> tuple[LoadResult, list[tuple[int, int, str]]]:
    seen: list[tuple[int, int, str]] = []
    result = engine.load(request, lambda done, total, unit: seen.append((done, total, unit)))
    return result, seen


@dataclass(slots=True)
class Pair:
    warm: Engine
    cold: Engine
    loaded: LoadResult  # the warm engine's load
    progress: list[tuple[int, int, str]]  # what it reported


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """SmolLM2 loaded twice: with the warm-up (the default) and without."""
    warm, cold = Engine(), Engine()
    try:
        loaded, seen = load_recorded(warm, LoadRequest(context=1024, chunk=64))
        assert loaded.ok, loaded.error
        assert warm.slots().slots == []  # the warm-up's requests wrote no snapshot slot
        assert cold.load(LoadRequest(context=1024, chunk=64, warm_up=False)).ok
        yield Pair(warm, cold, loaded, seen)
    finally:
        warm.close()
        cold.close()


def test_warm_up_is_the_last_load_stage_and_inside_the_load_time(pair: Pair) -> None:
    seen, loaded = pair.progress, pair.loaded
    units = [unit for _, _, unit in seen]
    first_warm = units.index(WARM_UP_UNIT)
    assert set(units[:first_warm]) == {"tensors"} and set(units[first_warm:]) == {WARM_UP_UNIT}
    stage = [(done, total) for done, total, unit in seen if unit == WARM_UP_UNIT]
    total = stage[0][1]
    assert total >= 3 and all(t == total for _, t in stage)
    assert [done for done, _ in stage] == list(range(total + 1))  # 0 first, then each step once
    assert 0 < loaded.warm_up_seconds < loaded.seconds


def test_a_load_without_warm_up_has_no_such_stage() -> None:
    engine = Engine()
    try:
        loaded, seen = load_recorded(engine, LoadRequest(context=256, warm_up=False))
        assert loaded.ok and loaded.warm_up_seconds == 0.0
        assert {unit for _, _, unit in seen} == {"tensors"}
    finally:
        engine.close()


@pytest.mark.parametrize("index", range(len(requests())))
def test_first_answers_are_the_same_with_and_without_warm_up(pair: Pair, index: int) -> None:
    warm, cold = pair.warm, pair.cold
    same_answer(warm.generate(requests()[index]), cold.generate(requests()[index]))


def test_a_follow_up_from_a_snapshot_is_the_same(pair: Pair) -> None:
    warm, cold = pair.warm, pair.cold
    answers = []
    for engine in (warm, cold):
        first = engine.generate(
            GenerateRequest(messages=CHAT, max_new_tokens=8, save_snapshot=SaveSnapshot(tag="c"))
        )
        assert first.ok and first.snapshot_slot is not None
        follow = [
            *CHAT,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And two more?"},
        ]
        second = engine.generate(GenerateRequest(messages=follow, max_new_tokens=8))
        assert second.stats.reused_tokens > 0  # it continued from the snapshot
        answers.append((first, second))
    same_answer(answers[0][0], answers[1][0])
    same_answer(answers[0][1], answers[1][1])


def test_cancelling_during_the_warm_up_keeps_the_previous_model(pair: Pair) -> None:
    warm = pair.warm
    before = warm.generate(GenerateRequest(messages=CHAT, max_new_tokens=6, speculative="off"))

    def cancel_in_warm_up(done: int, _total: int, unit: str) -> None:
        if unit == WARM_UP_UNIT and done == 1:
            warm.cancel_load()

    result = warm.load(LoadRequest(context=512, chunk=32), cancel_in_warm_up)
    assert result.error is not None and result.error.code == ErrorCode.CANCELLED
    info = warm.model_info
    assert info is not None and info.context == 1024  # the model loaded before stays
    after = warm.generate(GenerateRequest(messages=CHAT, max_new_tokens=6, speculative="off"))
    same_answer(before, after)


def test_cancelling_the_only_load_during_its_warm_up_leaves_no_model() -> None:
    engine = Engine()
    try:

        def cancel_in_warm_up(done: int, _total: int, unit: str) -> None:
            if unit == WARM_UP_UNIT and done == 0:
                engine.cancel_load()

        result = engine.load(LoadRequest(context=256), cancel_in_warm_up)
        assert result.error is not None and result.error.code == ErrorCode.CANCELLED
        assert engine.model_info is None
        refused = engine.generate(GenerateRequest(messages=CHAT, max_new_tokens=2))
        assert refused.error is not None and refused.error.code == ErrorCode.MODEL_NOT_LOADED
    finally:
        engine.close()


def test_unpark_warms_up_but_a_request_that_unparks_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[int] = []
    real = warm_up_module.warm_up

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        runs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(warm_up_module, "warm_up", counted)
    engine = Engine()
    try:
        assert engine.load(LoadRequest(context=256)).ok
        first = engine.generate(
            GenerateRequest(messages=CHAT, max_new_tokens=6, save_snapshot=SaveSnapshot(tag="t"))
        )
        slots = slot_keys(engine)
        assert len(runs) == 1 and len(slots) == 1
        assert engine.park().parked and engine.unpark().ok
        assert len(runs) == 2  # Unpark: the next answer is as fast as the one before the park
        assert slot_keys(engine) == slots  # nothing added, nothing restored, nothing refreshed
        assert engine.park().parked
        again = engine.generate(GenerateRequest(messages=CHAT, max_new_tokens=6))
        assert len(runs) == 2  # the request that unparked is the warm-up
        same_answer(first, again)
        assert len(slot_keys(engine)) == 1
    finally:
        engine.close()


# ---- tiny checkpoints: a draft model, DeepSeek-V4 -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("warm-up")
    gemma3_tiny.save_tiny(root / "target", "tiny", seed=1)
    save_tiny("llama", root / "draft", seed=23, vocab_size=300)  # Gemma's tiny vocabulary
    make_tiny("deepseek_v4", root / "v4", seed=3)
    return {"target": root / "target", "draft": root / "draft", "v4": root / "v4"}


def answers_of(request: LoadRequest, prompts: list[list[int]]) -> tuple[list, Engine]:  # type: ignore[type-arg]
    engine = Engine()
    loaded = engine.load(request)
    assert loaded.ok, loaded.error
    out = []
    for prompt in prompts:
        for sampling in (SamplingParams(), SAMPLED):
            ask = GenerateRequest(prompt_tokens=prompt, sampling=sampling, max_new_tokens=16, stop_tokens=[])
            out.append(engine.generate(ask))
    return out, engine


def test_a_draft_model_answers_the_same_and_forgets_the_warm_up(tiny_folders: dict[str, Path]) -> None:
    prompts = [[*range(40, 60), *range(40, 60), 7, 8], [(i * 37 + 11) % 200 + 3 for i in range(30)]]
    base = LoadRequest(
        path=str(tiny_folders["target"]), context=128, chunk=16, draft=str(tiny_folders["draft"])
    )
    warm, warm_engine = answers_of(base, prompts)
    cold, cold_engine = answers_of(LoadRequest(**{**_fields(base), "warm_up": False}), prompts)
    try:
        assert warm[0].stats.speculative == "draft" and warm[0].stats.drafted_tokens > 0
        for a, b in zip(warm, cold, strict=True):
            same_answer(a, b)
        reloaded = warm_engine.load(base)  # a fresh warm-up, read before any request
        assert reloaded.ok
        loaded = warm_engine._loaded
        assert loaded is not None and loaded.runtime.draft is not None
        assert loaded.runtime.draft.fed == []
    finally:
        warm_engine.close()
        cold_engine.close()


def test_deepseek_v4_answers_the_same_with_and_without_warm_up(tiny_folders: dict[str, Path]) -> None:
    prompts = [[5, 6, 7, 8, 9, 10] * 5, list(range(3, 40))]
    base = LoadRequest(path=str(tiny_folders["v4"]), context=256, chunk=16)
    warm, warm_engine = answers_of(base, prompts)
    cold, cold_engine = answers_of(LoadRequest(**{**_fields(base), "warm_up": False}), prompts)
    warm_engine.close()
    cold_engine.close()
    for a, b in zip(warm, cold, strict=True):
        same_answer(a, b)


def _fields(request: LoadRequest) -> dict[str, object]:
    return {name: getattr(request, name) for name in request.__slots__}  # type: ignore[attr-defined]


# ---- the runtime on its own: any context fits ------------------------------------------------------


@pytest.mark.parametrize(("context", "chunk"), [(2, 1), (16, 4), (64, 64)])
def test_the_warm_up_fits_any_context_and_leaves_the_answer_alone(
    tmp_path: Path, context: int, chunk: int
) -> None:
    _, source = save_tiny("llama", tmp_path / "llama", seed=5)
    cpu = torch.device("cpu")
    model = load_model(source, cpu, torch.float32).model
    sizes = WarmUpSizes.for_runtime(Runtime(model, cpu, context=context, chunk=chunk))
    assert sizes.prompt + sizes.answer <= context and sizes.split_prompt <= context
    assert 0 < sizes.split_at < max(2, sizes.split_prompt)
    prompt = [3, 1, 4, 1, 5][: context - 1]
    fresh = Runtime(load_model(source, cpu, torch.float32).model, cpu, context=context, chunk=chunk)
    expected = fresh.generate(
        prompt, SamplingParams(), context - len(prompt), set(), lambda _t: None, lambda: False
    )
    runtime = Runtime(model, cpu, context=context, chunk=chunk)
    ticks: list[tuple[int, int]] = []
    report = warm_up(runtime, "auto", lambda: False, lambda done, total: ticks.append((done, total)))
    assert report.failed == "" and report.steps == 3 and ticks[-1] == (3, 3)
    got = runtime.generate(
        prompt, SamplingParams(), context - len(prompt), set(), lambda _t: None, lambda: False
    )
    assert got.tokens == expected.tokens and got.logprobs == pytest.approx(expected.logprobs, abs=1e-6)


# ---- CUDA: the graph capture is part of the stage ---------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_graph_capture_is_a_warm_up_step_and_answers_match() -> None:
    from ds4desk.engine.graphs import span_buckets

    warm, cold = Engine(), Engine()
    try:
        loaded, seen = load_recorded(warm, LoadRequest(device="cuda", dtype="bfloat16", context=1024))
        assert loaded.ok, loaded.error
        total = next(t for _, t, unit in seen if unit == WARM_UP_UNIT)
        assert total == len(span_buckets(1024)) + 4  # the row buckets' step too
        runtime = warm._loaded.runtime  # type: ignore[union-attr]
        assert runtime.graphs is not None and not runtime.graphs_pending
        assert cold.load(LoadRequest(device="cuda", dtype="bfloat16", context=1024, warm_up=False)).ok
        for request in requests():
            same_answer(warm.generate(request), cold.generate(request))
    finally:
        warm.close()
        cold.close()
