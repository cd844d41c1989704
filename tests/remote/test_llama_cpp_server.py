"""RemoteEngine, `ds4desk generate --remote` and the real window against a server nobody here wrote:
llama.cpp's own OpenAI-compatible server (llama-cpp-python's `python -m llama_cpp.server`, built from
source, on the CPU) serving the embedded SmolLM2 GGUF. The answers stream and equal what that server
answers greedily to the official `openai` client; Stop stops; the server dying mid-answer is a clear
error that keeps the text written so far."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from ds4desk.engine.api import FinishReason, GenerateRequest
from ds4desk.engine.client import EngineClient
from ds4desk.remote import RemoteConfig, RemoteEngine
from ds4desk.remote.switch import SwitchingBackend
from tests.real_models import smollm2_gguf
from tests.remote.test_window_remote import greedy_settings, last_answer
from tests.ui.conftest import WindowFactory
from tests.ui.fake_backend import FakeBackend

PROMPT = "Name three colours of the rainbow."
MESSAGES = [{"role": "user", "content": PROMPT}]
LONG = 400  # an answer long enough to be stopped (or cut) after its first words


@dataclass(slots=True)
class LlamaServer:
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str  # the id /v1/models lists
    process: subprocess.Popen[bytes]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def llama_cpp_server(log: Path) -> Iterator[LlamaServer]:
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf()),
             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        listed = None
        for _ in range(600):  # a bound (five minutes), not a timing
            if process.poll() is not None:
                pytest.fail(f"llama_cpp.server exited with {process.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=5) as response:
                    listed = json.loads(response.read())
                break
            except OSError:
                time.sleep(0.5)
        if listed is None:
            pytest.fail(f"llama_cpp.server did not answer: {log.read_text()[-2000:]}")
        yield LlamaServer(base_url, listed["data"][0]["id"], process)
    finally:
        process.kill()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with llama_cpp_server(tmp_path_factory.mktemp("llama-server") / "log.txt") as server:
        yield server


def servers_own_answer(server: LlamaServer, messages: list[dict[str, str]], max_tokens: int) -> Any:
    """What the server answers greedily to the official client, not streamed."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)
    return client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )


def connected(server: LlamaServer) -> RemoteEngine:
    engine = RemoteEngine(RemoteConfig(server.base_url))
    loaded = engine.load()
    assert loaded.ok, loaded.error
    return engine


