"""The real window on a SwitchingBackend switched to a real `ds4desk serve`: the answer streams into
the chat and the history with its speed stats, and Stop keeps the partial answer. (The menu entry
that switches is the window owner's; here the test switches, as that entry will.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ds4desk.engine.api import FinishReason, GenerateRequest
from ds4desk.engine.client import EngineClient
from ds4desk.engine.engine import Engine
from ds4desk.history import History
from ds4desk.remote import RemoteConfig, RemoteEngine
from ds4desk.remote.switch import SwitchingBackend
from ds4desk.settings import Settings
from tests.remote.conftest import KEY
from tests.server.conftest import Served
from tests.ui.conftest import WindowFactory
from tests.ui.fake_backend import FakeBackend

PROMPT = "Name three colours of the rainbow."


def connect(switch: SwitchingBackend, served: Served) -> None:
    """What File > Connect to a server… does once its dialog handed over a connected engine."""
    engine = RemoteEngine(RemoteConfig(served.base_url, api_key=KEY))
    assert engine.load().ok
    switch.use_remote(engine)


def greedy_settings(max_new_tokens: int) -> Settings:
    settings = Settings()
    settings.temperature = 0.0
    settings.max_new_tokens = max_new_tokens
    return settings


def last_answer(history: History, chat_id: int) -> Any:
    return [m for m in history.messages(chat_id) if m.role == "assistant"][-1]


def test_the_window_answers_from_the_server(
    served: tuple[Served, Engine], make_window: WindowFactory, run: Callable[..., Any]
) -> None:
    server, engine = served
    switch = SwitchingBackend(FakeBackend(), EngineClient)
    window = make_window(switch, settings=greedy_settings(12))  # the local (fake) model loads first
    connect(switch, server)
    try:
        result = run(window.send_message(PROMPT))
        local = engine.generate(
            GenerateRequest(
                messages=[{"role": "user", "content": PROMPT}], max_new_tokens=12, use_snapshots=False
            )
        )
        assert result.ok, result.error
        assert result.text == local.text
        stored = last_answer(window.history, window.current_chat_id)
        assert stored.content == local.text and stored.finished
        assert (
            stored.stats["decode_tok_s"] > 0
            and stored.stats["generated_tokens"] == local.stats.generated_tokens
        )
        assert local.text.split()[0] in window.chat_view.toPlainText()
    finally:
        switch.use_local()


def test_stop_in_the_window_keeps_the_partial_answer(
    served: tuple[Served, Engine], make_window: WindowFactory, run: Callable[..., Any]
) -> None:
    switch = SwitchingBackend(FakeBackend(), EngineClient)
    window = make_window(switch, settings=greedy_settings(400))
    connect(switch, served[0])
    try:
        # Long answers take minutes on these CPUs: Stop as soon as the first text has arrived.
        async def stop_at_the_first_text() -> Any:
            task = asyncio.ensure_future(window.send_message(PROMPT))
            for _ in range(2400):  # a bound, not a timing: at most two minutes
                generation = window._generation
                if generation is not None and generation.writer.text:
                    break
                await asyncio.sleep(0.05)
            window.stop()
            return await task

        result = run(stop_at_the_first_text())
        assert result.finish_reason == FinishReason.CANCELLED and result.error is None
        stored = last_answer(window.history, window.current_chat_id)
        assert stored.content and stored.content == result.text
        assert stored.stats["finish_reason"] == "cancelled"
        assert "Stopped" in window.statusBar().currentMessage() or "Stopped" in window.status_label.text()
    finally:
        switch.use_local()
