"""The window against FakeBackend on the real qasync loop, with real SQLite history."""

from __future__ import annotations

import itertools
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from ds4desk.engine.api import EngineError, ErrorCode
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.composer import PLACEHOLDER
from tests.ui.fake_backend import DEFAULT_REPLY, FakeBackend

CODE_REPLY = "Sure:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nDone."


def type_and_enter(qtbot, window, text: str) -> None:
    for index, line in enumerate(text.split("\n")):
        if index:
            qtbot.keyClick(window.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
        qtbot.keyClicks(window.composer, line)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)


def test_fake_satisfies_the_protocol() -> None:
    assert isinstance(FakeBackend(), ChatBackend)


def test_window_basics(make_window) -> None:
    window = make_window()
    assert window.windowTitle() == "ds4desk"
    assert window.width() >= 1000 and window.height() >= 700
    assert window.composer.placeholderText() == PLACEHOLDER
    assert window.composer.hasFocus()
    assert "fake-llama-1b" in window.model_label.text()
    assert "cpu" in window.model_label.text()
    assert window.quit_action.shortcut().toString() == "Ctrl+Q"


def test_enter_sends_and_the_answer_streams_in_completely(qtbot, make_window, run) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    seen: list[str] = []
    backend.after_batch = lambda: seen.append(window.chat_view.toPlainText())

    type_and_enter(qtbot, window, "Hello there")
    assert window.composer.toPlainText() == ""
    assert window.busy and window.stop_button.isEnabled() and not window.send_button.isEnabled()
    run(window.wait_idle())

    # Progressively: every batch showed more of the answer than the one before.
    assert len(seen) == backend.batches_sent > 3
    assert all(len(a) < len(b) for a, b in itertools.pairwise(seen))
    assert "Hello!" in seen[1] and "two" not in seen[1]
    # Completely: the rendered Markdown has all of it.
    shown = window.chat_view.toPlainText()
    assert "Hello there" in shown
    assert "I am a fake model." in shown and "one" in shown and "two" in shown
    assert "**" not in shown  # rendered, not raw Markdown

    request = backend.generate_requests[0]
    assert request.messages == [{"role": "user", "content": "Hello there"}]
    assert request.max_new_tokens == Settings().max_new_tokens
    assert request.sampling.temperature == Settings().temperature
    assert "tok/s" in window.speed_label.text()
    assert not window.busy and window.send_button.isEnabled() and not window.stop_button.isEnabled()

    chat = window.history.list_chats()[0]
    assert chat.title == "Hello there"
    user, answer = window.history.messages(chat.id)
    assert (user.role, user.content) == ("user", "Hello there")
    assert (answer.role, answer.content, answer.finished) == ("assistant", DEFAULT_REPLY, True)
    assert answer.stats is not None and answer.stats["finish_reason"] == "stop"


def test_throttled_rendering_still_ends_complete(qtbot, make_window, run) -> None:
    backend = FakeBackend(batch_chars=1)
    window = make_window(backend)
    window.chat_view.render_interval_ms = 60_000  # only the first batch and the final render
    type_and_enter(qtbot, window, "hi")
    run(window.wait_idle())
    assert window.chat_view.renders < backend.batches_sent
    assert "I am a fake model." in window.chat_view.toPlainText()


def test_follow_up_sends_the_conversation(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["First answer.", "Second answer."])
    window = make_window(backend, settings=Settings(system_prompt="Be brief."))
    type_and_enter(qtbot, window, "one")
    run(window.wait_idle())
    type_and_enter(qtbot, window, "two")
    run(window.wait_idle())
    assert backend.generate_requests[1].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "two"},
    ]
    assert len(window.history.list_chats()) == 1


def test_shift_enter_inserts_a_newline(qtbot, make_window) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    qtbot.keyClicks(window.composer, "line one")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.composer, "line two")
    assert window.composer.toPlainText() == "line one\nline two"
    assert not window.busy and backend.generate_requests == []
    assert window.history.list_chats() == []


def test_enter_on_empty_composer_sends_nothing(qtbot, make_window) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    assert not window.busy and backend.generate_requests == []


