"""A tiny two-panel line chart of per-answer speed: decode tok/s above, time to first token below.

Drawn by hand in paintEvent (a polyline per series) so the UI needs no plotting dependency. The
history is bounded and repaints are coalesced, so a long session never makes it slow.
"""

from __future__ import annotations

from collections import deque

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen, QPolygonF
from PySide6.QtWidgets import QWidget

_DECODE_COLOR = QColor("#059669")
_TTFT_COLOR = QColor("#2563eb")
_GRID_COLOR = QColor("#e5e7eb")
_TEXT_COLOR = QColor("#374151")


class SpeedChart(QWidget):
    def __init__(
        self, parent: QWidget | None = None, *, capacity: int = 100, min_repaint_ms: int = 100
    ) -> None:
        """`capacity`: answers kept per series; `min_repaint_ms`: at most one repaint that often."""
        super().__init__(parent)
        self.setObjectName("SpeedChart")
        self.decode_tok_s: deque[float] = deque(maxlen=capacity)
        self.ttft_s: deque[float] = deque(maxlen=capacity)
        self.paints = 0  # how often it was drawn (lets tests check the coalescing)
        self._repaint = QTimer(self)
        self._repaint.setSingleShot(True)
        self._repaint.setInterval(min_repaint_ms)
        self._repaint.timeout.connect(self.update)

    def add_answer(self, decode_tok_s: float, ttft_s: float) -> None:
        self.decode_tok_s.append(decode_tok_s)
        self.ttft_s.append(ttft_s)
        if not self._repaint.isActive():  # answers arriving faster share one repaint
            self._repaint.start()

    def clear(self) -> None:
        self.decode_tok_s.clear()
        self.ttft_s.clear()
        self.update()

    def sizeHint(self) -> QSize:
        return QSize(260, 200)

    def minimumSizeHint(self) -> QSize:
        return QSize(140, 100)

    def paintEvent(self, event: QPaintEvent) -> None:
        self.paints += 1
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor("#ffffff"))
        area = QRectF(self.rect()).adjusted(8, 6, -8, -6)
        half = area.height() / 2
        top = QRectF(area.left(), area.top(), area.width(), half - 4)
        bottom = QRectF(area.left(), area.top() + half + 4, area.width(), half - 4)
        self._panel(painter, top, list(self.decode_tok_s), "decode", "tok/s", "{:.1f}", _DECODE_COLOR)
        self._panel(painter, bottom, list(self.ttft_s), "first token", "s", "{:.2f}", _TTFT_COLOR)
        painter.end()

    @staticmethod
    def _panel(
        painter: QPainter, rect: QRectF, values: list[float], title: str, unit: str, fmt: str, color: QColor
    ) -> None:
        metrics = painter.fontMetrics()
        if values:  # the last value, and the top of the scale (the plot has no axis labels)
            label = f"{title}: {fmt.format(values[-1])} {unit}   (max {fmt.format(max(values))})"
        else:
            label = f"{title} ({unit}): no answers yet"
        painter.setPen(_TEXT_COLOR)
        painter.drawText(rect.topLeft() + QPointF(0, metrics.ascent()), label)
        plot = rect.adjusted(0, metrics.height() + 2, 0, 0)
        painter.setPen(QPen(_GRID_COLOR, 1))
        painter.drawRect(plot)
        if not values or plot.height() <= 0:
            return
        peak = max(values) or 1.0  # all zero: a flat line at the bottom
        step = plot.width() / max(len(values) - 1, 1)
        points = [
            QPointF(plot.left() + i * step, plot.bottom() - (v / peak) * plot.height())
            for i, v in enumerate(values)
        ]
        painter.setPen(QPen(color, 1.5, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
        if len(points) == 1:
            painter.drawEllipse(points[0], 2, 2)  # one answer: a dot, not an invisible line
        else:
            painter.drawPolyline(QPolygonF(points))
