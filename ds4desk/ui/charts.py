"""The Live speed dock's charts, drawn with QPainter: labelled axes with units, round tick values with
headroom above the peak, per-request values as bars (a request is one measurement, not a trend
between neighbours), time series as lines, and model switches as named vertical markers.

Each chart works out what to draw in `chart_layout()` (plain geometry, which the tests read) and
`paintEvent` only draws it. `mark_dirty` asks for a repaint; the owner's timer calls `flush`, so many
changes between two ticks share one repaint. Every series is a bounded deque.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QFontMetricsF,
    QMouseEvent,
    QPainter,
    QPaintEvent,
    QPalette,
    QPen,
)
from PySide6.QtWidgets import QToolTip, QWidget

HEADROOM = 1.1  # the top tick is at least 10% above the peak: the peak never sits on the border
MIN_SLOTS = 8  # a per-request chart keeps room for this many bars: two requests are two narrow bars
MAX_BAR_PX = 18.0
_PAD = 4.0

# How a y value is written at a tick and which unit the axis shows: (divisor, unit) for a peak.
Scale = Callable[[float], tuple[float, str]]


def fixed_unit(unit: str) -> Scale:
    return lambda _peak: (1.0, unit)


def byte_scale(peak: float) -> tuple[float, str]:
    """GB once the peak reaches one, else MB (decimal, like format_bytes)."""
    return (1e9, "GB") if peak >= 1e9 else (1e6, "MB")


def nice_axis(peak: float, ticks: int = 4) -> tuple[float, float]:
    """(top, step): a round step (1, 2, 2.5 or 5 times a power of ten) and the smallest multiple of
    it at or above HEADROOM x peak, reached in about `ticks` steps. (1, 0.25) for an empty chart."""
    if not peak > 0 or not math.isfinite(peak):
        return 1.0, 0.25
    target = peak * HEADROOM
    magnitude = 10.0 ** math.floor(math.log10(target / ticks))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude * ticks >= target)
    top = math.ceil(target / step - 1e-9) * step
    return round(top, 12), round(step, 12)


def tick_text(value: float, step: float) -> str:
    """As many decimals as the step needs: 0, 10, 20 / 0, 2.5, 5 / 0.05, 0.10."""
    decimals = 0
    while decimals < 4 and abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6:
        decimals += 1
    return f"{value:,.{decimals}f}"


@dataclass(slots=True)
class Bar:
    number: int  # the request's number in this session (1, 2, ...)
    value: float
    model: str | None
    served: bool = False  # a request another program sent to the window's server, not the window's own


@dataclass(slots=True)
class Sample:
    at: float  # time.monotonic() of the reading
    value: float


@dataclass(slots=True)
class Marker:
    x: float
    name: str


@dataclass(slots=True)
class ChartLayout:
    """What a chart draws at its current size: the tests read it, paintEvent draws it."""

    plot: QRectF
    unit: str  # the y axis caption
    x_caption: str
    y_ticks: list[tuple[float, str]] = field(default_factory=list)  # (pixel y, label)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)  # (pixel x, label)
    y_top: float = 1.0  # the value at the plot's top edge
    x_reserve: float = 0.0  # pixels at the plot's right end kept free for the x caption
    bars: list[tuple[QRectF, Bar]] = field(default_factory=list)
    live_bar: QRectF | None = None  # the answer being written (an estimate, drawn hollow)
    line: list[QPointF] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)


class Chart(QWidget):
    """The frame every chart shares: title line, axes, ticks, repaint coalescing, hover read-out."""

    def __init__(
        self,
        title: str,
        scale: Scale,
        value_text: Callable[[float], str],
        x_caption: str,
        color: str,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.title = title
        self.scale = scale
        self.value_text = value_text  # a value with its unit, as the rest of the window writes it
        self.x_caption = x_caption
        self.color = QColor(color)
        self.paints = 0  # paintEvent calls
        self.updates = 0  # repaints asked for (flush with something new)
        self._dirty = False
        self.setMinimumHeight(110)
        self.setMouseTracking(True)  # hover read-outs
        self.setAccessibleName(title)

    # ---- what subclasses give ---------------------------------------------------------------

    def peak(self) -> float:
        raise NotImplementedError

    def headline(self) -> str:
        """The value after the title, e.g. "last 31.4 tok/s"."""
        raise NotImplementedError

    def _place(self, out: ChartLayout, to_y: Callable[[float], float]) -> None:
        """Fill in the data's geometry and the x ticks."""
        raise NotImplementedError

    def readout_at(self, pos: QPointF) -> str | None:
        raise NotImplementedError

    # ---- repaints ------------------------------------------------------------------------------

    def mark_dirty(self) -> None:
        self._dirty = True

    def flush(self) -> bool:
        if not self._dirty:
            return False
        self._dirty = False
        self.updates += 1
        self.setAccessibleDescription(self.label())  # what a screen reader says of the chart
        self.update()
        return True

    def sizeHint(self) -> QSize:
        return QSize(300, 140)

    def label(self) -> str:
        return f"{self.title}: {self.headline()}"

    # ---- geometry ---------------------------------------------------------------------------

    def _small_font(self) -> QFont:
        font = QFont(self.font())
        font.setPointSizeF(max(6.0, font.pointSizeF() - 1.5))
        return font

    def chart_layout(self) -> ChartLayout:
        metrics = QFontMetricsF(self.font())
        small = QFontMetricsF(self._small_font())
        divisor, unit = self.scale(self.peak())
        top, step = nice_axis(self.peak() / divisor)
        labels = [tick_text(i * step, step) for i in range(round(top / step) + 1)]
        if not self.peak() > 0:
            labels = ["0"]  # no data: a bare 0, not a scale of made-up values
        left = _PAD + max(small.horizontalAdvance(text) for text in [*labels, unit]) + 6
        # Title row, unit row, then half a tick label: the top tick's label never meets the unit.
        plot_top = _PAD + metrics.height() + small.height() * 1.5 + 2
        plot_bottom = self.height() - _PAD - small.height() - 2
        plot = QRectF(
            left, plot_top, max(1.0, self.width() - left - _PAD - 4), max(1.0, plot_bottom - plot_top)
        )
        out = ChartLayout(plot, unit, self.x_caption, y_top=top * divisor)
        if self.x_caption:
            out.x_reserve = small.horizontalAdvance(self.x_caption) + 6

        def to_y(value: float) -> float:
            return plot.bottom() - min(value / (top * divisor), 1.0) * plot.height()

        out.y_ticks = [
            (plot.bottom() - (i * step / top) * plot.height(), text) for i, text in enumerate(labels)
        ]
        self._place(out, to_y)
        return out

    # ---- drawing ------------------------------------------------------------------------------

    def paintEvent(self, event: QPaintEvent) -> None:
        self.paints += 1
        out = self.chart_layout()
        palette = self.palette()
        text_color = palette.color(QPalette.ColorRole.WindowText)
        grid = QColor(palette.color(QPalette.ColorRole.Mid))
        grid.setAlpha(110)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), palette.color(QPalette.ColorRole.Base))
        metrics = QFontMetricsF(self.font())
        painter.setPen(text_color)
        title = metrics.elidedText(self.label(), Qt.TextElideMode.ElideRight, self.width() - 2 * _PAD)
        painter.drawText(QPointF(_PAD, _PAD + metrics.ascent()), title)

        plot = out.plot
        painter.setFont(self._small_font())
        small = QFontMetricsF(painter.font())
        # The unit above the tick labels, right-aligned with them.
        painter.drawText(
            QRectF(0, _PAD + metrics.height(), plot.left() - 6, small.height()),
            int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignBottom),
            out.unit,
        )
        for y, text in out.y_ticks:
            painter.setPen(QPen(grid, 1))
            painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            painter.setPen(text_color)
            box = QRectF(0, y - small.height() / 2, plot.left() - 6, small.height())
            painter.drawText(box, int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), text)
        below = QRectF(plot.left(), plot.bottom() + 2, plot.width(), small.height())
        painter.drawText(below, int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop), out.x_caption)
        for x, text in out.x_ticks:
            width = small.horizontalAdvance(text)
            left = min(max(x - width / 2 - 1, 0.0), self.width() - width - 2.0)  # inside the widget
            box = QRectF(left, below.top(), width + 2, below.height())
            painter.drawText(box, int(Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop), text)
        painter.setPen(QPen(text_color, 1))
        painter.drawLine(plot.bottomLeft(), plot.bottomRight())
        painter.drawLine(plot.bottomLeft(), plot.topLeft())

        for rect, bar in out.bars:
            if bar.served:  # hatched and outlined: a served request, not one of the window's answers
                painter.fillRect(rect, QBrush(self.color, Qt.BrushStyle.BDiagPattern))
                painter.setPen(QPen(self.color, 1.2))
                painter.setBrush(Qt.BrushStyle.NoBrush)
                painter.drawRect(rect)
            else:
                painter.fillRect(rect, self.color)
        if out.live_bar is not None:
            painter.setPen(QPen(self.color, 1.2, Qt.PenStyle.DashLine))
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRect(out.live_bar)
        if out.line:
            painter.setPen(QPen(self.color, 1.6, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
            if len(out.line) > 1:
                painter.drawPolyline(out.line)
            if len(out.line) <= 3:  # a reading or two: dots, not an invisible or misleading line
                painter.setBrush(self.color)
                for point in out.line:
                    painter.drawEllipse(point, 2.5, 2.5)
        self._draw_markers(painter, out.markers, plot, text_color, small)
        painter.end()

    def _draw_markers(
        self, painter: QPainter, markers: Sequence[Marker], plot: QRectF, color: QColor, small: QFontMetricsF
    ) -> None:
        for i, marker in enumerate(markers):
            painter.setPen(QPen(color, 1, Qt.PenStyle.DashLine))
            x = math.floor(marker.x) + 0.5  # on a pixel's centre: a crisp line, not two grey ones
            painter.drawLine(QPointF(x, plot.top()), QPointF(x, plot.bottom()))
            room = (markers[i + 1].x if i + 1 < len(markers) else plot.right()) - marker.x - 4
            name = small.elidedText(marker.name, Qt.TextElideMode.ElideRight, max(room, 0.0))
            if name:
                painter.setPen(color)
                painter.drawText(QPointF(marker.x + 3, plot.top() + small.ascent()), name)

    # ---- hover ------------------------------------------------------------------------------

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        text = self.readout_at(event.position())
        if text:
            QToolTip.showText(event.globalPosition().toPoint(), text, self)
        else:
            QToolTip.hideText()
        super().mouseMoveEvent(event)


class RequestChart(Chart):
    """One bar per request, numbered, with a marker wherever the model changes; the answer being
    written shows as a hollow bar (the UI's estimate) until the engine's figure replaces it."""

    def __init__(
        self,
        title: str,
        scale: Scale,
        value_text: Callable[[float], str],
        color: str,
        capacity: int,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(title, scale, value_text, "answer #", color, parent)
        self.bars: deque[Bar] = deque(maxlen=capacity)
        self.live: float | None = None

    def values(self) -> list[float]:
        return [bar.value for bar in self.bars]

    def add(self, number: int, value: float, model: str | None, *, served: bool = False) -> None:
        self.bars.append(Bar(number, value, model, served))
        self.mark_dirty()

    def set_live(self, value: float | None) -> None:
        if value != self.live:
            self.live = value
            self.mark_dirty()

    def clear(self) -> None:
        self.bars.clear()
        self.live = None
        self.mark_dirty()

    def peak(self) -> float:
        return max([*self.values(), self.live or 0.0], default=0.0)

    def headline(self) -> str:
        if self.live is not None:
            return f"now {self.value_text(self.live)} (estimate)"
        if not self.bars:
            return "no answers yet"
        return f"last {self.value_text(self.bars[-1].value)}  (max {self.value_text(max(self.values()))})"

    def _slots(self) -> int:
        return max(MIN_SLOTS, len(self.bars) + (self.live is not None))

    def _slot_width(self, out: ChartLayout) -> float:
        return max(out.plot.width() - out.x_reserve, 1.0) / self._slots()

    def _place(self, out: ChartLayout, to_y: Callable[[float], float]) -> None:
        plot = out.plot
        slot = self._slot_width(out)
        width = max(1.0, min(slot * 0.6, MAX_BAR_PX))

        def rect(index: int, value: float) -> QRectF:
            centre = plot.left() + (index + 0.5) * slot
            top = to_y(value)
            return QRectF(centre - width / 2, top, width, plot.bottom() - top)

        previous: str | None = None
        every = max(1, math.ceil(len(self.bars) / 8))  # at most about 8 numbers under the bars
        for i, bar in enumerate(self.bars):
            out.bars.append((rect(i, bar.value), bar))
            if bar.model is not None and bar.model != previous:
                out.markers.append(Marker(plot.left() + i * slot + (1 if i == 0 else 0), bar.model))
            previous = bar.model if bar.model is not None else previous
            if (len(self.bars) - 1 - i) % every == 0:
                out.x_ticks.append((plot.left() + (i + 0.5) * slot, str(bar.number)))
        if self.live is not None:
            out.live_bar = rect(len(self.bars), self.live)

    def readout_at(self, pos: QPointF) -> str | None:
        out = self.chart_layout()
        index = int((pos.x() - out.plot.left()) // self._slot_width(out))
        if 0 <= index < len(self.bars):
            bar = self.bars[index]
            model = f"{bar.model}: " if bar.model else ""
            what = "served request" if bar.served else "answer"
            return f"{what} {bar.number}: {model}{self.value_text(bar.value)}"
        if index == len(self.bars) and self.live is not None:
            return f"this answer so far: {self.value_text(self.live)} (estimate)"
        return None


class TimeChart(Chart):
    """Readings over the last `window_s` seconds as a line, newest at the right edge; a model
    switch is a marker at the time it happened."""

    def __init__(
        self,
        title: str,
        scale: Scale,
        value_text: Callable[[float], str],
        color: str,
        capacity: int,
        window_s: float = 120.0,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(title, scale, value_text, "", color, parent)  # the ticks say "-60 s", "now"
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=capacity)
        self.switches: deque[tuple[float, str]] = deque(maxlen=capacity)

    def values(self) -> list[float]:
        return [sample.value for sample in self.samples]

    def add(self, at: float, value: float) -> None:
        self.samples.append(Sample(at, value))
        self.mark_dirty()

    def mark_switch(self, at: float, name: str) -> None:
        self.switches.append((at, name))
        self.mark_dirty()

    def clear(self) -> None:
        self.samples.clear()
        self.switches.clear()
        self.mark_dirty()

    def _now(self) -> float:
        times = [s.at for s in self.samples] + [at for at, _ in self.switches]
        return max(times, default=0.0)

    def peak(self) -> float:
        now = self._now()
        return max((s.value for s in self.samples if now - s.at <= self.window_s), default=0.0)

    def headline(self) -> str:
        return self.value_text(self.samples[-1].value) if self.samples else "no reading yet"

    def _place(self, out: ChartLayout, to_y: Callable[[float], float]) -> None:
        plot = out.plot
        now = self._now()

        def to_x(at: float) -> float:
            return plot.right() - (now - at) / self.window_s * plot.width()

        out.line = [QPointF(to_x(s.at), to_y(s.value)) for s in self.samples if now - s.at <= self.window_s]
        out.markers = [Marker(to_x(at), name) for at, name in self.switches if now - at <= self.window_s]
        step = nice_axis(self.window_s / HEADROOM)[1]
        ago = 0.0
        while ago <= self.window_s + 1e-9:
            text = f"-{tick_text(ago, step)} s" if ago else "now"
            out.x_ticks.append((plot.right() - ago / self.window_s * plot.width(), text))
            ago += step

    def readout_at(self, pos: QPointF) -> str | None:
        out = self.chart_layout()
        if not out.line:
            return None
        shown = [s for s in self.samples if self._now() - s.at <= self.window_s]
        nearest = min(range(len(out.line)), key=lambda i: abs(out.line[i].x() - pos.x()))
        if abs(out.line[nearest].x() - pos.x()) > 12:
            return None
        sample = shown[nearest]
        return f"{self._now() - sample.at:.0f} s ago: {self.value_text(sample.value)}"
