"""The Live speed dock inside the real window (FakeBackend, real qasync loop): the status bar, the
answer's footer and the chart show one figure for one answer; loading another model marks the
charts; the dock's own memory polling and the park row show the same reading."""

from __future__ import annotations

import re
from dataclasses import replace

from ds4desk.ui.stats_format import format_decode
from tests.ui.fake_backend import FakeBackend
from tests.ui.test_main_window import type_and_enter

DECODE = re.compile(r"([\d,]+\.\d) tok/s")


def test_status_bar_footer_and_chart_show_the_same_decode_speed(qtbot, make_window, run) -> None:
    window = make_window(FakeBackend(reply="word " * 40, batch_chars=5))
    window.perf_dock_action.trigger()
    type_and_enter(qtbot, window, "Talk")
    run(window.wait_idle())
    chart = window.perf_panel.decode_chart
    qtbot.waitUntil(lambda: chart.live is None and len(chart.values()) == 1)
    figure = format_decode(chart.values()[-1])
    status = DECODE.findall(window.speed_label.text())
    footer = DECODE.findall(window.chat_view.toPlainText().split("decode", 1)[-1])
    assert status and footer
    assert f"{status[0]} tok/s" == f"{footer[0]} tok/s" == figure
    assert f"last {figure}" in chart.label()


def test_loading_another_model_marks_the_charts(qtbot, make_window, run) -> None:
    backend = FakeBackend(reply="short answer")
    window = make_window(backend)
    type_and_enter(qtbot, window, "one")
    run(window.wait_idle())
    first = backend.model_info
    assert first is not None
    backend._info = replace(first, name="other-model")  # another model is loaded now
    window._show_model(backend.model_info)  # what a finished load does
    type_and_enter(qtbot, window, "two")
    run(window.wait_idle())
    out = window.perf_panel.ttft_chart.chart_layout()
    assert [m.name for m in out.markers] == [first.name, "other-model"]


def test_the_dock_s_polling_updates_the_park_row(qtbot, make_window, run) -> None:
    backend = FakeBackend(park_bytes=4_400_000_000)
    window = make_window(backend)
    run(window.wait_idle())
    backend.park_bytes = 5_000_000_000  # the engine now holds more (a longer cache, say)
    window.perf_dock_action.trigger()  # showing the dock polls at once
    run(window.wait_idle())
    shown = window.park_readout.stats
    assert shown is not None and shown.allocated == 5_000_000_000
    assert window.perf_panel.memory_chart.values()[-1] == shown.allocated
    assert window.park_readout.memory_label.text().startswith("model 5.00 GB")