class FirstText:
    """A sink that gathers the streamed text and says when the first of it arrived."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.arrived = threading.Event()

    def __call__(self, token: int | None, text: str) -> None:
        self.pieces.append(text)
        if text:
            self.arrived.set()


def test_the_remote_engine_streams_the_servers_greedy_answer(llama_server: LlamaServer) -> None:
    reference = servers_own_answer(llama_server, MESSAGES, 16)
    engine = connected(llama_server)
    try:
        assert engine.model_info is not None and engine.model_info.name == llama_server.model
        sink = FirstText()
        result = engine.generate(GenerateRequest(messages=MESSAGES, max_new_tokens=16), sink)
    finally:
        engine.close()
    assert result.ok, result.error
    assert result.text == reference.choices[0].message.content
    assert len([p for p in sink.pieces if p]) >= 2 and "".join(sink.pieces) == result.text  # streamed
    assert result.stats.generated_tokens == reference.usage.completion_tokens
    # (No prompt count: this server's stream carries no usage, even when asked for it.)
    assert result.stats.decode_tok_s > 0


def test_generate_remote_answers_as_the_server_does(llama_server: LlamaServer, tmp_path: Path) -> None:
    reference = servers_own_answer(llama_server, MESSAGES, 8)
    out = subprocess.run(
        [sys.executable, "-m", "ds4desk", "--data-dir", str(tmp_path), "generate",
         "--remote", llama_server.base_url, "--prompt", PROMPT, "--max-tokens", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["text"] == reference.choices[0].message.content
    assert answer["stats"]["generated_tokens"] == reference.usage.completion_tokens


def test_stop_stops_and_the_server_answers_the_next_request(llama_server: LlamaServer) -> None:
    engine = connected(llama_server)
    try:
        sink = FirstText()
        request = GenerateRequest(messages=MESSAGES, max_new_tokens=LONG)
        future = engine.submit_generate(request, sink)
        assert sink.arrived.wait(300), "no text arrived"
        engine.cancel(request.request_id)
        result = future.result(timeout=300)
        assert result.finish_reason == FinishReason.CANCELLED and result.error is None
        assert result.text and result.text == "".join(sink.pieces)
        assert result.stats.generated_tokens < LONG
        # The stopped stream left the server well: the next answer is its usual one.
        after = engine.generate(GenerateRequest(messages=MESSAGES, max_new_tokens=8))
    finally:
        engine.close()
    assert after.ok, after.error
    assert after.text == servers_own_answer(llama_server, MESSAGES, 8).choices[0].message.content


def test_the_server_dying_mid_answer_is_a_clear_error_that_keeps_the_text(tmp_path: Path) -> None:
    with llama_cpp_server(tmp_path / "log.txt") as server:
        engine = connected(server)
        try:
            sink = FirstText()
            future = engine.submit_generate(GenerateRequest(messages=MESSAGES, max_new_tokens=LONG), sink)
            assert sink.arrived.wait(300), "no text arrived"
            server.process.kill()
            result = future.result(timeout=300)
        finally:
            engine.close()
    assert result.finish_reason == FinishReason.ERROR and result.error is not None
    assert "closed the connection mid-answer" in result.error.detail
    assert result.text and result.text == "".join(sink.pieces)


# ---- the real window ------------------------------------------------------------------------------


def window_on(server: LlamaServer, make_window: WindowFactory, max_new_tokens: int) -> Any:
    """The window switched to `server`, as File > Connect to a server… leaves it."""
    switch = SwitchingBackend(FakeBackend(), EngineClient)
    window = make_window(switch, settings=greedy_settings(max_new_tokens))
    switch.use_remote(connected(server))
    return window


async def act_at_first_text(window: Any, act: Callable[[], None]) -> Any:
    """Send PROMPT and call `act` once the first words of the answer are in the window."""
    task = asyncio.ensure_future(window.send_message(PROMPT))
    for _ in range(6000):  # a bound (five minutes), not a timing
        generation = window._generation
        if generation is not None and generation.writer.text:
            break
        await asyncio.sleep(0.05)
    act()
    return await task


def test_the_window_answers_from_llama_cpp_and_stop_keeps_the_text(
    llama_server: LlamaServer, make_window: WindowFactory, run: Callable[..., Any]
) -> None:
    window = window_on(llama_server, make_window, 12)
    reference = servers_own_answer(llama_server, MESSAGES, 12).choices[0].message.content
    result = run(window.send_message(PROMPT))
    assert result.ok, result.error
    assert result.text == reference
    stored = last_answer(window.history, window.current_chat_id)
    assert stored.content == reference and stored.finished
    assert reference.split()[0] in window.chat_view.toPlainText()

    window.settings.max_new_tokens = LONG
    stopped = run(act_at_first_text(window, window.stop))
    assert stopped.finish_reason == FinishReason.CANCELLED and stopped.error is None
    stored = last_answer(window.history, window.current_chat_id)
    assert stored.content and stored.content == stopped.text
    assert stored.stats["finish_reason"] == "cancelled"


def test_the_window_keeps_the_text_when_the_server_dies(
    make_window: WindowFactory, run: Callable[..., Any], tmp_path: Path
) -> None:
    with llama_cpp_server(tmp_path / "log.txt") as server:
        window = window_on(server, make_window, LONG)
        result = run(act_at_first_text(window, server.process.kill))
    assert result.error is not None and "closed the connection mid-answer" in result.error.detail
    stored = last_answer(window.history, window.current_chat_id)
    assert stored.content and stored.content == result.text  # what was written is kept
    shown = window.statusBar().currentMessage() + window.status_label.text() + window.chat_view.toPlainText()
    assert "closed the connection mid-answer" in shown
