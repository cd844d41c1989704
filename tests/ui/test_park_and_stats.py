"""Park / Unpark from the window, and the speed footer under each finished answer."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt

from ds4desk.engine.api import EngineError, ErrorCode
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.stats_format import format_bytes, stats_footer
from tests.ui.fake_backend import FakeBackend
from tests.ui.test_main_window import type_and_enter


def click(qtbot, button) -> None:
    assert button.isEnabled()
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


def finish(window: MainWindow, run) -> None:
    assert window.park_controls.task is not None
    run(window.park_controls.task)


def test_park_then_unpark_from_the_buttons(qtbot, make_window, run) -> None:
    backend = FakeBackend(park_bytes=4_400_000_000)
    window = make_window(backend)
    assert window.park_button.isEnabled() and not window.unpark_button.isEnabled()
    assert "(parked)" not in window.model_label.text()

    window.park_selector.setCurrentIndex(window.park_selector.findData("target"))
    click(qtbot, window.park_button)
    assert not window.park_button.isEnabled() and not window.unpark_button.isEnabled()  # in flight
    finish(window, run)
    assert backend.park_calls == [("park", "target")]
    assert window.model_label.text().endswith("(parked)")
    assert "freed 4.40 GB" in window.status_label.text()
    assert not window.park_button.isEnabled() and window.unpark_button.isEnabled()

    click(qtbot, window.unpark_button)
    finish(window, run)
    assert backend.park_calls[-1] == ("unpark", "target")
    assert "(parked)" not in window.model_label.text()
    assert "loaded 4.40 GB" in window.status_label.text()
    assert window.park_button.isEnabled() and not window.unpark_button.isEnabled()


def test_answering_a_parked_model_unparks_it(qtbot, make_window, run) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    click(qtbot, window.park_button)
    finish(window, run)
    assert window.unpark_button.isEnabled()

    type_and_enter(qtbot, window, "Hello")
    run(window.wait_idle())
    assert not backend.parked
    assert "(parked)" not in window.model_label.text()
    assert window.park_button.isEnabled() and not window.unpark_button.isEnabled()


def test_no_model_means_nothing_to_park(make_window) -> None:
    window = make_window(FakeBackend(), load=False)
    assert not window.park_button.isEnabled() and not window.unpark_button.isEnabled()


def test_failed_park_is_shown_and_the_window_keeps_working(qtbot, make_window, run) -> None:
    backend = FakeBackend(fail_park=EngineError(ErrorCode.OUT_OF_MEMORY, "could not move the weights"))
    window = make_window(backend)
    click(qtbot, window.park_button)
    finish(window, run)
    assert "could not move the weights" in window.status_label.text()
    assert window.status_label.property("error") is True
    assert window.park_button.isEnabled() and not window.unpark_button.isEnabled()
    assert "(parked)" not in window.model_label.text()

    backend.fail_park = None
    backend.raise_on_park = RuntimeError("backend bug")  # a backend that breaks its promise
    click(qtbot, window.park_button)
    finish(window, run)
    assert "backend bug" in window.status_label.text()
    assert window.park_button.isEnabled()

    type_and_enter(qtbot, window, "still there?")
    run(window.wait_idle())
    assert "fake" in window.chat_view.toPlainText()


def test_failed_unpark_keeps_the_model_parked(qtbot, make_window, run) -> None:
    backend = FakeBackend(fail_unpark=EngineError(ErrorCode.OUT_OF_MEMORY, "no room on the GPU"))
    window = make_window(backend)
    click(qtbot, window.park_button)
    finish(window, run)
    click(qtbot, window.unpark_button)
    finish(window, run)
    assert "no room on the GPU" in window.status_label.text()
    assert window.model_label.text().endswith("(parked)")
    assert window.unpark_button.isEnabled() and not window.park_button.isEnabled()


def test_format_bytes() -> None:
    assert format_bytes(4_400_000_000) == "4.40 GB"
    assert format_bytes(250_000_000) == "250 MB"
    assert format_bytes(0) == "0 B"


def test_stats_footer_leaves_out_what_was_not_measured() -> None:
    assert stats_footer(None) is None
    assert stats_footer({"finish_reason": "stop"}) is None
    footer = stats_footer(
        {
            "time_to_first_token_s": 0.25,
            "prefill_tok_s": 1234.5,
            "decode_tok_s": 31.44,
            "reused_tokens": 1812,
            "prompt_tokens": 1840,
        }
    )
    assert footer == (
        "first token 0.25 s  ·  prefill 1,234 tok/s  ·  decode 31.4 tok/s  ·  "
        "reused 1,812 of 1,840 prompt tokens"
    )


def test_answer_footer_shows_speed_and_reuse_also_after_a_restart(
    qtbot, make_window, run, db_path: Path
) -> None:
    backend = FakeBackend(reply="Short answer.", prompt_tokens=1840, reused_tokens=1812)
    window = make_window(backend)
    type_and_enter(qtbot, window, "Hello")
    run(window.wait_idle())
    shown = window.chat_view.toPlainText()
    assert "first token 0.05 s" in shown
    assert "prefill 560 tok/s" in shown  # 28 computed tokens in 0.05 s
    assert "decode" in shown and "tok/s" in shown
    assert "reused 1,812 of 1,840 prompt tokens" in shown
    chat_id = window.current_chat_id
    window.close()

    again = make_window(FakeBackend())
    assert chat_id is not None
    again.open_chat(chat_id)
    assert "reused 1,812 of 1,840 prompt tokens" in again.chat_view.toPlainText()
    assert "first token 0.05 s" in again.chat_view.toPlainText()


def test_no_reuse_means_no_reuse_note(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(reply="Short answer."))
    type_and_enter(qtbot, window, "Hello")
    run(window.wait_idle())
    shown = window.chat_view.toPlainText()
    assert "first token" in shown and "reused" not in shown
