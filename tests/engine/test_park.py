"""Park and unpark on the real embedded model: memory is really freed, the answers stay the same."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

from ds4desk.engine import Engine, ErrorCode, FinishReason, GenerateRequest, LoadRequest

PROMPT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine()
    assert engine.load(LoadRequest(context=512)).ok
    yield engine
    engine.close()


def weights_of(engine: Engine) -> weakref.ref:
    """A weak reference to the embedding matrix, taken on the engine thread's objects."""
    loaded = engine._loaded
    assert loaded is not None
    return weakref.ref(loaded.runtime.model.model.embed_tokens.weight)


def test_park_frees_weights_and_cache_and_unpark_answers_the_same(engine: Engine) -> None:
    before = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=10))
    weights = weights_of(engine)
    parked = engine.park("target")
    assert parked.ok and parked.parked and engine.parked
    # SmolLM2's weights as the file stores them (Q4_1 / Q8_0 blocks) and the float32 KV cache.
    assert parked.bytes == 96_576_768 + 30 * 2 * 3 * 64 * 512 * 4
    gc.collect()
    assert weights() is None  # nothing holds the weights any more: the allocator got them back
    assert engine.model_info is not None  # still the chosen model, shown as parked

    unparked = engine.unpark("target")
    assert unparked.ok and not unparked.parked and unparked.bytes == parked.bytes
    after = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=10))
    assert after.tokens == before.tokens and after.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_generate_unparks_by_default(engine: Engine) -> None:
    before = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=6))
    assert engine.park("all").parked
    again = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=6))
    assert again.ok and again.tokens == before.tokens and not engine.parked


def test_a_parked_model_can_refuse_to_generate() -> None:
    engine = Engine(unpark_on_generate=False)
    try:
        assert engine.load(LoadRequest(context=256)).ok
        assert engine.park().parked
        refused = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=4))
        assert refused.error is not None and refused.error.code == ErrorCode.MODEL_PARKED
        assert refused.finish_reason == FinishReason.ERROR
        assert engine.unpark().ok
        assert engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=4)).ok
    finally:
        engine.close()


def test_selectors(engine: Engine) -> None:
    draft = engine.park("draft")
    assert draft.ok and draft.bytes == 0 and not engine.parked  # no draft model: a no-op
    bad = engine.park("everything")
    assert bad.error is not None and bad.error.code == ErrorCode.BAD_REQUEST
    assert engine.park("").parked
    assert engine.park("all").bytes == 0  # already parked: nothing more to free
    assert engine.unpark("").ok and not engine.parked


def test_park_waits_for_a_running_answer_or_cancels_it(engine: Engine) -> None:
    started = threading.Event()
    request = GenerateRequest(raw_text="Once upon a time", max_new_tokens=40, stop_tokens=[])
    request.on_token = lambda _token: started.set()
    running = engine.submit_generate(request)
    started.wait(60)
    park = engine.submit_park("target")  # queued behind the answer: it waits
    assert running.result().finish_reason == FinishReason.LENGTH
    assert park.result().parked

    started.clear()
    request = GenerateRequest(raw_text="Once upon a time", max_new_tokens=400, stop_tokens=[])
    request.on_token = lambda _token: started.set()
    running = engine.submit_generate(request)  # unparks first, then runs
    started.wait(60)
    park = engine.submit_park("target", cancel_running=True)
    cancelled = running.result()
    assert cancelled.finish_reason == FinishReason.CANCELLED and len(cancelled.tokens) < 400
    assert park.result().parked


def test_idle_auto_park() -> None:
    engine = Engine(idle_park_after_s=0.3)
    try:
        assert engine.load(LoadRequest(context=256)).ok
        for _ in range(100):
            if engine.parked:
                break
            threading.Event().wait(0.05)
        assert engine.parked
        assert engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=3)).ok
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_park_gives_the_cuda_allocator_its_memory_back() -> None:
    engine = Engine()
    try:
        assert engine.load(LoadRequest(device="cuda", dtype="bfloat16", context=2048)).ok
        before = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=8))
        allocated = torch.cuda.memory_allocated()
        parked = engine.park("target")
        assert parked.ok and parked.bytes >= 269_000_000  # bf16 weights of 134.5M parameters
        assert torch.cuda.memory_allocated() <= allocated - parked.bytes
        # Nothing of the model is left: what remains is cuBLAS's workspace (32 MiB on Hopper), which
        # torch takes from the same allocator.
        assert torch.cuda.memory_allocated() < 40 * 2**20
        assert engine.unpark("target").ok
        after = engine.generate(GenerateRequest(messages=PROMPT, max_new_tokens=8))
        assert after.tokens == before.tokens
    finally:
        engine.close()


def test_an_engine_set_to_cancel_on_park() -> None:
    engine = Engine(park_cancels_running=True)
    try:
        assert engine.load(LoadRequest(context=512)).ok
        started = threading.Event()
        request = GenerateRequest(raw_text="Once upon a time", max_new_tokens=400, stop_tokens=[])
        request.on_token = lambda _token: started.set()
        running = engine.submit_generate(request)
        started.wait(60)
        park = engine.submit_park("all")
        assert running.result().finish_reason == FinishReason.CANCELLED
        assert park.result().parked
    finally:
        engine.close()
