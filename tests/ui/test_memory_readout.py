"""The memory readout: one figure, what the engine holds for the model, the same quantity Park reports
freeing; 0 with no model; on the CPU one figure (no "allocated" beside an equal "reserved"). Against
FakeBackend for the window's wiring, and against the real engine thread with the embedded SmolLM2 on
the CPU for the meaning."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
import torch
from PySide6.QtCore import Qt

from ds4desk.engine import Engine, EngineClient
from ds4desk.engine.api import MemoryStats, ParkResult
from ds4desk.engine.memory import bytes_held, process_rss, read_memory
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.stats_format import format_bytes, memory_details, memory_text
from tests.ui.fake_backend import FakeBackend

FIGURE = re.compile(r"\d[\d.,]* [kMG]?B\b")


def park(qtbot: Any, run: Any, window: MainWindow) -> ParkResult:
    assert window.park_button.isEnabled()
    qtbot.mouseClick(window.park_button, Qt.MouseButton.LeftButton)
    assert window.park_controls.task is not None
    return run(window.park_controls.task)


def test_the_cpu_reading_is_one_figure_and_zero_without_a_model() -> None:
    stats = read_memory(None)  # no model loaded: the engine holds nothing
    assert stats.device == "cpu" and stats.allocated == 0
    assert stats.reserved > 0 and abs(stats.reserved - process_rss()) < 256 * 2**20  # the process, apart
    text = memory_text(stats)
    assert text.startswith("model 0 B")
    assert "reserved" not in text and "allocated" not in text
    assert len(FIGURE.findall(text)) == 1  # the model's figure, nothing beside it
    assert "process RSS" in memory_details(stats)  # shown, but named for what it is
    held = read_memory(None, held=123_456_789)
    assert held.allocated == 123_456_789 and memory_text(held).startswith("model 123 MB")


def test_what_a_model_holds_on_the_cpu_is_the_engine_s_count() -> None:
    assert bytes_held([torch.device("cpu")], 96_000_000) == 96_000_000
    assert bytes_held([], 0) == 0


def test_the_window_s_readout_drops_by_what_park_reports(qtbot, make_window, run) -> None:
    backend = FakeBackend(park_bytes=727_000_000)
    window = make_window(backend)
    run(window.wait_idle())
    readout = window.park_readout
    assert readout.stats is not None
    before = readout.stats.allocated
    result = park(qtbot, run, window)
    assert readout.stats is not None and before - readout.stats.allocated == result.bytes
    assert f"freed {format_bytes(result.bytes)}" in window.status_label.text()
    assert readout.memory_label.text().startswith("model 0 B")


def test_no_model_shows_zero(make_window, run) -> None:
    window = make_window(FakeBackend(), load=False)
    window.refresh_memory()
    run(window.wait_idle())
    assert window.park_readout.memory_label.text().startswith("model 0 B")


# ---- the real engine --------------------------------------------------------------------------

REAL = Settings(temperature=0.0, max_new_tokens=8, context=512, chunk=64, device="cpu")


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


def test_real_engine_readout_drops_by_what_park_freed(qtbot, run, real_window: MainWindow) -> None:
    window = real_window
    engine: Engine = window.backend.engine  # type: ignore[attr-defined]
    window.refresh_memory()
    run(window.wait_idle())
    readout = window.park_readout
    assert readout.stats is not None and readout.stats.allocated == 0  # nothing loaded yet
    assert readout.memory_label.text().startswith("model 0 B")

    assert run(window.load_model()).ok
    window.refresh_memory()
    run(window.wait_idle())
    loaded = engine._loaded
    assert loaded is not None
    weights_and_cache = loaded.info.weight_bytes + loaded.runtime.model.cache_bytes()
    shown: MemoryStats | None = readout.stats
    assert shown is not None and shown.allocated == weights_and_cache > 0
    assert readout.memory_label.text() == f"model {format_bytes(weights_and_cache)}"
    del loaded

    result = park(qtbot, run, window)
    assert result.ok and result.bytes > 0
    assert readout.stats is not None and shown.allocated - readout.stats.allocated == result.bytes
    assert readout.stats.allocated == 0 and readout.memory_label.text().startswith("model 0 B")
    assert f"freed {format_bytes(result.bytes)}" in window.status_label.text()
    # The dock's chart got the same reading: its last point is the readout's figure.
    assert window.perf_panel.memory_chart.values()[-1] == readout.stats.allocated
