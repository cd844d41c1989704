"""Settings > "Serve the loaded model on localhost": the real window, the real engine thread and the
embedded SmolLM2, served over real HTTP to the official `openai` client while the window chats."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import shiboken6
from PySide6.QtCore import Qt

from ds4desk.app import local_server_for
from ds4desk.engine import Engine, EngineClient, GenerateRequest
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow

QUESTION = "Name three colours of the rainbow."
SETTINGS = Settings(
    temperature=0.0,
    max_new_tokens=12,
    context=1024,
    chunk=64,
    device="cpu",
    serve_on_localhost=True,
    serve_port=0,
)


@pytest.fixture
def open_window(qtbot: Any, loop: Any, client: EngineClient, tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[MainWindow, History]] = []

    def make(settings: Settings, backend: EngineClient = client) -> MainWindow:
        history = History(tmp_path / "history.sqlite3")
        server = local_server_for(backend)  # what app.py gives the window
        assert server is not None
        window = MainWindow(backend, history, settings, local_server=server)
        window.show()
        qtbot.waitExposed(window)
        made.append((window, history))
        return window

    yield make
    for window, history in made:
        window.close()
        loop.run_until_complete(window.wait_idle())
        assert window.serve_control.url is None  # closing the window stopped the server
        shiboken6.delete(window)
        history.close()


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="anything", max_retries=0)


def streamed(url: str, max_tokens: int = 12, first: threading.Event | None = None) -> str:
    """A streaming chat request, as an editor sends one; `first` is set at its first text."""
    parts = []
    stream = api(url).chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if first is not None:
                first.set()
    return "".join(parts)


def send(qtbot: Any, window: MainWindow, text: str) -> None:
    qtbot.keyClicks(window.composer, text)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)


def test_the_window_serves_its_model_while_it_chats(qtbot: Any, run: Any, open_window: Any) -> None:
    window = open_window(Settings(**{**SETTINGS.to_json()}))
    assert run(window.load_model()).ok
    run(window.serve_control.task)  # started with the window, as the saved setting asked
    url = window.serve_control.url
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert window.serve_control.label.isVisible() and url in window.serve_control.label.text()

    async def both() -> str:
        served = asyncio.get_running_loop().run_in_executor(None, streamed, url)
        send(qtbot, window, QUESTION)  # the window's own answer, queued with the served one
        text = await served
        await window.wait_idle()
        return text

    served_text = run(both())
    chat = window.history.list_chats()[0]
    _question, answer = window.history.messages(chat.id)
    # Greedy, same question: no stream crossed the other, and both are whole.
    assert answer.finished and served_text and answer.content == served_text

    panel = window.perf_panel
    qtbot.waitUntil(lambda: panel.served == 1)  # the report crosses from the server's thread
    bars = list(panel.decode_chart.bars)
    assert sorted(bar.served for bar in bars) == [False, True]
    served_bar = next(bar for bar in bars if bar.served)
    assert window.backend.model_info is not None and served_bar.model == window.backend.model_info.name
    assert not panel.served_label.isHidden() and "1 request served" in panel.served_label.text()
    layout = panel.decode_chart.chart_layout()
    assert [bar.served for _rect, bar in layout.bars] == [bar.served for bar in bars]


@pytest.fixture
def no_model() -> Iterator[EngineClient]:
    """An engine that has not loaded anything (cheap: no model, no torch work)."""
    engine = Engine()
    yield EngineClient(engine)
    engine.close()


def test_a_taken_port_is_a_notice_and_another_port_serves(
    qtbot: Any, run: Any, no_model: EngineClient, open_window: Any
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        settings = Settings(**{**SETTINGS.to_json(), "serve_port": port})
        window = open_window(settings, no_model)
        run(window.serve_control.task)
        assert window.serve_control.url is None and not window.serve_control.label.isVisible()
        notices = window.notice_bar.notices
        assert any(f"cannot listen on 127.0.0.1:{port}" in text for text in notices), notices
        assert any("Settings > Local server" in text for text in notices)
        assert window.isVisible()  # no crash: the window goes on, unserved

        dialog = window.open_settings()
        assert dialog.serve.isChecked() and dialog.serve_port.value() == port
        dialog.serve_port.setValue(0)
        dialog.accept()
        run(window.serve_control.task)
        assert window.settings.serve_port == 0
        url = window.serve_control.url
        assert url is not None and window.serve_control.label.isVisible()
        assert not any("cannot listen" in text for text in window.notice_bar.notices)  # over now

    # Without a model yet, a request gets the server's clean 503, and the server goes on.
    with pytest.raises(openai.APIStatusError) as refused:
        api(url).chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 503 and "no model" in str(refused.value)

    dialog = window.open_settings()
    assert dialog.serve_status.isVisible() and url in dialog.serve_status.text()
    dialog.serve.setChecked(False)
    dialog.accept()
    run(window.serve_control.task)
    assert window.serve_control.url is None and not window.serve_control.label.isVisible()
    with pytest.raises(openai.APIConnectionError):
        api(url).models.list()


def test_park_and_close_while_serving(qtbot: Any, run: Any, open_window: Any, client: EngineClient) -> None:
    window = open_window(Settings(**{**SETTINGS.to_json()}))
    assert run(window.load_model()).ok
    run(window.serve_control.task)
    url = window.serve_control.url
    assert url is not None

    # The window parks the model: the next served request loads it back (the engine's default).
    parked = run(window.park_controls.set_parked(True, "all"))
    assert parked.ok and client.parked
    reply = api(url).chat.completions.create(
        model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content and not client.parked

    # The window loads a model (the same again) while a served answer streams: the engine loads
    # after that answer, which ends whole, and the next request is answered by the new load.
    first = threading.Event()
    during: list[str] = []
    reader = threading.Thread(target=lambda: during.append(streamed(url, max_tokens=16, first=first)))
    reader.start()
    run(_wait(first))
    assert run(window.load_model()).ok
    reader.join(120)
    assert during and during[0] == streamed(url, max_tokens=16)

    # The window closes while a long served answer streams: the stream is cut (so cancelled), the
    # server stops, and the engine is free for whatever comes next.
    first = threading.Event()
    outcome: list[object] = []

    def long_answer() -> None:
        try:
            outcome.append(streamed(url, max_tokens=400, first=first))
        except openai.APIError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=long_answer)
    reader.start()
    run(_wait(first))
    window.close()
    run(window.wait_idle())
    reader.join(120)
    assert not reader.is_alive() and len(outcome) == 1
    cut = outcome[0]
    # Cut off: an error, or a stream that ended early (never the whole 400 tokens).
    assert isinstance(cut, openai.APIError) or (isinstance(cut, str) and len(cut.split()) < 300), cut
    with pytest.raises(openai.APIConnectionError):
        api(url).models.list()
    again = run(
        client.generate(GenerateRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=4))
    )
    assert again.ok and again.text


async def _wait(event: threading.Event) -> None:
    await asyncio.get_running_loop().run_in_executor(None, event.wait)
