"""The server on a thread of its own over an engine something else drives (the window's): real
uvicorn, the official `openai` client, the embedded SmolLM2 on the CPU, and the engine used directly
at the same time as the oracle."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import openai
import pytest

from ds4desk.engine.api import GenerateRequest, GenerateStats, LoadRequest, SamplingParams
from ds4desk.engine.engine import Engine
from ds4desk.server.background import BackgroundServer, ServeError

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine()
    loaded = engine.load(LoadRequest(device="cpu", context=1024, chunk=64))
    assert loaded.ok, loaded.error
    yield engine
    engine.close()


@pytest.fixture
def served(engine: Engine) -> Iterator[tuple[BackgroundServer, list[tuple[str, GenerateStats]]]]:
    reports: list[tuple[str, GenerateStats]] = []
    server = BackgroundServer(engine)
    server.start(0, lambda model, stats: reports.append((model, stats)))
    yield server, reports
    server.stop()


def client(server: BackgroundServer) -> openai.OpenAI:
    assert server.url is not None
    return openai.OpenAI(base_url=server.url, api_key="unused-on-loopback", max_retries=0)


def direct(engine: Engine) -> str:
    request = GenerateRequest(messages=QUESTION, sampling=SamplingParams(), max_new_tokens=MAX_TOKENS)
    result = engine.generate(request)
    assert result.ok, result.error
    return result.text


def test_it_serves_the_engine_it_shares_and_reports_each_request(
    engine: Engine, served: tuple[BackgroundServer, list[tuple[str, GenerateStats]]]
) -> None:
    server, reports = served
    assert server.url is not None and server.url.startswith("http://127.0.0.1:")
    reply = client(server).chat.completions.create(
        model="any",
        messages=QUESTION,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    # The same engine answered: the same greedy text as asking it directly.
    assert reply.choices[0].message.content == direct(engine)
    assert reply.usage is not None
    assert len(reports) == 1
    model, stats = reports[0]
    assert engine.model_info is not None and model == engine.model_info.name
    assert stats.generated_tokens == reply.usage.completion_tokens
    assert stats.prompt_tokens == reply.usage.prompt_tokens
    assert stats.decode_tok_s > 0 and stats.time_to_first_token_s > 0


def test_requests_queue_behind_direct_use_of_the_engine(
    engine: Engine, served: tuple[BackgroundServer, list[tuple[str, GenerateStats]]]
) -> None:
    """The engine thread orders the host's own answers and the served ones: both come out whole."""
    server, reports = served
    answers: list[str] = []
    served_thread = threading.Thread(
        target=lambda: answers.append(
            client(server)
            .chat.completions.create(
                model="any",
                messages=QUESTION,
                max_tokens=MAX_TOKENS,
                temperature=0,  # type: ignore[arg-type]
            )
            .choices[0]
            .message.content
            or ""
        )
    )
    served_thread.start()
    mine = direct(engine)
    served_thread.join(120)
    assert answers == [mine]
    assert len(reports) == 1


def test_a_taken_port_is_a_clear_error_and_stop_frees_the_port(engine: Engine) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = BackgroundServer(engine)
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port}"):
            server.start(port)
        assert server.url is None and not server.running
    url = server.start(port)  # the port is free now
    assert url == f"http://127.0.0.1:{port}/v1" and server.running
    server.stop()
    assert server.url is None and not server.running
    server.stop()  # a second stop does nothing
    with socket.socket() as again:  # uvicorn and our socket both let the port go
        again.bind(("127.0.0.1", port))


def test_only_loopback_without_a_key(engine: Engine) -> None:
    server = BackgroundServer(engine)
    with pytest.raises(ServeError, match="needs --api-key"):
        server.start(0, host="0.0.0.0")
    with pytest.raises(ServeError, match="already serving"):
        server.start(0)
        server.start(0)
    server.stop()
