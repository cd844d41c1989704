"""What app.py does for the bundle: the window icon, and the "window visible" line for the smoke test."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication

from ds4desk.app import REPORT_VISIBLE_ENV, VISIBLE_MARKER, app_icon, run_app
from ds4desk.paths import DataDirs
from tests.ui.fake_backend import FakeBackend

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
SAFETY_CLOSE_MS = 30_000  # only so that a broken hook fails the test instead of hanging it


def _visible_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(VISIBLE_MARKER)]


def _run_app_until_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], report: bool
) -> tuple[int, str, dict[str, object]]:
    """Runs the real app on FakeBackend; closes it once it reported visible (or once loaded, when
    not reporting). Returns the exit code, what it wrote to stderr and what was seen while it ran."""
    if report:
        monkeypatch.setenv(REPORT_VISIBLE_ENV, "1")
    else:
        monkeypatch.delenv(REPORT_VISIBLE_ENV, raising=False)
    stderr: list[str] = []  # fd-level capture: faulthandler needs a real stderr
    seen: dict[str, object] = {}
    backend = FakeBackend()
    loaded = False

    def on_load(_result) -> None:
        nonlocal loaded
        loaded = True
        seen["icon_null"] = QApplication.windowIcon().isNull()

    def poll() -> None:
        stderr.append(capfd.readouterr().err)
        if (_visible_lines("".join(stderr)) or not report) and loaded:
            QApplication.closeAllWindows()
        else:
            QTimer.singleShot(5, poll)

    backend.on_load = on_load
    QTimer.singleShot(0, poll)
    QTimer.singleShot(SAFETY_CLOSE_MS, QApplication.closeAllWindows)
    dirs = DataDirs(config=tmp_path, data=tmp_path, cache=tmp_path / "cache")
    code = run_app(dirs, "/models/m", "cpu", backend_factory=lambda: backend)
    stderr.append(capfd.readouterr().err)
    return code, "".join(stderr), seen


def test_the_window_reports_when_it_is_visible(
    qapp: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    before = time.time()
    code, stderr, seen = _run_app_until_visible(tmp_path, monkeypatch, capfd, report=True)
    after = time.time()

    assert code == 0
    (line,) = _visible_lines(stderr)  # once, not once per expose
    stamp = float(line.removeprefix(VISIBLE_MARKER))
    assert before <= stamp <= after
    assert seen["icon_null"] is False


def test_no_report_without_the_variable(
    qapp: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    code, stderr, _seen = _run_app_until_visible(tmp_path, monkeypatch, capfd, report=False)
    assert code == 0
    assert _visible_lines(stderr) == []


def test_icon_png_is_the_render_of_the_svg(qapp: QApplication, tmp_path: Path) -> None:
    # packaging/render_icon.py made the committed PNG; a changed SVG needs a new render.
    sys.path.insert(0, str(PACKAGING))
    try:
        import render_icon
    finally:
        sys.path.remove(str(PACKAGING))
    fresh = tmp_path / "fresh.png"
    render_icon.render(render_icon.ASSETS / "ds4desk.svg", fresh)
    committed = QImage(str(render_icon.ASSETS / "ds4desk.png"))
    assert not committed.isNull()
    assert QImage(str(fresh)) == committed
    assert app_icon().availableSizes()  # the icon the window gets loads from that PNG
