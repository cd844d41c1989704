"""app.py gives the window a server over its own engine, and shuts it down before the engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from ds4desk.app import UnavailableBackend, WindowServer, local_server_for, run_app
from ds4desk.engine import Engine, EngineClient
from ds4desk.paths import DataDirs
from ds4desk.remote.switch import SwitchingBackend
from ds4desk.settings import Settings
from tests.ui.fake_backend import FakeBackend


def test_only_a_local_engine_can_be_served() -> None:
    engine = Engine()
    try:
        assert isinstance(local_server_for(EngineClient(engine)), WindowServer)
        switching = SwitchingBackend(EngineClient(engine), EngineClient)  # what the app's window has
        assert isinstance(local_server_for(switching), WindowServer)
    finally:
        engine.close()
    assert local_server_for(FakeBackend()) is None
    assert local_server_for(UnavailableBackend("the engine did not start")) is None


def get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_run_app_serves_as_saved_and_stops_before_the_engine(qapp: QApplication, tmp_path: Path) -> None:
    dirs = DataDirs(config=tmp_path, data=tmp_path, cache=tmp_path / "cache")
    # A model that is not there: the load fails at once, and the server answers without a model.
    Settings(serve_on_localhost=True, serve_port=0, last_model=str(tmp_path / "missing")).save(
        dirs.settings_file
    )
    engine = Engine()
    client = EngineClient(engine)
    seen: dict[str, object] = {}

    def look() -> None:
        # This run's window: the visible one (earlier tests' windows may linger, closed).
        windows = [w for w in QApplication.topLevelWidgets() if hasattr(w, "serve_control") and w.isVisible()]
        task = windows[0].serve_control.task if windows else None  # type: ignore[attr-defined]
        if task is None:  # nothing to look at: end the run, the asserts below say what is missing
            QTimer.singleShot(0, QApplication.closeAllWindows)
            return

        def served(_task: object) -> None:
            try:
                url = windows[0].serve_control.url  # type: ignore[attr-defined]
                seen["url"] = url
                seen["health"] = get(url.removesuffix("/v1") + "/health") if url else None
            finally:
                QTimer.singleShot(0, QApplication.closeAllWindows)

        task.add_done_callback(served)

    QTimer.singleShot(0, look)
    code = run_app(dirs, backend_factory=lambda: client, argv=[])
    assert code == 0
    url = seen["url"]
    assert isinstance(url, str) and url.startswith("http://127.0.0.1:")
    status, body = seen["health"]  # type: ignore[misc]
    assert status == 503 and body["status"] == "no_model"
    with pytest.raises(urllib.error.URLError):  # stopped with the window
        get(url.removesuffix("/v1") + "/health")
    with pytest.raises(RuntimeError, match="engine thread has stopped"):  # and the engine after it
        engine.submit_memory()
