"""Live speed: decode tok/s through the answer being written, prefill tok/s and time to first token per
request, and the device memory over time.

Streamed batches only count tokens (cheap, at any rate); one QTimer tick at most every `tick_ms`
turns the count into a rate point and repaints what changed, so a 2,000 tok/s stream costs at most
ten small repaints a second. Every series is a bounded deque: a long session never grows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QColor, QHideEvent, QPainter, QPaintEvent, QPen, QPolygonF, QShowEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from ds4desk.engine.api import GenerateStats, MemoryStats, TextDelta
from ds4desk.ui.stats_format import format_bytes

log = logging.getLogger(__name__)

_GRID_COLOR = QColor("#e5e7eb")
_TEXT_COLOR = QColor("#374151")
RATE_WINDOW_S = 1.0  # the live decode rate is the tokens of the last second over their time span

MemorySource = Callable[[], Awaitable[MemoryStats]]


@dataclass(slots=True)
class Series:
    name: str
    color: QColor
    values: deque[float]


class LineChart(QWidget):
    """One plot, one or more bounded series, drawn with QPainter. `mark_dirty` asks for a repaint;
    the owner's timer calls `flush`, so many changes between two ticks share one repaint."""

    def __init__(
        self, title: str, unit: str, fmt: Callable[[float], str], parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.title = title
        self.unit = unit
        self.fmt = fmt
        self.series: list[Series] = []
        self.paints = 0  # paintEvent calls
        self.updates = 0  # repaints asked for (flush with something new)
        self._dirty = False
        self.setMinimumHeight(70)

    def add_series(self, name: str, color: str, capacity: int) -> Series:
        series = Series(name, QColor(color), deque(maxlen=capacity))
        self.series.append(series)
        return series

    def mark_dirty(self) -> None:
        self._dirty = True

    def flush(self) -> bool:
        if not self._dirty:
            return False
        self._dirty = False
        self.updates += 1
        self.update()
        return True

    def clear(self) -> None:
        for series in self.series:
            series.values.clear()
        self.mark_dirty()

    def sizeHint(self) -> QSize:
        return QSize(280, 110)

    def paintEvent(self, event: QPaintEvent) -> None:
        self.paints += 1
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor("#ffffff"))
        rect = QRectF(self.rect()).adjusted(8, 4, -8, -4)
        metrics = painter.fontMetrics()
        painter.setPen(_TEXT_COLOR)
        painter.drawText(rect.topLeft() + QPointF(0, metrics.ascent()), self.label())
        plot = rect.adjusted(0, metrics.height() + 2, 0, 0)
        painter.setPen(QPen(_GRID_COLOR, 1))
        painter.drawRect(plot)
        peak = max((max(s.values) for s in self.series if s.values), default=0.0) or 1.0
        if plot.height() > 0:
            for series in self.series:
                _draw_series(painter, plot, list(series.values), peak, series.color)
        painter.end()

    def label(self) -> str:
        """E.g. "decode: 31.4 tok/s (max 40.2)"; several series name their last values."""
        filled = [s for s in self.series if s.values]
        if not filled:
            return f"{self.title} ({self.unit}): no data yet"
        peak = max(max(s.values) for s in filled)
        if len(self.series) == 1:
            last = self.fmt(filled[0].values[-1])
        else:
            last = ", ".join(f"{s.name} {self.fmt(s.values[-1])}" for s in filled)
        return f"{self.title}: {last} {self.unit}  (max {self.fmt(peak)})"