def test_stop_keeps_the_partial_answer(qtbot, make_window, run) -> None:
    backend = FakeBackend(reply="word " * 2000, batch_chars=5)
    window = make_window(backend)
    type_and_enter(qtbot, window, "Write a long story")
    run(backend.wait_for_batches(5))

    # Enter while answering keeps the text for later instead of dropping it.
    qtbot.keyClicks(window.composer, "next question")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    assert window.composer.toPlainText() == "next question"

    qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    run(window.wait_idle())

    request_id = backend.generate_requests[0].request_id
    assert backend.cancelled == [request_id]
    assert 5 <= backend.batches_sent < 2000
    partial = "word " * backend.batches_sent
    shown = window.chat_view.toPlainText()
    assert "word word word" in shown and "Stopped." in shown
    assert "Stopped" in window.status_label.text()

    chat = window.history.list_chats()[0]
    answer = window.history.messages(chat.id)[-1]
    assert answer.content == partial
    assert not answer.finished
    assert answer.stats is not None and answer.stats["finish_reason"] == "cancelled"
    assert window.send_button.isEnabled()


def test_chats_survive_a_restart_and_open_on_click(qtbot, make_window, run, db_path: Path) -> None:
    first = make_window(FakeBackend(replies=["Paris is the capital."]))
    type_and_enter(qtbot, first, "What is the capital of France?\nAnswer briefly.")
    run(first.wait_idle())
    first.close()

    second = make_window(FakeBackend())
    assert second.chat_list.count() == 1
    item = second.chat_list.item(0)
    assert item.text() == "What is the capital of France?"
    assert second.chat_view.toPlainText().strip() == ""

    rect = second.chat_list.visualItemRect(item)
    qtbot.mouseClick(second.chat_list.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    shown = second.chat_view.toPlainText()
    assert "What is the capital of France?" in shown and "Paris is the capital." in shown
    assert second.current_chat_id == second.history.list_chats()[0].id

    # Sending now continues that chat.
    type_and_enter(qtbot, second, "And Germany?")
    run(second.wait_idle())
    assert second.chat_list.count() == 1
    assert len(second.history.messages(second.current_chat_id)) == 4


def test_interrupted_answer_is_marked_after_restart(qtbot, make_window, db_path: Path) -> None:
    with History(db_path) as history:  # what a crash mid-answer leaves behind
        chat = history.create_chat()
        history.add_message(chat.id, "user", "Tell me a story")
        history.add_message(chat.id, "assistant", "Once upon a time", finished=False)

    window = make_window(FakeBackend())
    window.open_chat(chat.id)
    shown = window.chat_view.toPlainText()
    assert "Once upon a time" in shown
    assert "Interrupted" in shown


def test_closing_mid_answer_saves_what_streamed(qtbot, make_window, run, db_path: Path) -> None:
    """The window closes while the event loop runs, as in the app (between two `run` calls, a task
    the harness stepped outside the loop would fail on its own)."""
    backend = FakeBackend(reply="token " * 1000, batch_chars=6)
    window = make_window(backend)
    backend.after_batch = lambda: window.close() if backend.batches_sent == 3 else None
    type_and_enter(qtbot, window, "go")
    run(window.wait_idle())
    with History(db_path) as history:
        answer = history.messages(history.list_chats()[0].id)[-1]
    assert answer.content.startswith("token token token") and not answer.finished
    assert answer.stats is None  # no outcome was recorded: it shows as interrupted


def test_new_chat_starts_empty(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend())
    type_and_enter(qtbot, window, "first chat")
    run(window.wait_idle())
    qtbot.mouseClick(window.new_chat_button, Qt.MouseButton.LeftButton)
    assert window.current_chat_id is None
    assert window.chat_view.toPlainText().strip() == ""
    assert window.composer.hasFocus()
    type_and_enter(qtbot, window, "second chat")
    run(window.wait_idle())
    assert [c.title for c in window.history.list_chats()] == ["second chat", "first chat"]
    assert window.chat_list.currentItem().text() == "second chat"


def test_delete_and_rename_chat(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend())
    type_and_enter(qtbot, window, "to be deleted")
    run(window.wait_idle())
    chat_id = window.current_chat_id
    window.rename_chat(chat_id, "Renamed")
    assert window.chat_list.item(0).text() == "Renamed"
    assert window.delete_chat(chat_id)
    assert window.chat_list.count() == 0
    assert window.current_chat_id is None
    assert window.history.messages(chat_id) == []


def test_failed_load_is_shown_and_the_window_keeps_working(qtbot, make_window, run) -> None:
    backend = FakeBackend(fail_load=EngineError(ErrorCode.LOAD_FAILED, "no config.json in /models/broken"))
    window = make_window(backend, load=False)
    result = run(window.load_model("/models/broken", remember=True))

    assert not result.ok
    assert "no config.json in /models/broken" in window.status_label.text()
    assert window.status_label.property("error") is True
    # A notice above the chat, not a line inside the conversation.
    assert window.notice_bar.isVisible() and "no config.json in /models/broken" in window.notice_label.text()
    assert window.chat_view.toPlainText().strip() == ""
    assert window.settings.last_model is None  # a failed model is not remembered
    assert window.open_model_action.isEnabled()

    # No model: Send is off and Enter sends nothing (the text stays); the window says how to load one.
    assert not window.send_button.isEnabled() and window.no_model_bar.isVisible()
    type_and_enter(qtbot, window, "anyone there?")
    run(window.wait_idle())
    assert not window.busy and backend.generate_requests == [] and window.history.list_chats() == []
    assert window.composer.toPlainText() == "anyone there?"
    assert (
        "No model is loaded" in window.status_label.text()
        and "File > Open model" in window.status_label.text()
    )
    window.composer.clear()

    backend.fail_load = None
    assert run(window.load_model("/models/good", remember=True)).ok
    assert window.settings.last_model == "/models/good"
    assert window.status_label.property("error") is False
    assert not window.notice_bar.isVisible()  # the load that worked ends the failure's notice
    type_and_enter(qtbot, window, "now?")
    run(window.wait_idle())
    assert "I am a fake model." in window.chat_view.toPlainText()


def test_failed_generation_is_shown_and_sending_again_works(qtbot, make_window, run) -> None:
    backend = FakeBackend(
        reply="partial answer that breaks",
        batch_chars=4,
        fail_generate=EngineError(ErrorCode.DECODE_FAILED, "CUDA error: device-side assert"),
        fail_after_batches=2,
    )
    window = make_window(backend)
    type_and_enter(qtbot, window, "break please")
    run(window.wait_idle())

    shown = window.chat_view.toPlainText()
    assert "partial " in shown  # what streamed before the failure stays
    assert "Generation failed: CUDA error: device-side assert" in shown
    assert "CUDA error" in window.status_label.text() and window.status_label.property("error")
    answer = window.history.messages(window.current_chat_id)[-1]
    assert answer.content == "partial " and not answer.finished
    assert answer.stats is not None and answer.stats["error"]["code"] == "decode_failed"

    backend.fail_generate = None
    backend.replies = ["Recovered fine."]
    type_and_enter(qtbot, window, "again")
    run(window.wait_idle())
    assert "Recovered fine." in window.chat_view.toPlainText()
    assert "Generation failed" in window.chat_view.toPlainText()  # the earlier note stays in place


def test_message_sent_while_loading_waits_for_the_model(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["Loaded and answering."])
    window = make_window(backend, load=False)
    window.start_load("/models/slow")
    type_and_enter(qtbot, window, "quick question")
    run(window.wait_idle())
    assert [r.path for r in backend.load_requests] == ["/models/slow"]
    assert "Loaded and answering." in window.chat_view.toPlainText()


def test_code_blocks_are_highlighted(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(replies=[CODE_REPLY]))
    type_and_enter(qtbot, window, "show me code")
    run(window.wait_idle())
    assert "def add(a, b):" in window.chat_view.toPlainText()
    assert "```" not in window.chat_view.toPlainText()
    html = window.chat_view.toHtml()
    # pygments colours survive into the document: keywords and names get different colours.
    colours = {part.split(";")[0] for part in html.split("color:")[1:]}
    assert len(colours) >= 3


def test_ctrl_q_closes_the_window(qtbot, make_window) -> None:
    window = make_window(FakeBackend())
    assert QApplication.activeWindow() is window
    qtbot.keyClick(window.composer, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    assert not window.isVisible()
