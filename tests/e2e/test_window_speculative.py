"""Speculative decoding from the window on the real engine and the embedded SmolLM2: File > Load draft
model… (the model as its own draft), the Settings mode each answer asks for, the footer and the
acceptance chart, and the park row's "Draft model" freeing and reloading the draft."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import Qt

from ds4desk.engine import EngineClient
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.history import History, Message
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow

LIST = "apples, bananas, cherries, dates, elderberries, figs, grapes"
PROMPT = f"Repeat this list exactly: {LIST}."


@pytest.fixture
def window(qtbot: Any, loop: Any, client: EngineClient, tmp_path: Path) -> Iterator[MainWindow]:
    history = History(tmp_path / "history.sqlite3")
    settings = Settings(
        temperature=0.0, max_new_tokens=16, context=1024, chunk=64, device="cpu", speculative="off"
    )
    made = MainWindow(client, history, settings)
    made.show()
    qtbot.waitExposed(made)
    yield made
    made.close()
    loop.run_until_complete(made.wait_idle())
    shiboken6.delete(made)
    history.close()


def ask(qtbot: Any, run: Any, window: MainWindow, mode: str) -> Message:
    """PROMPT in a new chat with Settings > Speculative decoding at `mode`; the stored answer."""
    window.settings.speculative = mode
    window.new_chat()
    qtbot.keyClicks(window.composer, PROMPT)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    run(window.wait_idle())
    chat = window.history.list_chats()[0]
    answer = window.history.messages(chat.id)[-1]
    assert answer.role == "assistant" and answer.finished, answer.stats
    return answer


def test_a_draft_model_from_the_window(
    qtbot: Any, run: Any, window: MainWindow, client: EngineClient
) -> None:
    assert run(window.load_model()).ok
    plain = ask(qtbot, run, window, "off")
    assert plain.stats["speculative"] == "off" and plain.stats["drafted_tokens"] == 0
    assert "drafted tokens accepted" not in window.chat_view.toPlainText()

    task = window.load_draft(str(default_model_path()))
    assert task is not None and run(task).ok
    assert client.model_info is not None and client.model_info.draft
    assert "draft" in window.model_label.text()
    drafted = ask(qtbot, run, window, "draft")
    assert drafted.content == plain.content  # greedy: speculation never changes the answer
    stats = drafted.stats
    assert stats["speculative"] == "draft" and 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
    shown = f"draft: {stats['accepted_tokens']:,} of {stats['drafted_tokens']:,} drafted tokens accepted"
    assert shown in window.chat_view.toPlainText()
    rate = 100 * stats["accepted_tokens"] / stats["drafted_tokens"]
    chart = window.perf_panel.acceptance_chart
    assert not chart.isHidden() and chart.values()[-1] == pytest.approx(rate)
    assert len(chart.values()) == 1  # the plain answer drafted nothing

    # The park row frees the draft alone and loads it back; the target answers meanwhile.
    window.park_selector.setCurrentIndex(window.park_selector.findData("draft"))
    qtbot.mouseClick(window.park_button, Qt.MouseButton.LeftButton)
    run(window.park_controls.task)
    assert "Parked (draft): freed" in window.status_label.text()
    assert not client.parked and window.unpark_button.isEnabled()
    alone = ask(qtbot, run, window, "auto")  # auto without a draft: prompt lookup
    assert alone.content == plain.content and alone.stats["speculative"] == "lookup"
    assert alone.stats["drafted_tokens"] > 0  # the answer quotes the prompt: lookup finds it
    qtbot.mouseClick(window.unpark_button, Qt.MouseButton.LeftButton)
    run(window.park_controls.task)
    assert "Unparked (draft): loaded" in window.status_label.text()
    back = ask(qtbot, run, window, "auto")  # auto with the draft back: the draft
    assert back.content == plain.content and back.stats["speculative"] == "draft"
