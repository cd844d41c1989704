"""RemoteEngine against a real `ds4desk serve` (uvicorn in this process, the embedded SmolLM2 on the
CPU): the same greedy answer as the engine behind it gives directly, streamed in pieces, with usage
and timings; Stop cancels on the server; what a remote cannot do says so."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request

import pytest

from ds4desk.engine.api import (
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    LoadRequest,
    SamplingParams,
    TextDelta,
)
from ds4desk.engine.client import EngineClient
from ds4desk.engine.engine import Engine
from ds4desk.remote import NOT_AVAILABLE, RemoteConfig, RemoteEngine, is_remote
from tests.remote.conftest import KEY, MESSAGES
from tests.server.conftest import Served


def generations(served: Served, outcome: str) -> float:
    request = urllib.request.Request(served.root + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    found = re.search(rf'^ds4desk_generations_total\{{outcome="{outcome}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_greedy_answer_is_the_local_engines(served: tuple[Served, Engine], remote: RemoteEngine) -> None:
    _, engine = served
    local = engine.generate(GenerateRequest(messages=MESSAGES, max_new_tokens=16, use_snapshots=False))
    assert local.ok, local.error
    pieces: list[tuple[int | None, str]] = []
    result = remote.generate(
        GenerateRequest(messages=MESSAGES, max_new_tokens=16),
        lambda token, text: pieces.append((token, text)),
    )
    assert result.ok, result.error
    assert result.text == local.text
    assert result.finish_reason == local.finish_reason
    # Streamed, not delivered at the end in one piece.
    assert len(pieces) >= 2 and "".join(text for _, text in pieces) == result.text
    stats = result.stats
    assert stats.prompt_tokens == len(local.prompt_tokens)  # the server's usage
    assert stats.generated_tokens == local.stats.generated_tokens
    assert stats.time_to_first_token_s > 0 and stats.decode_s > 0 and stats.decode_tok_s > 0


def test_raw_text_goes_through_completions(served: tuple[Served, Engine], remote: RemoteEngine) -> None:
    _, engine = served
    prompt = "The three primary colours are"
    local = engine.generate(GenerateRequest(raw_text=prompt, max_new_tokens=8, use_snapshots=False))
    result = remote.generate(GenerateRequest(raw_text=prompt, max_new_tokens=8))
    assert result.ok, result.error
    assert result.text == local.text
    assert result.stats.prompt_tokens == len(local.prompt_tokens)


def test_the_same_seed_gives_the_same_sampled_answer(remote: RemoteEngine) -> None:
    def sampled() -> str:
        sampling = SamplingParams(temperature=1.2, top_p=0.95, seed=1234)
        result = remote.generate(GenerateRequest(messages=MESSAGES, sampling=sampling, max_new_tokens=8))
        assert result.ok, result.error
        return result.text

    assert sampled() == sampled()


def test_the_window_client_gets_batched_deltas(served: tuple[Served, Engine], remote: RemoteEngine) -> None:
    """EngineClient over a RemoteEngine is the window's backend: deltas arrive on the loop."""
    deltas: list[TextDelta] = []
    on_loop: list[bool] = []

    async def run() -> tuple[object, int]:
        client = EngineClient(remote)  # type: ignore[arg-type]
        loaded = await client.load(LoadRequest())
        assert loaded.ok and loaded.info is not None and is_remote(client.model_info)
        assert loaded.info.name == served[0].model
        loop_thread = threading.get_ident()

        def on_delta(delta: TextDelta) -> None:
            on_loop.append(threading.get_ident() == loop_thread)
            deltas.append(delta)

        request = GenerateRequest(messages=MESSAGES, max_new_tokens=12)
        return await client.generate(request, on_delta), request.request_id

    result, request_id = asyncio.run(run())
    assert result.ok, result.error  # type: ignore[attr-defined]
    assert "".join(d.text for d in deltas) == result.text  # type: ignore[attr-defined]
    assert deltas and all(on_loop) and all(d.request_id == request_id for d in deltas)
    # One placeholder token a streamed chunk: the live speed dock counts them.
    assert 1 <= sum(len(d.tokens) for d in deltas) <= result.stats.generated_tokens  # type: ignore[attr-defined]


def test_stop_cancels_the_answer_on_the_server(served: tuple[Served, Engine], remote: RemoteEngine) -> None:
    server = served[0]
    before = generations(server, "cancelled")
    first = threading.Event()
    request = GenerateRequest(messages=MESSAGES, max_new_tokens=400, stop_tokens=[])  # ignore_eos: runs long
    future = remote.submit_generate(request, lambda _token, _text: first.set())
    assert first.wait(120)
    remote.cancel(request.request_id)
    result = future.result(timeout=120)
    assert result.finish_reason == FinishReason.CANCELLED and result.error is None
    assert result.text and result.stats.generated_tokens < 400
    # The server saw the connection close and counted the answer as cancelled.
    deadline = time.monotonic() + 120
    while generations(server, "cancelled") <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert generations(server, "cancelled") == before + 1


def test_models_are_listed_and_chosen_by_name(served: tuple[Served, Engine], remote: RemoteEngine) -> None:
    server, engine = served
    assert [m.id for m in remote.list_models()] == [server.model]
    # The server says its context (vLLM's max_model_len), so the window shows the real one.
    listed = remote.list_models()[0]
    assert engine.model_info is not None and listed.context == engine.model_info.context > 0
    wrong = RemoteEngine(RemoteConfig(server.base_url, api_key=KEY, model="no-such-model"))
    try:
        loaded = wrong.load()
        assert loaded.error is not None and server.model in loaded.error.detail
        assert wrong.model_info is None
        assert wrong.load(LoadRequest(path=server.model)).ok  # a name given at load wins
    finally:
        wrong.close()


def test_a_wrong_key_is_refused_clearly(served: tuple[Served, Engine]) -> None:
    engine = RemoteEngine(RemoteConfig(served[0].base_url, api_key="wrong"))
    try:
        result = engine.generate(GenerateRequest(messages=MESSAGES, max_new_tokens=4))
    finally:
        engine.close()
    assert result.error is not None and result.error.code == ErrorCode.BAD_REQUEST
    assert "API key" in result.error.detail and "401" in result.error.detail


def test_what_a_remote_cannot_do_says_so(remote: RemoteEngine) -> None:
    assert not remote.park().ok and NOT_AVAILABLE in remote.park().error.detail  # type: ignore[union-attr]
    assert not remote.unpark().ok
    slots = remote.slots("list")
    assert slots.error is not None and NOT_AVAILABLE in slots.error.detail
    with pytest.raises(EngineFailure, match=NOT_AVAILABLE):
        asyncio.run(EngineClient(remote).memory())  # type: ignore[arg-type]
    assert remote.parked is False and remote.idle_park_deadline() is None
