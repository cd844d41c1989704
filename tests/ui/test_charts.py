"""The Live speed charts: round ticks with headroom above the peak, units on the axes, per-answer
values as bars (never a slope between two answers), model switches as named markers, and the
engine's figure, not the UI's estimate, left standing after an answer. Geometry is read from the
chart's layout and checked again on the pixels a real offscreen paint made."""

from __future__ import annotations

import math

import pytest
from PySide6.QtCore import QPointF
from PySide6.QtGui import QColor, QImage

from ds4desk.engine.api import GenerateStats, MemoryStats, TextDelta
from ds4desk.ui.charts import HEADROOM, MAX_BAR_PX, nice_axis, tick_text
from ds4desk.ui.perf_panel import PerfPanel
from ds4desk.ui.stats_format import AnswerSpeed, format_decode, stats_footer, status_speed


def answer(decode_s: float, generated: int = 51, ttft: float = 0.25) -> GenerateStats:
    return GenerateStats(200, 0, 200, generated, ttft, 0.25, decode_s)


def shown_panel(qtbot, width: int = 340, height: int = 640) -> PerfPanel:
    panel = PerfPanel(tick_ms=20)
    qtbot.addWidget(panel)
    panel.resize(width, height)
    panel.show()
    qtbot.waitExposed(panel)
    return panel


def painted(chart) -> QImage:
    return chart.grab().toImage()


def is_color(image: QImage, x: float, y: float, color: QColor) -> bool:
    pixel = image.pixelColor(round(x), round(y))
    return (
        max(
            abs(pixel.red() - color.red()),
            abs(pixel.green() - color.green()),
            abs(pixel.blue() - color.blue()),
        )
        < 40
    )


@pytest.mark.parametrize("peak", [0.003, 0.35, 1.0, 7.3, 31.4, 100.0, 111.1, 812.0, 999.0, 2_400.0, 4.4e9])
def test_the_axis_ends_on_a_round_tick_above_the_peak(peak: float) -> None:
    top, step = nice_axis(peak)
    assert top >= peak * HEADROOM - 1e-9  # headroom: the peak never touches the border
    assert top - step < peak * HEADROOM  # and no more than one step of it
    ticks = top / step
    assert abs(ticks - round(ticks)) < 1e-9 and 2 <= round(ticks) <= 8
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - m) < 1e-9 for m in (1, 2, 2.5, 5))


def test_tick_text_has_the_decimals_its_step_needs() -> None:
    assert [tick_text(i * 2.5, 2.5) for i in range(3)] == ["0.0", "2.5", "5.0"]
    assert [tick_text(i * 50, 50) for i in range(4)] == ["0", "50", "100", "150"]
    assert tick_text(1500, 500) == "1,500"
    assert tick_text(0.1, 0.05) == "0.10"


def test_an_empty_chart_shows_no_made_up_scale(qtbot) -> None:
    panel = shown_panel(qtbot)
    out = panel.decode_chart.chart_layout()
    assert [text for _, text in out.y_ticks] == ["0"] and out.bars == []
    assert panel.decode_chart.label() == "decode: no answers yet"


def test_two_answers_are_two_narrow_bars_below_a_labelled_axis(qtbot) -> None:
    panel = shown_panel(qtbot)
    panel.set_model("SmolLM2")
    panel.end_answer(answer(0.5))  # 100 tok/s
    panel.end_answer(answer(0.45))  # 111.1 tok/s
    chart = panel.decode_chart
    out = chart.chart_layout()
    assert out.unit == "tok/s" and out.x_caption == "answer #"
    labels = [text for _, text in out.y_ticks]
    assert labels[0] == "0" and float(labels[-1].replace(",", "")) > 111.1
    assert out.y_top == float(labels[-1])
    assert [text for _, text in out.x_ticks] == ["1", "2"]
    # Bars, not a line from the left edge to the right one.
    assert out.line == [] and len(out.bars) == 2
    (first, _), (second, _) = out.bars
    assert first.width() <= MAX_BAR_PX and second.right() < out.plot.left() + out.plot.width() / 2
    assert second.height() > first.height()
    assert second.top() > out.plot.top() + 0.05 * out.plot.height()  # headroom on screen too

    image = painted(chart)  # what a real paint drew where the layout says
    assert is_color(image, first.center().x(), first.center().y(), chart.color)
    assert is_color(image, second.center().x(), second.center().y(), chart.color)
    between = (first.right() + second.left()) / 2
    assert not is_color(image, between, first.center().y(), chart.color)  # no slope joins them
    assert not is_color(image, out.plot.right() - 3, out.plot.bottom() - 3, chart.color)


