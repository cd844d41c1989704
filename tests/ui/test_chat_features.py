"""Chat features on the real qasync loop with FakeBackend and real SQLite: branches (regenerate,
edit and resend, the switcher), copy, thinking blocks, the sidebar (search, rename, delete with
undo), system prompt and presets, shortcuts, the theme, accessible names, and a restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import shiboken6
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractItemView,
    QApplication,
    QComboBox,
    QHeaderView,
    QLineEdit,
    QPlainTextEdit,
    QTextEdit,
    QWidget,
)

from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.theme import DARK_COLORS, LIGHT_COLORS
from tests.ui.chat_helpers import click_link, link_hrefs, type_and_enter
from tests.ui.fake_backend import FakeBackend

CODE_REPLY = "Sure:\n\n```python\ndef add(a, b):\n    return a < b\n```\n\nAnd:\n\n```\nls -la\n```\n"


def last_assistant_id(window: MainWindow) -> int:
    return [m.id for m in window.history.messages(window.current_chat_id) if m.role == "assistant"][-1]


# ---- branches ---------------------------------------------------------------------------------


def test_regenerate_makes_a_sibling_and_the_switcher_reaches_both(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["First answer.", "Second answer."])
    window = make_window(backend)
    type_and_enter(qtbot, window, "Question")
    run(window.wait_idle())
    first = last_assistant_id(window)

    click_link(qtbot, window.chat_view, f"action:regenerate/{first}")
    assert window.busy
    run(window.wait_idle())

    # The question is asked again, without the old answer in the prompt.
    assert backend.generate_requests[1].messages == [{"role": "user", "content": "Question"}]
    second = last_assistant_id(window)
    assert second != first
    thread = window.history.thread(window.current_chat_id)
    assert [i.message.content for i in thread] == ["Question", "Second answer."]
    assert thread[1].sibling_ids == [first, second]
    shown = window.chat_view.toPlainText()
    assert "Second answer." in shown and "First answer." not in shown and "2/2" in shown

    click_link(qtbot, window.chat_view, f"action:previous/{second}")
    shown = window.chat_view.toPlainText()
    assert "First answer." in shown and "Second answer." not in shown and "1/2" in shown
    assert window.history.messages(window.current_chat_id)[-1].id == first
    click_link(qtbot, window.chat_view, f"action:next/{first}")
    assert "Second answer." in window.chat_view.toPlainText()


def test_regenerate_link_only_on_the_last_answer(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(replies=["one", "two"]))
    type_and_enter(qtbot, window, "a")
    run(window.wait_idle())
    type_and_enter(qtbot, window, "b")
    run(window.wait_idle())
    regenerate = [h for h in link_hrefs(window.chat_view) if h.startswith("action:regenerate/")]
    assert regenerate == [f"action:regenerate/{last_assistant_id(window)}"]


def test_edit_and_resend_makes_a_branch_and_the_old_one_stays(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["A1", "A2", "A2 edited"])
    window = make_window(backend)
    type_and_enter(qtbot, window, "Q1")
    run(window.wait_idle())
    type_and_enter(qtbot, window, "Q2")
    run(window.wait_idle())
    q2 = window.history.messages(window.current_chat_id)[2]

    click_link(qtbot, window.chat_view, f"action:edit/{q2.id}")
    assert window.composer.editing == q2.id
    assert window.composer.toPlainText() == "Q2"
    assert window.composer.hasFocus()
    qtbot.keyClicks(window.composer, " rewritten")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    run(window.wait_idle())

    assert window.composer.editing is None and window.composer.toPlainText() == ""
    assert backend.generate_requests[-1].messages == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2 rewritten"},
    ]
    thread = window.history.thread(window.current_chat_id)
    assert [i.message.content for i in thread] == ["Q1", "A1", "Q2 rewritten", "A2 edited"]
    assert thread[2].sibling_ids[0] == q2.id and len(thread[2].sibling_ids) == 2
    shown = window.chat_view.toPlainText()
    assert "Q2 rewritten" in shown and "A2 edited" in shown and "2/2" in shown

    new_q2 = thread[2].message.id
    click_link(qtbot, window.chat_view, f"action:previous/{new_q2}")
    shown = window.chat_view.toPlainText()
    assert "A2" in shown and "A2 edited" not in shown and "Q2 rewritten" not in shown
    assert len(window.history.list_chats()) == 1


def test_esc_cancels_an_edit_and_nothing_is_sent(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["A1"])
    window = make_window(backend)
    type_and_enter(qtbot, window, "Q1")
    run(window.wait_idle())
    q1 = window.history.messages(window.current_chat_id)[0]
    window.edit_message(q1.id)
    assert window.composer.property("editing") is True
    qtbot.keyClick(window.composer, Qt.Key.Key_Escape)
    assert window.composer.editing is None and window.composer.toPlainText() == ""
    assert window.composer.property("editing") is False
    assert len(backend.generate_requests) == 1


def test_editing_the_first_message_branches_at_the_root(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["A", "B"])
    window = make_window(backend)
    type_and_enter(qtbot, window, "first")
    run(window.wait_idle())
    first = window.history.messages(window.current_chat_id)[0]
    window.edit_message(first.id)
    window.composer.setPlainText("first, better")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    run(window.wait_idle())
    assert backend.generate_requests[-1].messages == [{"role": "user", "content": "first, better"}]
    thread = window.history.thread(window.current_chat_id)
    assert thread[0].message.parent_id is None and thread[0].sibling_ids == [first.id, thread[0].message.id]


# ---- copy --------------------------------------------------------------------------------------


def test_copy_a_code_block_and_a_whole_message(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(replies=[CODE_REPLY]))
    type_and_enter(qtbot, window, "code please")
    run(window.wait_idle())
    answer = last_assistant_id(window)
    clipboard = QGuiApplication.clipboard()

    click_link(qtbot, window.chat_view, f"action:copy-code/{answer}/0")
    assert clipboard.text() == "def add(a, b):\n    return a < b"  # plain text, entities decoded
    click_link(qtbot, window.chat_view, f"action:copy-code/{answer}/1")
    assert clipboard.text() == "ls -la"
    click_link(qtbot, window.chat_view, f"action:copy/{answer}")
    assert clipboard.text() == CODE_REPLY.strip()
    user = window.history.messages(window.current_chat_id)[0]
    click_link(qtbot, window.chat_view, f"action:copy/{user.id}")
    assert clipboard.text() == "code please"
    # Links never navigate: the conversation is still there.
    assert "def add(a, b):" in window.chat_view.toPlainText()


# ---- thinking ----------------------------------------------------------------------------------


def test_thinking_is_folded_with_its_token_count(qtbot, make_window, run, db_path: Path) -> None:
    thought = "Let me add two and two carefully."
    reply = thought + "</think>The answer is 4."
    backend = FakeBackend(replies=[reply], batch_chars=5)
    window = make_window(backend, settings=Settings(thinking=True, thinking_budget_tokens=64))
    seen: list[str] = []
    backend.after_batch = lambda: seen.append(window.chat_view.toPlainText())
    type_and_enter(qtbot, window, "2+2?")
    run(window.wait_idle())

    request = backend.generate_requests[0]
    assert request.thinking and request.thinking_budget is not None
    assert request.thinking_budget.max_tokens == 64
    assert any("Thinking…" in text for text in seen[:3])  # open block while it streams
    # One fake token per batch; the batches up to and including the one with </think> count.
    thinking_batches = (len(thought) + len("</think>")) // 5 + 1
    answer = window.history.messages(window.current_chat_id)[-1]
    assert answer.content == "<think>" + reply
    assert answer.stats is not None and answer.stats["thinking_tokens"] == thinking_batches

    shown = window.chat_view.toPlainText()
    assert f"Thought for {thinking_batches} tokens" in shown
    assert "The answer is 4." in shown and thought not in shown  # folded

    click_link(qtbot, window.chat_view, f"action:toggle-think/{answer.id}")
    assert thought in window.chat_view.toPlainText()
    click_link(qtbot, window.chat_view, f"action:toggle-think/{answer.id}")
    assert thought not in window.chat_view.toPlainText()

    # The thinking is not sent back with the next question.
    backend.replies = ["ok</think>fine"]
    type_and_enter(qtbot, window, "thanks")
    run(window.wait_idle())
    assert backend.generate_requests[1].messages[1] == {"role": "assistant", "content": "The answer is 4."}


def test_no_thinking_means_no_budget_and_no_block(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["Plain answer."])
    window = make_window(backend, settings=Settings(thinking=False, thinking_budget_tokens=64))
    type_and_enter(qtbot, window, "hi")
    run(window.wait_idle())
    request = backend.generate_requests[0]
    assert not request.thinking and request.thinking_budget is None
    assert "Thought" not in window.chat_view.toPlainText()
    assert "thinking_tokens" not in (window.history.messages(window.current_chat_id)[-1].stats or {})


# ---- sidebar -----------------------------------------------------------------------------------


def test_search_filters_live_over_titles_and_text(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["Rust has ownership.", "Use pandas.", "50% off"])
    window = make_window(backend)
    for question in ("About Rust", "Python data", "discount?"):
        qtbot.mouseClick(window.new_chat_button, Qt.MouseButton.LeftButton)
        type_and_enter(qtbot, window, question)
        run(window.wait_idle())
    assert window.sidebar.titles() == ["discount?", "Python data", "About Rust"]

    qtbot.keyClick(window.composer, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert window.sidebar.search.hasFocus()
    qtbot.keyClicks(window.sidebar.search, "pandas")  # only in an answer's text
    assert window.sidebar.titles() == ["Python data"]
    window.sidebar.search.clear()
    qtbot.keyClicks(window.sidebar.search, "50%")
    assert window.sidebar.titles() == ["discount?"]
    window.sidebar.search.setText("5_%")
    assert window.sidebar.titles() == []
    window.sidebar.search.clear()
    assert len(window.sidebar.titles()) == 3

    window.composer.setFocus()
    qtbot.keyClick(window.composer, Qt.Key.Key_K, Qt.KeyboardModifier.ControlModifier)
    assert window.sidebar.search.hasFocus()


def test_rename_with_f2_and_double_click(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend())
    type_and_enter(qtbot, window, "original title")
    run(window.wait_idle())
    chat_id = window.current_chat_id
    lst = window.chat_list

    lst.setFocus()
    lst.setCurrentRow(0)
    qtbot.keyClick(lst, Qt.Key.Key_F2)
    editor = QApplication.focusWidget()
    assert isinstance(editor, QLineEdit) and editor.text() == "original title"
    editor.selectAll()
    qtbot.keyClicks(editor, "Renamed by F2")
    qtbot.keyClick(editor, Qt.Key.Key_Return)  # the delegate commits on the next loop pass
    qtbot.waitUntil(lambda: window.history.get_chat(chat_id).title == "Renamed by F2")
    assert window.sidebar.titles() == ["Renamed by F2"]

    rect = lst.visualItemRect(lst.item(0))
    qtbot.mousePress(lst.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())  # as a real double-click
    qtbot.mouseRelease(lst.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    qtbot.mouseDClick(lst.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    editor = QApplication.focusWidget()
    assert isinstance(editor, QLineEdit)
    editor.selectAll()
    qtbot.keyClicks(editor, "By double-click")
    qtbot.keyClick(editor, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.history.get_chat(chat_id).title == "By double-click")
    qtbot.waitUntil(lambda: window.chat_list.state() != QAbstractItemView.State.EditingState)

    # An empty title is refused: the stored one shows again.
    lst.setFocus()
    qtbot.keyClick(lst, Qt.Key.Key_F2)
    editor = QApplication.focusWidget()
    editor.selectAll()
    qtbot.keyClick(editor, Qt.Key.Key_Delete)
    qtbot.keyClick(editor, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.chat_list.state() != QAbstractItemView.State.EditingState)
    qtbot.waitUntil(lambda: window.sidebar.titles() == ["By double-click"])
    assert window.history.get_chat(chat_id).title == "By double-click"


def test_delete_with_undo_by_key_button_and_ctrl_z(qtbot, make_window, run, db_path: Path) -> None:
    window = make_window(FakeBackend(replies=["a", "b"]))
    type_and_enter(qtbot, window, "keep me")
    run(window.wait_idle())
    qtbot.mouseClick(window.new_chat_button, Qt.MouseButton.LeftButton)
    type_and_enter(qtbot, window, "delete me")
    run(window.wait_idle())
    doomed = window.current_chat_id

    window.chat_list.setFocus()
    qtbot.keyClick(window.chat_list, Qt.Key.Key_Delete)
    assert window.sidebar.titles() == ["keep me"]
    assert window.current_chat_id is None and window.chat_view.toPlainText().strip() == ""
    assert window.sidebar.undo_bar.isVisible() and "delete me" in window.sidebar.undo_label.text()
    assert window.history.get_chat(doomed) is None

    qtbot.mouseClick(window.sidebar.undo_button, Qt.MouseButton.LeftButton)
    assert window.sidebar.titles() == ["delete me", "keep me"]
    assert window.current_chat_id == doomed and "delete me" in window.chat_view.toPlainText()
    assert not window.sidebar.undo_bar.isVisible()

    window.delete_chat(doomed)
    window.chat_list.setFocus()
    qtbot.keyClick(window.chat_list, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert window.history.get_chat(doomed) is not None

    # When the undo window ends the chat is deleted for good.
    window.sidebar._undo_timer.setInterval(0)
    window.delete_chat(doomed)
    qtbot.waitUntil(lambda: window.sidebar.pending_delete is None)
    assert not window.sidebar.undo_bar.isVisible()
    assert window.sidebar.undo_delete() is None
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("SELECT COUNT(*) FROM chats WHERE id = ?", (doomed,)).fetchone()[0] == 0
    finally:
        raw.close()


def test_a_chat_being_answered_is_not_deleted(qtbot, make_window, run) -> None:
    backend = FakeBackend(reply="word " * 500, batch_chars=5)
    window = make_window(backend)
    refused: list[bool] = []

    def mid_answer() -> None:  # runs inside the loop, while the answer streams
        if backend.batches_sent == 3:
            refused.append(not window.delete_chat(window.current_chat_id))
            refused.append(window.status_label.property("error") is True)
            window.stop()

    backend.after_batch = mid_answer
    type_and_enter(qtbot, window, "long one")
    run(window.wait_idle())
    assert refused == [True, True]
    assert window.sidebar.titles() == ["long one"] and window.sidebar.pending_delete is None


# ---- system prompt, presets, shortcuts ---------------------------------------------------------


def test_system_prompt_is_edited_and_sent_first(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["ok"])
    window = make_window(backend)
    qtbot.mouseClick(window.chat_options.system_button, Qt.MouseButton.LeftButton)
    dialog = window.chat_options.prompt_dialog
    assert dialog is not None and dialog.isVisible()
    dialog.editor.setPlainText("")
    qtbot.keyClicks(dialog.editor, "Answer in French.")
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    assert window.settings.system_prompt == "Answer in French."
    assert "✓" in window.chat_options.system_button.text()

    type_and_enter(qtbot, window, "Hello")
    run(window.wait_idle())
    assert backend.generate_requests[0].messages[0] == {"role": "system", "content": "Answer in French."}


def test_presets_set_the_sampling(qtbot, make_window, run) -> None:
    backend = FakeBackend(replies=["x", "y"])
    window = make_window(backend)
    combo = window.chat_options.preset
    assert combo.currentText() == "Balanced"  # the defaults are the balanced preset

    combo.setCurrentIndex(combo.findData("Precise"))
    combo.activated.emit(combo.currentIndex())  # what a user's pick emits
    type_and_enter(qtbot, window, "one")
    run(window.wait_idle())
    assert backend.generate_requests[0].sampling.temperature == 0.0
    assert backend.generate_requests[0].sampling.greedy

    window.chat_options.apply_preset("Creative")
    type_and_enter(qtbot, window, "two")
    run(window.wait_idle())
    sampling = backend.generate_requests[1].sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 0.98)

    window.settings.temperature, window.settings.top_p = 0.33, 0.5
    window.chat_options.sync()
    assert combo.currentText().startswith("Custom (0.33")


def test_shortcuts_new_chat_stop_send_settings(qtbot, make_window, run) -> None:
    backend = FakeBackend(reply="word " * 500, batch_chars=5)
    window = make_window(backend)
    backend.after_batch = lambda: (
        qtbot.keyClick(window.composer, Qt.Key.Key_Escape) if backend.batches_sent == 3 else None
    )
    qtbot.keyClicks(window.composer, "ctrl enter sends")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert window.busy
    run(window.wait_idle())
    assert backend.cancelled == [backend.generate_requests[0].request_id]

    qtbot.keyClick(window.composer, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert window.current_chat_id is None and window.chat_view.toPlainText().strip() == ""

    qtbot.keyClick(window.composer, Qt.Key.Key_Comma, Qt.KeyboardModifier.ControlModifier)
    assert window.settings_dialog.isVisible()
    window.settings_dialog.reject()


# ---- theme and accessibility ---------------------------------------------------------------------


def test_dark_scheme_restyles_the_app_and_rerenders_the_chat(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(replies=[CODE_REPLY]))
    type_and_enter(qtbot, window, "code")
    run(window.wait_idle())
    app = QApplication.instance()
    before = window.chat_view.toPlainText()
    try:
        # The signal the system's switch emits (the offscreen platform has no scheme of its own).
        app.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Dark)
        assert window.chat_view.dark
        assert DARK_COLORS["window"] in app.styleSheet() and LIGHT_COLORS["sidebar"] not in app.styleSheet()
        html = window.chat_view.toHtml()
        assert "#1f2126" in html  # the dark answer bubble
        assert window.chat_view.toPlainText() == before  # same messages, same actions
        answer = last_assistant_id(window)
        click_link(qtbot, window.chat_view, f"action:copy-code/{answer}/1")
        assert QGuiApplication.clipboard().text() == "ls -la"

        app.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Light)
        assert not window.chat_view.dark and LIGHT_COLORS["sidebar"] in app.styleSheet()
        assert "#1f2126" not in window.chat_view.toHtml()
    finally:
        app.setStyleSheet("")


def _qt_internal(widget: QWidget) -> bool:
    """Parts Qt builds inside a control (a combo box's popup list, a spin box's line edit, a line
    edit's clear button, a dock's title buttons); screen readers reach them through their owner."""
    parent = widget.parent()
    owner = type(parent).__name__ if parent is not None else ""
    return (
        widget.objectName().startswith("qt_")
        or isinstance(widget, QHeaderView)  # a table's headers: the table is the control
        or owner in ("QComboBox", "QComboBoxPrivateContainer", "QSpinBox", "QDoubleSpinBox", "QLineEdit")
        or isinstance(parent, QComboBox)
        or (parent is not None and isinstance(parent.parent(), QComboBox))  # the popup's list
    )


def test_every_control_has_an_accessible_name(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(replies=["hi"]))
    type_and_enter(qtbot, window, "hello")
    run(window.wait_idle())
    window.open_settings()
    window.chat_options.edit_system_prompt()
    controls = (QAbstractButton, QLineEdit, QTextEdit, QPlainTextEdit, QComboBox, QAbstractItemView)
    checked: list[str] = []
    missing: list[str] = []
    roots: list[QWidget] = [window, window.settings_dialog, window.chat_options.prompt_dialog]
    for root in roots:
        for widget in [root, *root.findChildren(QWidget)]:
            # Every control, focusable or not: buttons kept out of the tab order are still read out.
            if not isinstance(widget, controls) or _qt_internal(widget):
                continue
            checked.append(type(widget).__name__)
            if not widget.accessibleName().strip():
                where = type(widget.parent()).__name__
                missing.append(
                    f"{type(widget).__name__} {widget.objectName()!r} in {where}: {widget.toolTip()!r}"
                )
    assert len(checked) >= 20
    assert missing == [], "\n".join(missing)
    window.settings_dialog.reject()
    window.chat_options.prompt_dialog.reject()


# ---- restart -----------------------------------------------------------------------------------


def test_branches_and_titles_survive_a_restart(qtbot, loop, db_path: Path) -> None:
    def open_window(backend: FakeBackend) -> tuple[MainWindow, History]:
        history = History(db_path)
        window = MainWindow(backend, history, Settings())
        window.chat_view.render_interval_ms = 0
        window.show()
        qtbot.waitExposed(window)
        loop.run_until_complete(window.load_model())
        return window, history

    def shut(window: MainWindow, history: History) -> None:
        window.close()
        loop.run_until_complete(window.wait_idle())
        shiboken6.delete(window)
        history.close()

    window, history = open_window(FakeBackend(replies=["old answer", "new answer"]))
    type_and_enter(qtbot, window, "question")
    loop.run_until_complete(window.wait_idle())
    window.regenerate()
    loop.run_until_complete(window.wait_idle())
    chat_id = window.current_chat_id
    window.rename_chat(chat_id, "Kept title")
    shut(window, history)

    window, history = open_window(FakeBackend())
    try:
        assert window.sidebar.titles() == ["Kept title"]
        window.open_chat(chat_id)
        shown = window.chat_view.toPlainText()
        assert "new answer" in shown and "2/2" in shown and "old answer" not in shown
        answer = last_assistant_id(window)
        click_link(qtbot, window.chat_view, f"action:previous/{answer}")
        assert "old answer" in window.chat_view.toPlainText()
    finally:
        shut(window, history)
    with History(db_path) as reopened:  # the switch to the old branch was stored too
        assert reopened.messages(chat_id)[-1].content == "old answer"
