"""The engine thread and its asyncio client on the real embedded model (SmolLM2-135M, CPU, float32)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds4desk.engine import (
    Engine,
    EngineClient,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    LoadRequest,
    TextDelta,
)
from ds4desk.engine.client import _DeltaBatcher

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine()
    loaded = engine.load(LoadRequest(context=1024, chunk=64))
    assert loaded.ok, loaded.error
    yield engine
    engine.close()


def test_load_reports_the_model(engine: Engine) -> None:
    info = engine.model_info
    assert info is not None
    assert info.family == "llama"
    assert info.architecture == "LlamaForCausalLM"
    assert info.dtype == "float32" and info.device == "cpu"
    assert 130e6 < info.parameters < 140e6
    assert info.has_chat_template
    assert info.path.endswith(".gguf")


def test_generate_streams_every_token_and_fills_the_result(engine: Engine) -> None:
    seen: list[int] = []
    pieces: list[str] = []
    request = GenerateRequest(messages=CHAT, max_new_tokens=24, on_token=seen.append)
    result = engine.generate(request, lambda _token, text: pieces.append(text))
    assert result.ok, result.error
    assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert seen == result.tokens and len(result.tokens) == len(result.logprobs) > 0
    assert "".join(pieces) == result.text and result.text.strip()
    assert all(lp <= 0.0 for lp in result.logprobs)
    stats = result.stats
    assert stats.prompt_tokens == len(result.prompt_tokens) > 10
    assert stats.time_to_first_token_s > 0 and stats.prefill_tok_s > 0
    assert stats.generated_tokens >= len(result.tokens)


def test_greedy_is_deterministic_and_chunk_independent(engine: Engine) -> None:
    first = engine.generate(GenerateRequest(messages=CHAT, max_new_tokens=12))
    second = engine.generate(GenerateRequest(messages=CHAT, max_new_tokens=12))
    assert first.tokens == second.tokens  # nothing of one request leaks into the next
    other = Engine()
    try:
        assert other.load(LoadRequest(context=1024, chunk=7)).ok
        chunked = other.generate(GenerateRequest(messages=CHAT, max_new_tokens=12))
    finally:
        other.close()
    assert chunked.tokens == first.tokens


def test_cancel_between_decode_steps_keeps_partial_output(engine: Engine) -> None:
    request = GenerateRequest(raw_text="Once upon a time", max_new_tokens=200, stop_tokens=[])
    tokens: list[int] = []

    def on_token(token: int) -> None:
        tokens.append(token)
        if len(tokens) == 5:
            engine.cancel(request.request_id)

    request.on_token = on_token
    result = engine.generate(request)
    assert result.finish_reason == FinishReason.CANCELLED
    assert 5 <= len(result.tokens) < 200
    assert result.tokens == tokens[: len(result.tokens)]


def test_structured_errors_never_raise(engine: Engine) -> None:
    both = engine.generate(GenerateRequest(raw_text="hi", prompt_tokens=[1, 2]))
    assert both.error is not None and both.error.code == ErrorCode.BAD_REQUEST
    assert both.finish_reason == FinishReason.ERROR
    out_of_range = engine.generate(GenerateRequest(prompt_tokens=[1, 10**9]))
    assert out_of_range.error is not None and out_of_range.error.code == ErrorCode.BAD_REQUEST
    overflow = engine.generate(GenerateRequest(prompt_tokens=[1] * 1000, max_new_tokens=100))
    assert overflow.error is not None and overflow.error.code == ErrorCode.CONTEXT_OVERFLOW
    fresh = Engine()
    try:
        missing = fresh.generate(GenerateRequest(raw_text="hi"))
    finally:
        fresh.close()
    assert missing.error is not None and missing.error.code == ErrorCode.MODEL_NOT_LOADED


def test_a_bad_file_keeps_the_loaded_model(engine: Engine, tmp_path: Path) -> None:
    junk = tmp_path / "holiday.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    before = engine.model_info
    loaded = engine.load(LoadRequest(path=str(junk), context=1024, chunk=64))
    assert not loaded.ok and loaded.error is not None
    assert loaded.error.code == ErrorCode.LOAD_FAILED
    assert "holiday.png" in loaded.error.detail
    assert engine.model_info == before
    assert engine.generate(GenerateRequest(raw_text="Hello", max_new_tokens=3)).ok


def test_client_batches_deltas_on_the_loop(engine: Engine) -> None:
    client = EngineClient(engine, updates_per_second=20)
    deltas: list[TextDelta] = []
    loop_threads: set[int] = set()

    def on_delta(delta: TextDelta) -> None:
        loop_threads.add(threading.get_ident())
        deltas.append(delta)

    async def run() -> object:
        return await client.generate(
            GenerateRequest(raw_text="The history of the bicycle", max_new_tokens=40, stop_tokens=[]),
            on_delta,
        )

    result = asyncio.run(run())
    assert result.ok and len(result.tokens) == 40
    assert loop_threads == {threading.get_ident()}  # delivered on the loop's thread
    assert [t for d in deltas for t in d.tokens] == result.tokens
    assert "".join(d.text for d in deltas) == result.text


def test_batcher_delivers_at_most_its_rate() -> None:
    """A burst of tokens from another thread reaches the loop in a few batches, in order, complete."""
    rate = 40.0
    deltas: list[TextDelta] = []

    async def run() -> float:
        loop = asyncio.get_running_loop()
        batcher = _DeltaBatcher(loop, 1, deltas.append, 1 / rate)
        started = loop.time()

        def produce() -> None:
            for token in range(500):
                batcher.push(token, f"<{token}>")

        producer = threading.Thread(target=produce)
        producer.start()
        while producer.is_alive():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.1)
        batcher.flush()
        return loop.time() - started

    elapsed = asyncio.run(run())
    assert [t for d in deltas for t in d.tokens] == list(range(500))
    assert "".join(d.text for d in deltas) == "".join(f"<{t}>" for t in range(500))
    assert len(deltas) <= 2 + elapsed * rate  # never one callback per token
