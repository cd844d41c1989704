"""The snapshot-slot dock and the park row's memory readout and idle countdown, on the real qasync loop:
against FakeBackend for every button, and against the real engine thread with the embedded model for
the two-turn chat."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import Qt

from ds4desk.engine import Engine, EngineClient
from ds4desk.engine.api import EngineError, ErrorCode
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.park_readout import format_countdown
from ds4desk.ui.slot_panel import COLUMNS, SlotPanel, format_age
from tests.ui.fake_backend import FakeBackend
from tests.ui.test_main_window import type_and_enter

CHAT, TOKENS, HITS, PINNED, ON_DISK = (
    COLUMNS.index(c) for c in ("Chat", "Tokens", "Hits", "Pinned", "On disk")
)


def click(qtbot: Any, button: Any) -> None:
    assert button.isEnabled(), button.text()
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


def settle(run: Any, window: MainWindow) -> None:
    run(window.wait_idle())
    run(window.slot_panel.wait_idle())


def two_turns(qtbot: Any, run: Any, window: MainWindow) -> int:
    type_and_enter(qtbot, window, "What is the capital of France?")
    run(window.wait_idle())
    type_and_enter(qtbot, window, "And of Germany?")
    run(window.wait_idle())
    chats = window.history.list_chats()
    assert len(chats) == 1
    return chats[0].id


def open_slots(run: Any, window: MainWindow) -> SlotPanel:
    window.slot_dock_action.trigger()
    assert window.slot_dock.isVisible()
    settle(run, window)  # showing the dock lists the slots
    return window.slot_panel


def test_the_slot_dock_lists_a_chat_s_two_turns(qtbot, make_window, run) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    chat_id = two_turns(qtbot, run, window)
    assert [r.save_snapshot.tag for r in backend.generate_requests] == [str(chat_id)] * 2  # type: ignore[union-attr]

    panel = open_slots(run, window)
    rows = panel.row_texts()
    title = window.history.get_chat(chat_id).title  # type: ignore[union-attr]
    assert len(rows) == 2 and title
    assert [row[CHAT] for row in rows] == [title, title]
    assert [row[HITS] for row in rows] == ["1", "0"]  # the second turn continued from the first
    assert int(rows[1][TOKENS]) > int(rows[0][TOKENS])
    assert "2 snapshot slots in use" in panel.status.text()

    # Another answer while the dock is shown refreshes it by itself.
    type_and_enter(qtbot, window, "And of Spain?")
    settle(run, window)
    assert len(panel.row_texts()) == 3


def test_pin_save_free_and_load_from_the_buttons(
    qtbot, make_window, run, db_path: Path, tmp_path: Path
) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    two_turns(qtbot, run, window)
    panel = open_slots(run, window)
    assert panel.snapshot_dir == db_path.parent / "snapshots"  # in the data dir, beside the history
    assert not panel.free_button.isEnabled()  # nothing selected yet
    panel.select_slot(1)
    assert panel.selected() is not None and panel.selected().slot == 1  # type: ignore[union-attr]

    click(qtbot, panel.pin_button)
    assert not panel.pin_button.isEnabled()  # one action at a time
    run(panel.wait_idle())
    assert panel.row_texts()[1][PINNED] == "yes" and panel.pin_button.text() == "Unpin"
    click(qtbot, panel.pin_button)
    run(panel.wait_idle())
    assert panel.row_texts()[1][PINNED] == "no" and panel.pin_button.text() == "Pin"

    click(qtbot, panel.save_button)
    run(panel.wait_idle())
    saved = list((tmp_path / "snapshots").glob("*.safetensors"))
    assert len(saved) == 1 and saved[0].name.startswith("slot1-chat")
    assert panel.row_texts()[1][ON_DISK] == saved[0].name
    assert str(saved[0]) in panel.status.text()

    click(qtbot, panel.free_button)
    run(panel.wait_idle())
    assert len(panel.row_texts()) == 1 and backend.slot_calls[-1][:2] == ("free", 1)

    run(panel.load_from(saved[0]))  # type: ignore[arg-type]
    rows = panel.row_texts()
    assert len(rows) == 2 and rows[1][ON_DISK] == saved[0].name
    assert f"Loaded {saved[0].name}" in panel.status.text()

    broken = tmp_path / "broken.safetensors"
    broken.write_text("not a snapshot")
    run(panel.load_from(broken))  # type: ignore[arg-type]
    assert "broken.safetensors" in panel.status.text() and "Could not load" in panel.status.text()
    settle(run, window)
    assert len(panel.row_texts()) == 2  # nothing lost


def test_slot_failures_are_shown_not_raised(qtbot, make_window, run) -> None:
    backend = FakeBackend()
    window = make_window(backend, load=False)
    panel = open_slots(run, window)
    assert panel.row_texts() == [] and "No model loaded" in panel.status.text()

    run(window.load_model())
    backend.fail_slots = EngineError(ErrorCode.INVALID_SNAPSHOT_SLOT, "the snapshot store is broken")
    run(panel.refresh())  # type: ignore[arg-type]
    assert "the snapshot store is broken" in panel.status.text()
    assert panel.refresh_button.isEnabled()  # the panel keeps working


def test_park_row_shows_memory_after_each_action(qtbot, make_window, run) -> None:
    backend = FakeBackend(park_bytes=4_400_000_000)
    window = make_window(backend)
    settle(run, window)
    label = window.park_readout.memory_label
    assert label.text() == "model 4.40 GB"  # after the load
    assert "allocator reserved 4.50 GB" in label.toolTip()  # the other figures, each named
    assert "free 75.50 GB of 80.00 GB" in label.toolTip()

    click(qtbot, window.park_button)
    run(window.park_controls.task)  # type: ignore[arg-type]
    assert label.text() == "model 0 B" and "free 80.00 GB" in label.toolTip()
    click(qtbot, window.unpark_button)
    run(window.park_controls.task)  # type: ignore[arg-type]
    assert label.text().startswith("model 4.40 GB")
    assert label.accessibleName() and window.park_readout.countdown_label.text() == ""  # auto-park off


def test_idle_park_countdown(qtbot, make_window, run) -> None:
    backend = FakeBackend()
    window = make_window(backend, settings=Settings(idle_park_minutes=5))
    readout = window.park_readout
    settle(run, window)
    assert readout.counting and readout.deadline is not None
    assert readout.countdown_label.text() in ("auto-park in 5:00", "auto-park in 4:59")
    readout.tick(now=readout.deadline - 61.5)
    assert readout.countdown_label.text() == "auto-park in 1:02"

    # Answering stops it; the end of the answer starts it again from the whole idle time.
    while_answering: list[tuple[bool, str]] = []
    backend.after_batch = lambda: while_answering.append((readout.counting, readout.countdown_label.text()))
    type_and_enter(qtbot, window, "Hello")
    settle(run, window)
    assert while_answering and set(while_answering) == {(False, "")}
    assert readout.counting and readout.deadline is not None

    # The engine's own number wins when a memory reading carries one.
    backend.idle_park_in_s = 42.0
    window.refresh_memory()
    settle(run, window)
    readout.tick(now=readout.deadline - 42.0)
    assert readout.countdown_label.text() == "auto-park in 0:42"

    # Run out: the window asks the backend again (the engine parks by itself) and stops counting.
    calls = backend.memory_calls
    backend._parked = True  # what the engine's idle park did meanwhile
    readout.tick(now=readout.deadline + 1)
    assert readout.countdown_label.text() == "auto-parking…"
    settle(run, window)
    assert backend.memory_calls == calls + 1
    assert window.model_label.text().endswith("(parked)") and not readout.counting


def test_pinned_and_on_disk_say_no_and_the_age_ticks_while_shown(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend())
    two_turns(qtbot, run, window)
    panel = open_slots(run, window)
    assert [row[PINNED] for row in panel.row_texts()] == ["no", "no"]
    assert [row[ON_DISK] for row in panel.row_texts()] == ["no", "no"]
    age = COLUMNS.index("Age")
    listed = [format_age(info.age_s) for info in panel.slots]
    assert [row[age] for row in panel.row_texts()] == listed
    assert panel.ticking  # shown: the ages move
    panel.tick_ages(now=panel.listed_at + 125)  # what the timer does, two minutes on
    assert [row[age] for row in panel.row_texts()] == [format_age(i.age_s + 125) for i in panel.slots]
    assert all(text.endswith("min") for text in [row[age] for row in panel.row_texts()])
    # The real timer: within a few seconds a 0 s age becomes at least 1 s.
    panel.show_slots([replace(info, age_s=0.0) for info in panel.slots])
    qtbot.waitUntil(lambda: panel.row_texts()[0][age] != "0 s", timeout=5000)
    window.slot_dock_action.trigger()
    assert not panel.ticking  # hidden: no work


def test_the_slot_panel_fits_a_narrow_dock(qtbot) -> None:
    panel = SlotPanel(FakeBackend())
    qtbot.addWidget(panel)
    assert panel.minimumSizeHint().width() <= 320  # the table scrolls; the buttons take two rows
    assert COLUMNS[-1] == "Chat"  # the title takes what the numbers leave


def test_small_formatters() -> None:
    assert [format_countdown(s) for s in (300, 272.2, 0.2, 0, -3)] == ["5:00", "4:33", "0:01", "0:00", "0:00"]
    assert [format_age(s) for s in (5, 125, 7_380)] == ["5 s", "2 min", "2 h 03 min"]


# ---- the real engine --------------------------------------------------------------------------

REAL = Settings(temperature=0.0, max_new_tokens=8, context=1024, chunk=64, device="cpu")


@pytest.fixture
def real_window(qtbot: Any, loop: Any, tmp_path: Path) -> Iterator[MainWindow]:
    engine = Engine()
    history = History(tmp_path / "history.sqlite3")
    window = MainWindow(EngineClient(engine), history, REAL)
    window.show()
    qtbot.waitExposed(window)
    yield window
    window.close()
    loop.run_until_complete(window.wait_idle())
    shiboken6.delete(window)
    history.close()
    engine.close()


def test_real_engine_slots_after_two_turns(qtbot, run, real_window: MainWindow, tmp_path: Path) -> None:
    window = real_window
    assert run(window.load_model()).ok
    chat_id = two_turns(qtbot, run, window)
    panel = open_slots(run, window)
    assert len(panel.slots) == 2
    first, second = panel.slots
    assert first.tag == second.tag == str(chat_id)
    assert first.hits == 1 and second.hits == 0  # the follow-up continued from the first turn
    assert second.tokens > first.tokens > 10 and first.bytes > 0
    title = window.history.get_chat(chat_id).title  # type: ignore[union-attr]
    assert [row[CHAT] for row in panel.row_texts()] == [title, title]
    # The answer's footer and the slot agree on what was reused.
    follow_up = window.history.messages(chat_id)[-1]
    assert follow_up.stats is not None and follow_up.stats["reused_tokens"] == first.tokens

    memory = window.park_readout.memory_label.text()
    assert memory.startswith("model ") and "free " in window.park_readout.memory_label.toolTip()

    panel.snapshot_dir = tmp_path / "snaps"
    panel.select_slot(second.slot)
    click(qtbot, panel.save_button)
    run(panel.wait_idle())
    saved = Path(panel.slots[1].path or "")
    assert saved.is_file()
    click(qtbot, panel.free_button)
    run(panel.wait_idle())
    assert [s.slot for s in panel.slots] == [first.slot]
    run(panel.load_from(saved))  # type: ignore[arg-type]
    assert len(panel.slots) == 2
    back = panel.slots[1]
    assert (back.tag, back.tokens, back.path) == (str(chat_id), second.tokens, str(saved))
