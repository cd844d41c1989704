"""run_app end to end with FakeBackend, and the crash hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from ds4desk.app import CrashLog, UnavailableBackend, open_history, run_app
from ds4desk.engine.api import LoadRequest
from ds4desk.history import History
from ds4desk.paths import DataDirs
from ds4desk.settings import Settings
from ds4desk.ui.backend import ChatBackend
from tests.ui.fake_backend import FakeBackend


def data_dirs(root: Path) -> DataDirs:
    return DataDirs(config=root, data=root, cache=root / "cache")


def test_run_app_shows_the_window_then_loads(qapp: QApplication, tmp_path: Path) -> None:
    dirs = data_dirs(tmp_path)
    Settings(last_model="/models/from-settings").save(dirs.settings_file)
    backend = FakeBackend()
    seen: dict[str, object] = {}

    def on_load(result) -> None:
        windows = [
            w for w in QApplication.topLevelWidgets() if w.isVisible() and w.windowTitle() == "ds4desk"
        ]
        seen["visible_during_load"] = bool(windows)
        seen["status"] = windows[0].status_label.text() if windows else ""
        QTimer.singleShot(0, QApplication.closeAllWindows)

    backend.on_load = on_load
    hook_before = sys.excepthook
    code = run_app(dirs, "/models/cli", "cpu", backend_factory=lambda: backend)

    assert code == 0
    assert seen["visible_during_load"] is True
    # The first load says what it loads, and why it may take a while (it starts the engine).
    assert str(seen["status"]).startswith("Loading cli…") and "starts the engine" in str(seen["status"])
    (request,) = backend.load_requests
    assert (request.path, request.device) == ("/models/cli", "cpu")
    assert sys.excepthook is hook_before
    assert dirs.crash_log.exists() and dirs.history_db.exists()
    # CLI overrides are for the session: the stored settings are untouched.
    assert Settings.load(dirs.settings_file).last_model == "/models/from-settings"


def test_run_app_survives_a_backend_that_cannot_start(qapp: QApplication, tmp_path: Path) -> None:
    def broken():
        raise OSError("no engine today")

    QTimer.singleShot(0, QApplication.closeAllWindows)
    assert run_app(data_dirs(tmp_path), backend_factory=broken) == 0
    assert "no engine today" in (tmp_path / "crash.log").read_text()


def test_unavailable_backend_answers_with_errors(loop) -> None:
    backend = UnavailableBackend("engine missing")
    assert isinstance(backend, ChatBackend)  # every method the window may call is there
    assert loop.run_until_complete(backend.load(LoadRequest())).error.detail == "engine missing"
    preview = loop.run_until_complete(backend.preview(LoadRequest(path="/m")))
    assert not preview.ok and preview.message == "engine missing"
    assert loop.run_until_complete(backend.slots()).error.detail == "engine missing"
    assert loop.run_until_complete(backend.memory()).total == 0


def test_crash_log_catches_and_reports(tmp_path: Path) -> None:
    log_path = tmp_path / "crash.log"
    reported: list[str] = []
    hook_before = sys.excepthook
    crash = CrashLog(log_path).install()
    crash.notify = reported.append
    try:
        try:
            raise ValueError("boom in a slot")
        except ValueError as exc:
            sys.excepthook(type(exc), exc, exc.__traceback__)

        thread = threading.Thread(target=lambda: 1 / 0, name="worker")
        thread.start()
        thread.join()
    finally:
        crash.uninstall()
    text = log_path.read_text()
    assert "ValueError: boom in a slot" in text and "Traceback" in text
    assert "thread worker" in text and "ZeroDivisionError" in text
    assert reported == ["ValueError: boom in a slot"]
    assert sys.excepthook is hook_before


def test_damaged_history_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    history, problem = open_history(path)
    with history:
        assert problem is not None and "damaged" in problem
        assert history.list_chats() == []
    assert any(p.name.startswith("history.sqlite3.broken-") for p in tmp_path.iterdir())
    with History(path) as reopened:
        assert reopened.list_chats() == []


def test_the_gui_side_never_imports_torch() -> None:
    code = (
        "import sys; import ds4desk.app, ds4desk.ui.main_window, ds4desk.history, ds4desk.settings; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('ds4desk.engine.runtime', "
        "'ds4desk.engine.models', 'ds4desk.engine.devices'))]; "
        "assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    )
