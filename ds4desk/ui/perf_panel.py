"""Live speed: decode tok/s, prefill tok/s and time to first token per answer (bars, one per request,
a marker where the model changed), the share of drafted tokens accepted where speculative decoding
ran, and the model's memory over the last two minutes. Requests other programs sent to the window's
local server (Settings > "Serve the loaded model on localhost") are bars too, hatched.

Every per-answer figure is the engine's own measurement read through `AnswerSpeed.of`, the same as
the answer's footer and the status bar show. While an answer streams, the decode chart shows the UI's
estimate from the streamed batches as a hollow bar; the engine's figure replaces it when the answer
ends, so the estimate is never left standing beside the measurement.

Streamed batches only count tokens (cheap, at any rate); one QTimer tick at most every `tick_ms`
turns the count into an estimate and repaints what changed, so a 2,000 tok/s stream costs at most
ten small repaints a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from ds4desk.engine.api import GenerateStats, MemoryStats, TextDelta
from ds4desk.ui.charts import Chart, RequestChart, TimeChart, byte_scale, fixed_unit
from ds4desk.ui.stats_format import (
    AnswerSpeed,
    format_bytes,
    format_decode,
    format_percent,
    format_prefill,
    format_seconds,
    memory_others,
)

log = logging.getLogger(__name__)

RATE_WINDOW_S = 1.0  # the live estimate is the tokens of the last second over their time span

MemorySource = Callable[[], Awaitable[MemoryStats]]


class PerfPanel(QWidget):
    # Every reading the panel's own polling took: the window shows it in the park row too, so the
    # dock and the row never show two different figures.
    memory_polled = Signal(object)

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
        `capacity`: answers and readings kept per chart; `tick_ms`: at most one repaint per chart
        that often."""
        super().__init__(parent)
        self.setObjectName("PerfPanel")
        self.setAccessibleName("Live speed charts")
        self._memory_source = memory_source
        self.decode_chart = RequestChart("decode", fixed_unit("tok/s"), format_decode, "#059669", capacity)
        self.prefill_chart = RequestChart("prefill", fixed_unit("tok/s"), format_prefill, "#7c3aed", capacity)
        self.ttft_chart = RequestChart("first token", fixed_unit("s"), format_seconds, "#2563eb", capacity)
        # Only answers that speculated have a bar; the chart shows once the first one does.
        self.acceptance_chart = RequestChart(
            "draft acceptance", fixed_unit("%"), format_percent, "#d97706", capacity
        )
        self.acceptance_chart.setVisible(False)
        self.memory_chart = TimeChart(
            "model memory", byte_scale, lambda v: format_bytes(int(v)), "#dc2626", capacity
        )
        self.memory_label = QLabel("", objectName="PerfMemoryLabel")
        self.memory_label.setAccessibleName("Device memory")
        self.memory_label.setWordWrap(True)
        # Its text changes every second: it must never resize the dock (and so relayout the chat).
        self.memory_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        # The charts every answer adds to; the acceptance chart (answers that speculated) comes apart.
        self.charts: tuple[Chart, ...] = (
            self.decode_chart,
            self.prefill_chart,
            self.ttft_chart,
            self.memory_chart,
        )
        self._drawn: tuple[Chart, ...] = (*self.charts[:3], self.acceptance_chart, self.memory_chart)
        column = QVBoxLayout(self)
        column.setContentsMargins(4, 4, 4, 4)
        column.setSpacing(4)
        for chart in self._drawn:
            column.addWidget(chart, 1)
        column.addWidget(self.memory_label)
        self.served_label = QLabel("", objectName="PerfServedLabel")
        self.served_label.setWordWrap(True)
        self.served_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.served_label.hide()
        column.addWidget(self.served_label)

        self.model: str | None = None  # the model the next answer's bars belong to
        self.answers = 0  # answers measured this session (the window's and served ones): the bars' numbers
        self.served = 0  # of them, requests the local server answered
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

    # ---- the model ------------------------------------------------------------------------

    def set_model(self, name: str | None, now: float | None = None) -> None:
        """The model now loaded (None: none). A different model starts a new run of bars behind a
        marker with its name, and marks the memory chart at this moment."""
        if name is None or name == self.model:
            return
        if self.model is not None:  # the first model is named by its first bar's marker
            self.memory_chart.mark_switch(time.monotonic() if now is None else now, name)
            self._schedule()
        self.model = name

    # ---- the live answer ------------------------------------------------------------------

    def begin_answer(self) -> None:
        self._streaming = True
        self._recent.clear()
        self._pending_tokens = 0
        self._schedule()

    def on_delta(self, delta: TextDelta, now: float | None = None) -> None:
        """Called for every streamed batch: counts only; the tick turns counts into an estimate."""
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
        """The answer's bars, from the engine's own measurement (what the footer and the status bar
        show); the estimate goes, and counts still waiting for a tick are dropped with it."""
        self._streaming = False
        self._pending_tokens = 0
        self._recent.clear()
        self.decode_chart.set_live(None)
        self._add_bars(AnswerSpeed.of(stats), self.model, served=False)
        self._schedule()

    def add_served(self, model: str | None, stats: GenerateStats) -> None:
        """A request the window's local server answered: hatched bars among the window's own. The
        answer the window is writing (if any) keeps its estimate: the engine ran the two in turn."""
        if self._add_bars(AnswerSpeed.of(stats), model or self.model, served=True):
            self.served += 1
            self.served_label.setText(
                f"{self.served:,} request{'s' * (self.served != 1)} served over the OpenAI API (hatched bars)"
            )
            self.served_label.show()
        self._schedule()

    def _add_bars(self, speed: AnswerSpeed, model: str | None, *, served: bool) -> bool:
        if not speed.generated_tokens:
            return False
        self.answers += 1
        number = self.answers
        if speed.decode_tok_s > 0:
            self.decode_chart.add(number, speed.decode_tok_s, model, served=served)
        if speed.prefill_tok_s > 0:
            self.prefill_chart.add(number, speed.prefill_tok_s, model, served=served)
        self.ttft_chart.add(number, speed.first_token_s, model, served=served)
        if speed.speculated:
            self.acceptance_chart.add(number, speed.acceptance_percent, model, served=served)
            self.acceptance_chart.setVisible(True)
        return True

    # ---- memory ---------------------------------------------------------------------------

    def add_memory(self, stats: MemoryStats, now: float | None = None) -> None:
        """One reading: the chart plots the model's memory (the park row's figure); the line below
        names the device and the figures that are not the model's."""
        self.memory_chart.add(time.monotonic() if now is None else now, float(stats.allocated))
        self.memory_label.setText("  ·  ".join(memory_others(stats)))
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
        self.memory_polled.emit(stats)

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
        if self._pending_tokens and self._streaming:
            self._pending_tokens = 0
            rate = self.live_rate()
            if rate > 0:
                self.decode_chart.set_live(rate)
        drew = [chart.flush() for chart in self._drawn]
        if any(drew):
            self.ticks += 1
