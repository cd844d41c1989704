"""The real window, the real engine thread and the real embedded model on the qasync loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import Qt

from ds4desk.engine import EngineClient, GenerateRequest, SamplingParams
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow

SETTINGS = Settings(temperature=0.0, max_new_tokens=20, context=1024, chunk=64, device="cpu")


@pytest.fixture
def open_window(qtbot: Any, loop: Any, client: EngineClient, tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[MainWindow, History]] = []

    def make(settings: Settings = SETTINGS) -> MainWindow:
        history = History(tmp_path / "history.sqlite3")
        window = MainWindow(client, history, settings)
        window.show()
        qtbot.waitExposed(window)
        made.append((window, history))
        return window

    yield make
    for window, history in made:
        window.close()
        loop.run_until_complete(window.wait_idle())
        shiboken6.delete(window)  # on this thread, not whichever thread the GC runs on
        history.close()


def send(qtbot: Any, window: MainWindow, text: str) -> None:
    qtbot.keyClicks(window.composer, text)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)


def test_chat_with_the_real_model(qtbot: Any, run: Any, open_window: Any, client: EngineClient) -> None:
    window = open_window()
    qtbot.waitUntil(window.composer.hasFocus)
    loaded = run(window.load_model())
    assert loaded.ok, loaded.error
    assert "SmolLM2" in window.model_label.text() and "cpu" in window.model_label.text()

    send(qtbot, window, "What is the capital of France?")
    run(window.wait_idle())
    chat = window.history.list_chats()[0]
    user, answer = window.history.messages(chat.id)
    assert answer.finished and answer.content.strip()
    # The window showed and stored exactly what the engine answers to the same conversation.
    direct = run(
        client.generate(
            GenerateRequest(
                messages=[{"role": "user", "content": user.content}],
                sampling=SamplingParams(temperature=0.0),
                max_new_tokens=SETTINGS.max_new_tokens,
            )
        )
    )
    assert direct.text == answer.content
    assert answer.content.split()[0] in window.chat_view.toPlainText()
    assert "tok/s" in window.speed_label.text()

    # A follow-up continues from the snapshot of the first turn: only the new message is prefilled.
    send(qtbot, window, "And of Germany?")
    run(window.wait_idle())
    follow_up = window.history.messages(chat.id)[-1]
    assert follow_up.finished and follow_up.stats is not None
    reused, computed = follow_up.stats["reused_tokens"], follow_up.stats["prefill_tokens"]
    assert reused >= answer.stats["prompt_tokens"] and 0 < computed < 20

    # Recreated on the same data: the chat is in the sidebar and opens with its messages.
    window.close()
    again = open_window()
    assert again.chat_list.count() == 1
    again.chat_list.setCurrentRow(0)
    assert "What is the capital of France?" in again.chat_view.toPlainText()


def test_stop_keeps_the_partial_answer(qtbot: Any, run: Any, open_window: Any) -> None:
    long_settings = Settings(temperature=0.0, max_new_tokens=400, context=1024, chunk=64, device="cpu")
    window = open_window(long_settings)
    assert run(window.load_model()).ok
    send(qtbot, window, "Write a long story about a lighthouse keeper.")

    async def stop_after_some_text() -> None:
        while len(window.chat_view.stream_text) < 40:  # some of the answer, not the whole
            await asyncio.sleep(0.02)
        window.stop_button.click()
        await window.wait_idle()

    run(stop_after_some_text())
    chat = window.history.list_chats()[0]
    answer = window.history.messages(chat.id)[-1]
    assert not answer.finished and answer.content.strip()
    assert answer.stats is not None and answer.stats["finish_reason"] == "cancelled"
    assert answer.stats["generated_tokens"] < 400


def test_a_bad_file_shows_an_error_and_the_chat_goes_on(
    qtbot: Any, run: Any, open_window: Any, tmp_path: Path
) -> None:
    window = open_window()
    assert run(window.load_model()).ok
    broken = tmp_path / "half.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 64)
    failed = run(window.load_model(str(broken)))
    assert not failed.ok
    # The error is a notice above the chat, not a message inside it.
    assert "half.gguf" in window.notice_label.text()
    assert "half.gguf" not in window.chat_view.toPlainText()
    assert "SmolLM2" in window.model_label.text()  # the loaded model stayed
    send(qtbot, window, "Say hello.")
    run(window.wait_idle())
    answer = window.history.messages(window.history.list_chats()[0].id)[-1]
    assert answer.finished and answer.content.strip()