def test_a_model_switch_starts_a_named_marker(qtbot) -> None:
    panel = shown_panel(qtbot)
    panel.set_model("SmolLM2")
    panel.end_answer(answer(0.5))
    panel.end_answer(answer(0.5))
    panel.set_model("gemma-3-270m")
    panel.end_answer(answer(1.0))
    panel.set_model("gemma-3-270m")  # the same model again: no new marker
    panel.end_answer(answer(1.0))
    chart = panel.prefill_chart
    out = chart.chart_layout()
    assert [m.name for m in out.markers] == ["SmolLM2", "gemma-3-270m"]
    bars = [rect for rect, _ in out.bars]
    assert bars[1].right() < out.markers[1].x < bars[2].left()  # between the two models' bars
    assert [bar.model for _, bar in out.bars] == ["SmolLM2", "SmolLM2", "gemma-3-270m", "gemma-3-270m"]
    # The hover read-out names the answer, its model and its figure.
    assert chart.readout_at(bars[2].center()) == "answer 3: gemma-3-270m: 800 tok/s"
    assert chart.readout_at(QPointF(out.plot.right() - 2, bars[0].center().y())) is None

    image = painted(chart)
    mid = (out.plot.top() + out.plot.bottom()) / 2
    x = math.floor(out.markers[1].x)
    column = [image.pixelColor(x, y).lightness() for y in range(int(mid), int(mid) + 12)]
    assert min(column) < 160  # a dark dashed line is drawn there
    # The memory chart marks the switch at its moment.
    assert [m.name for m in panel.memory_chart.chart_layout().markers] == ["gemma-3-270m"]


def test_the_engine_s_figure_replaces_the_estimate_and_stays(qtbot) -> None:
    """The 1.9 vs 2.4 tok/s bug: a tick that came after the answer ended appended the UI's estimate
    behind the engine's figure, so the chart and the status bar showed different speeds."""
    panel = shown_panel(qtbot)
    panel.begin_answer()
    for i in range(30):  # about 2.4 tok/s as the batches arrived
        panel.on_delta(TextDelta(1, (i,), "t"), now=100.0 + i / 2.4)
    qtbot.waitUntil(lambda: panel.decode_chart.live is not None)
    assert abs(panel.decode_chart.live - 2.4) < 1e-6
    assert "estimate" in panel.decode_chart.label()
    for i in range(30, 40):  # more tokens counted, their tick not run yet
        panel.on_delta(TextDelta(1, (i,), "t"), now=100.0 + i / 2.4)
    stats = answer(decode_s=26.3, generated=51)  # the engine measured 1.9 tok/s
    panel.end_answer(stats)
    ticks = panel.ticks
    qtbot.waitUntil(lambda: panel.ticks > ticks)  # the pending tick ran
    chart = panel.decode_chart
    assert chart.live is None and chart.values() == [stats.decode_tok_s]
    assert chart.chart_layout().live_bar is None
    assert format_decode(stats.decode_tok_s) == "1.9 tok/s"
    assert "1.9 tok/s" in chart.label() and "2.4" not in chart.label()


def test_chart_status_bar_and_footer_read_one_figure() -> None:
    stats = answer(decode_s=0.37, generated=48)
    figure = format_decode(AnswerSpeed.of(stats).decode_tok_s)
    stored = {**stats.to_json(), "finish_reason": "stop"}  # as history keeps it
    assert AnswerSpeed.of(stored) == AnswerSpeed.of(stats)
    assert figure in status_speed(stats)[0] and figure in status_speed(stats)[1]
    assert f"decode {figure}" in (stats_footer(stored) or "")
    panel = PerfPanel()
    panel.end_answer(stats)
    assert f"last {figure}" in panel.decode_chart.label()


def test_the_memory_chart_has_byte_units_and_a_time_axis(qtbot) -> None:
    panel = shown_panel(qtbot)
    chart = panel.memory_chart
    for t in range(10):
        panel.add_memory(
            MemoryStats("cpu", "CPU", 150_000_000, 700_000_000, 10**10, 16 * 10**9), now=100.0 + t
        )
    out = chart.chart_layout()
    assert out.unit == "MB" and float(out.y_ticks[-1][1]) > 150  # headroom in MB
    assert out.x_ticks[0][1] == "now" and out.x_ticks[-1][1].endswith(" s")
    assert len(out.line) == 10 and out.line[-1].x() == pytest.approx(out.plot.right())
    assert all(p.y() > out.plot.top() for p in out.line)
    assert chart.label() == "model memory: 150 MB"
    panel.add_memory(
        MemoryStats("cuda:0", "GPU", 4_400_000_000, 4_500_000_000, 10**10, 8 * 10**10), now=111.0
    )
    assert chart.chart_layout().unit == "GB"
    assert "4.40 GB" in (chart.readout_at(chart.chart_layout().line[-1]) or "")
