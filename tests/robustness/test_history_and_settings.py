"""Damaged or hand-broken user files, and a second window: nothing the user had is lost or
overwritten, and what went wrong stays on screen until the user has read it."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from ds4desk.app import open_history, run_app
from ds4desk.history import History
from ds4desk.paths import DataDirs
from ds4desk.settings import Settings
from tests.ui.fake_backend import FakeBackend

PAGE = 4096


def _history_with_pages(path: Path, chats: int = 40) -> list[str]:
    """A history several pages long; returns every message's text."""
    texts: list[str] = []
    with History(path) as history:
        for n in range(chats):
            chat = history.create_chat()
            for role in ("user", "assistant"):
                text = f"{role} {n}: " + "words " * 200
                history.add_message(chat.id, role, text)
                texts.append(text)
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the main file
    raw.close()
    return texts


def _damage_page(path: Path, page: int) -> None:
    with path.open("r+b") as f:
        f.seek(page * PAGE)
        f.write(bytes(range(256)) * (PAGE // 256))


def test_a_damaged_page_sets_the_history_aside_instead_of_failing_later(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    _history_with_pages(path)
    pages = path.stat().st_size // PAGE
    assert pages > 8
    _damage_page(path, pages // 2)
    original = path.read_bytes()

    history, problem = open_history(path)
    with history:
        assert problem is not None and "damaged" in problem
        assert history.list_chats() == []  # a fresh history: every read and write works
        chat = history.create_chat()
        history.add_message(chat.id, "user", "hello again")
        assert history.damage() is None
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("history.sqlite3.broken-")]
    assert kept.read_bytes() == original  # the damaged file is kept as it was, for recovery


def test_a_healthy_history_is_opened_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    texts = _history_with_pages(path, chats=5)
    history, problem = open_history(path)
    with history:
        assert problem is None
        assert sorted(m.content for c in history.list_chats() for m in history.messages(c.id)) == sorted(
            texts
        )


def test_a_settings_file_with_a_stray_comma_is_kept_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    mine = Settings(system_prompt="You are terse.", temperature=0.2, recent_models=["/m/a", "/m/b"])
    text = json.dumps(mine.to_json(), indent=2)
    broken = text.replace('"temperature": 0.2', '"temperature": 0.2,')  # one stray comma
    assert broken != text
    path.write_text(broken)

    opened = Settings.load_checked(path)
    assert opened.problem is not None and "settings.json.broken-" in opened.problem
    assert opened.writable and opened.settings == Settings()
    opened.settings.temperature = 0.9
    opened.settings.save(path)  # the first change after the start
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("settings.json.broken-")]
    assert kept.read_text() == broken  # the system prompt, sampling and recent models are still there


def test_settings_values_are_bounded_where_they_are_read(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    values: dict[str, Any] = {
        "snapshot_slots": 10**8,
        "snapshot_memory_mb": 10**12,
        "context": 10**12,
        "max_new_tokens": 2**40,
        "idle_park_minutes": 1e308,
        "system_prompt": "kept",
    }
    path.write_text(json.dumps(values).replace("1e+308", "Infinity"))
    opened = Settings.load_checked(path)
    settings = opened.settings
    defaults = Settings()
    for key in ("snapshot_slots", "snapshot_memory_mb", "context", "max_new_tokens", "idle_park_minutes"):
        assert getattr(settings, key) == getattr(defaults, key), key
    assert settings.system_prompt == "kept"
    assert opened.problem is not None and "snapshot_slots" in opened.problem
    # The file with the values that were dropped is copied aside before anything is saved over it.
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("settings.json.broken-")]
    assert json.loads(kept.read_text().replace("Infinity", "1e308"))["snapshot_slots"] == 10**8


def test_an_unreadable_settings_path_is_never_saved_over(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.mkdir()  # not a file at all: reading fails with an OSError
    opened = Settings.load_checked(path)
    assert not opened.writable and opened.problem is not None


def _data_dirs(root: Path) -> DataDirs:
    return DataDirs(config=root, data=root, cache=root / "cache")


def test_start_up_notices_stay_on_screen_until_dismissed(qapp: QApplication, tmp_path: Path) -> None:
    dirs = _data_dirs(tmp_path)
    dirs.settings_file.write_text('{"temperature": 0.2,}')
    dirs.history_db.write_bytes(b"not a database" * 300)
    backend = FakeBackend()
    seen: dict[str, Any] = {}

    def window() -> Any:
        # The shown one: windows of earlier tests in this process may linger hidden until collected.
        shown = QApplication.topLevelWidgets()
        return next(w for w in shown if w.windowTitle() == "ds4desk" and w.isVisible())

    def after_loaded(_result: object) -> None:
        # The load ran and set its own status lines; a few more event-loop turns go by.
        def look(turns_left: int) -> None:
            if turns_left:
                QTimer.singleShot(0, lambda: look(turns_left - 1))
                return
            w = window()
            seen["visible"] = w.notice_bar.isVisible()
            seen["text"] = w.notice_label.text()
            seen["status"] = w.status_label.text()
            w.notice_dismiss.click()
            seen["after_dismiss"] = w.notice_bar.isVisible()
            QTimer.singleShot(0, QApplication.closeAllWindows)

        look(5)

    backend.on_load = after_loaded
    assert run_app(dirs, backend_factory=lambda: backend) == 0
    assert seen["visible"] and "history was damaged" in seen["text"] and "settings file" in seen["text"]
    assert "history" not in seen["status"]  # the status line moved on; the notice did not
    assert seen["after_dismiss"] is False


def test_a_second_window_leaves_the_first_ones_undo_alone(make_window: Callable[..., Any], loop: Any) -> None:
    first = make_window()
    with_chat = first.history.create_chat("keep me")
    first.history.add_message(with_chat.id, "user", "precious")
    first.sidebar.refresh()
    first.delete_chat(with_chat.id)
    assert first.sidebar.pending_delete == with_chat.id

    second = make_window()  # opens the same history while the first one's undo is pending
    assert second.history.get_chat(with_chat.id) is None  # hidden there too
    second.history.close()  # a second window closing does not purge it either
    assert first.sidebar.undo_delete() == with_chat.id
    assert [m.content for m in first.history.messages(with_chat.id)] == ["precious"]
