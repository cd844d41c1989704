"""What app.py does for the bundle: the window icon, and the "window visible" line for the smoke test."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication

from ds4desk.app import REPORT_VISIBLE_ENV, VISIBLE_MARKER, app_icon, run_app
from ds4desk.paths import DataDirs
from tests.ui.fake_backend import FakeBackend

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
ICON_SVG = Path(__file__).resolve().parents[2] / "ds4desk" / "assets" / "ds4desk.svg"
ICON_PNG = ICON_SVG.with_suffix(".png")  # committed: the app and the bundle need no SVG plugin
SAFETY_CLOSE_MS = 30_000  # only so that a broken hook fails the test instead of hanging it

# Qt's raster engine antialiases edges through CPU-specific code paths, so the same SVG renders a
# few edge pixels one level apart on different x86-64 CPUs (22 of 65,536 pixels, all by 1 level,
# between the Intel Xeon that rendered the committed PNG and an AMD EPYC). A render counts as the
# same icon when no channel of any pixel is more than MAX_LEVELS apart and at most
# MAX_DIFFERING_FRACTION of the pixels differ at all. Real edits are far outside that: one dot moved
# by 1 px moves 166 pixels by up to 105 levels, a dot's opacity 0.5 -> 0.55 moves 686 pixels by up to
# 10, the tile's top colour 3 levels bluer moves 26,033 pixels by up to 21 (the last test checks them).
MAX_LEVELS = 2
MAX_DIFFERING_FRACTION = 0.01


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
    # Stopped once the app returns: left running, it would close a later test's window mid-test.
    safety = QTimer(singleShot=True, interval=SAFETY_CLOSE_MS)
    safety.timeout.connect(QApplication.closeAllWindows)
    safety.start()
    dirs = DataDirs(config=tmp_path, data=tmp_path, cache=tmp_path / "cache")
    try:
        code = run_app(dirs, "/models/m", "cpu", backend_factory=lambda: backend)
    finally:
        safety.stop()
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


def _render_icon(svg: Path, png: Path) -> QImage:
    """packaging/render_icon.py's render of `svg`, as the committed PNG was made."""
    sys.path.insert(0, str(PACKAGING))
    try:
        import render_icon
    finally:
        sys.path.remove(str(PACKAGING))
    render_icon.render(svg, png)
    return QImage(str(png))


def _channels(image: QImage) -> np.ndarray:
    """[height, width, 4] 8-bit channels, straight (not premultiplied) alpha."""
    argb = image.convertToFormat(QImage.Format.Format_ARGB32)
    rows = np.frombuffer(bytes(argb.constBits()), dtype=np.uint8).reshape(argb.height(), argb.bytesPerLine())
    return rows[:, : argb.width() * 4].reshape(argb.height(), argb.width(), 4)


def icon_differences(fresh: QImage, committed: QImage) -> list[str]:
    """Why `fresh` is not `committed` within the tolerance above (empty: the same icon)."""
    if fresh.size() != committed.size():
        return [f"size {fresh.size().toTuple()} != {committed.size().toTuple()}"]
    levels = np.abs(_channels(fresh).astype(np.int16) - _channels(committed).astype(np.int16)).max(axis=2)
    differing = int(np.count_nonzero(levels))
    problems = []
    if int(levels.max()) > MAX_LEVELS:
        problems.append(f"a channel differs by {int(levels.max())} levels (at most {MAX_LEVELS})")
    if differing > MAX_DIFFERING_FRACTION * levels.size:
        problems.append(f"{differing} of {levels.size} pixels differ (at most {MAX_DIFFERING_FRACTION:.0%})")
    return problems


def test_icon_png_is_the_render_of_the_svg(qapp: QApplication, tmp_path: Path) -> None:
    # packaging/render_icon.py made the committed PNG; a changed SVG needs a new render.
    committed = QImage(str(ICON_PNG))
    assert not committed.isNull()
    fresh = _render_icon(ICON_SVG, tmp_path / "fresh.png")
    assert icon_differences(fresh, committed) == []
    assert app_icon().availableSizes()  # the icon the window gets loads from that PNG


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('<circle cx="168"', '<circle cx="169"'),  # the last dot moved by one pixel
        ('fill-opacity="0.5"', 'fill-opacity="0.55"'),  # the last dot a little darker
        ("#3b82f6", "#3b82f9"),  # the tile's top colour, 3 levels bluer
    ],
)
def test_the_icon_tolerance_still_tells_a_different_icon(
    qapp: QApplication, tmp_path: Path, old: str, new: str
) -> None:
    source = ICON_SVG.read_text(encoding="utf-8")
    assert old in source
    edited = tmp_path / "edited.svg"
    edited.write_text(source.replace(old, new), encoding="utf-8")
    rendered = _render_icon(edited, tmp_path / "edited.png")
    assert icon_differences(rendered, QImage(str(ICON_PNG))) != []