def _draw_series(painter: QPainter, plot: QRectF, values: list[float], peak: float, color: QColor) -> None:
    if not values:
        return
    step = plot.width() / max(len(values) - 1, 1)
    points = [
        QPointF(plot.left() + i * step, plot.bottom() - (v / peak) * plot.height())
        for i, v in enumerate(values)
    ]
    painter.setPen(QPen(color, 1.5, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
    if len(points) == 1:
        painter.drawEllipse(points[0], 2, 2)  # a single value: a dot, not an invisible line
    else:
        painter.drawPolyline(QPolygonF(points))


class PerfPanel(QWidget):
    def __init__(
        self,
        memory_source: MemorySource | None = None,
        parent: QWidget | None = None,
        *,
        capacity: int = 120,
        tick_ms: int = 100,
        memory_poll_ms: int = 1000,
    ) -> None:
        """`memory_source`: awaited about once a second while the panel is visible (None: no polling).
        `capacity`: points kept per series; `tick_ms`: at most one repaint per chart that often."""
        super().__init__(parent)
        self.setObjectName("PerfPanel")
        self.setAccessibleName("Live speed charts")
        self._memory_source = memory_source
        self.decode_chart = LineChart("decode, this answer", "tok/s", "{:,.1f}".format)
        self.decode = self.decode_chart.add_series("decode", "#059669", capacity)
        self.prefill_chart = LineChart("prefill per request", "tok/s", "{:,.0f}".format)
        self.prefill = self.prefill_chart.add_series("prefill", "#7c3aed", capacity)
        self.ttft_chart = LineChart("first token per request", "s", "{:.2f}".format)
        self.ttft = self.ttft_chart.add_series("first token", "#2563eb", capacity)
        self.memory_chart = LineChart("device memory", "GB", "{:.2f}".format)
        self.memory_allocated = self.memory_chart.add_series("allocated", "#dc2626", capacity)
        self.memory_reserved = self.memory_chart.add_series("reserved", "#f59e0b", capacity)
        self.memory_label = QLabel("", objectName="PerfMemoryLabel")
        self.memory_label.setAccessibleName("Device memory")
        self.memory_label.setWordWrap(True)
        # Its text changes every second: it must never resize the dock (and so relayout the chat).
        self.memory_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.charts = (self.decode_chart, self.prefill_chart, self.ttft_chart, self.memory_chart)
        for chart in self.charts:
            chart.setAccessibleName(chart.title)
        column = QVBoxLayout(self)
        column.setContentsMargins(4, 4, 4, 4)
        column.setSpacing(4)
        for chart in self.charts:
            column.addWidget(chart, 1)
        column.addWidget(self.memory_label)

        self.ticks = 0  # timer ticks that found something to draw
        self._tick = QTimer(self)
        self._tick.setSingleShot(True)
        self._tick.setInterval(tick_ms)
        self._tick.timeout.connect(self._on_tick)
        self._memory_timer = QTimer(self)
        self._memory_timer.setInterval(memory_poll_ms)
        self._memory_timer.timeout.connect(self.poll_memory)
        self._memory_task: asyncio.Future[None] | None = None
        # The answer being written: (arrival time, tokens) per batch of the last RATE_WINDOW_S.
        self._streaming = False
        self._recent: deque[tuple[float, int]] = deque()
        self._pending_tokens = 0  # counted since the last tick

    # ---- the live answer ------------------------------------------------------------------

    def begin_answer(self) -> None:
        self._streaming = True
        self._recent.clear()
        self._pending_tokens = 0
        self.decode.values.clear()
        self.decode_chart.mark_dirty()
        self._schedule()

    def on_delta(self, delta: TextDelta, now: float | None = None) -> None:
        """Called for every streamed batch: counts only; the tick turns counts into a point."""
        if not self._streaming or not delta.tokens:
            return
        self._recent.append((time.monotonic() if now is None else now, len(delta.tokens)))
        self._pending_tokens += len(delta.tokens)
        self._schedule()

    def live_rate(self) -> float:
        """Tokens per second over the batches of the last RATE_WINDOW_S (0 until two batches came)."""
        if len(self._recent) < 2:
            return 0.0
        newest = self._recent[-1][0]
        while len(self._recent) > 2 and newest - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        span = newest - self._recent[0][0]
        # The first batch's tokens were made before the span began.
        tokens = sum(n for _, n in self._recent) - self._recent[0][1]
        return tokens / span if span > 0 else 0.0

    def end_answer(self, stats: GenerateStats | None) -> None:
        """Per-request numbers from the engine's own measurement (exact, not the UI's estimate)."""
        self._streaming = False
        if stats is not None and stats.generated_tokens:
            if stats.decode_tok_s > 0:
                self.decode.values.append(stats.decode_tok_s)
                self.decode_chart.mark_dirty()
            if stats.prefill_tok_s > 0:
                self.prefill.values.append(stats.prefill_tok_s)
                self.prefill_chart.mark_dirty()
            self.ttft.values.append(stats.time_to_first_token_s)
            self.ttft_chart.mark_dirty()
        self._schedule()

    # ---- memory ---------------------------------------------------------------------------

    def add_memory(self, stats: MemoryStats) -> None:
        self.memory_allocated.values.append(stats.allocated / 1e9)
        self.memory_reserved.values.append(stats.reserved / 1e9)
        self.memory_chart.mark_dirty()
        self.memory_label.setText(f"{stats.name} ({stats.device}): {memory_text(stats)}")
        self._schedule()

    def poll_memory(self) -> None:
        """One reading, unless the previous one is still on its way (a busy engine answers late)."""
        if self._memory_source is None or (self._memory_task is not None and not self._memory_task.done()):
            return
        self._memory_task = asyncio.ensure_future(self._read_memory())

    async def _read_memory(self) -> None:
        assert self._memory_source is not None
        try:
            stats = await self._memory_source()
        except Exception as exc:  # a reading is a nicety: say so, keep polling
            log.warning("memory reading failed: %s", exc)
            self.memory_label.setText(f"Memory: not available ({exc})")
            return
        self.add_memory(stats)

    async def wait_idle(self) -> None:
        if self._memory_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._memory_task

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if self._memory_source is not None:
            self._memory_timer.start()
            self.poll_memory()  # now, not in a second

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self._memory_timer.stop()  # no engine traffic for a panel nobody sees

    @property
    def polling(self) -> bool:
        return self._memory_timer.isActive()

    # ---- repaint coalescing -----------------------------------------------------------------

    def _schedule(self) -> None:
        if not self._tick.isActive():
            self._tick.start()

    def _on_tick(self) -> None:
        if self._pending_tokens:
            self._pending_tokens = 0
            rate = self.live_rate()
            if rate > 0:
                self.decode.values.append(rate)
                self.decode_chart.mark_dirty()
        drew = [chart.flush() for chart in self.charts]
        if any(drew):
            self.ticks += 1


def memory_text(stats: MemoryStats) -> str:
    """ "allocated 1.20 GB · reserved 1.50 GB · free 60.1 GB" (free left out when unknown)."""
    parts = [f"allocated {format_bytes(stats.allocated)}", f"reserved {format_bytes(stats.reserved)}"]
    if stats.total:
        parts.append(f"free {format_bytes(stats.free)}")
    return "  ·  ".join(parts)
