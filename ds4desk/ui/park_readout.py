"""The right end of the park row: the memory readout ("model 1.20 GB": what the engine holds for the
model, the figure a park frees; its tooltip names the other figures: free, reserved or process RSS)
and, when the idle auto-park is on, a countdown to it ("auto-park in 4:32").

The countdown ticks locally at 1 Hz from a deadline; the window restarts it after each answer, load
or unpark (the engine counts its idle time from the end of its last command) and the engine's own
number, when a memory reading carries one, corrects it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QHBoxLayout, QLabel, QWidget

from ds4desk.engine.api import MemoryStats
from ds4desk.ui.stats_format import memory_details, memory_text


def format_countdown(seconds: float) -> str:
    whole = max(0, int(seconds + 0.999))  # 0.2 s left still reads 0:01, never 0:00 before it strikes
    return f"{whole // 60}:{whole % 60:02d}"


class ParkReadout(QWidget):
    def __init__(
        self,
        idle_park_s: float | None,
        *,
        on_expired: Callable[[], None] | None = None,
        parent: QWidget | None = None,
    ) -> None:
        """`idle_park_s`: the auto-park time (None: off); `on_expired`: called once when it ran out."""
        super().__init__(parent)
        self.setObjectName("ParkReadout")
        self.idle_park_s = idle_park_s
        self.on_expired = on_expired
        self.memory_label = QLabel("", objectName="MemoryLabel")
        self.memory_label.setAccessibleName("Model memory")
        self.countdown_label = QLabel("", objectName="IdleParkLabel")
        self.countdown_label.setAccessibleName("Idle auto-park countdown")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(12)
        row.addWidget(self.memory_label)
        row.addWidget(self.countdown_label)
        self.stats: MemoryStats | None = None  # the reading shown
        self.deadline: float | None = None
        self._expired_sent = False
        self._timer = QTimer(self)
        self._timer.setInterval(1000)
        self._timer.timeout.connect(self.tick)

    def show_memory(self, stats: MemoryStats | None) -> None:
        if stats is None:
            return
        self.stats = stats
        self.memory_label.setText(memory_text(stats))
        self.memory_label.setToolTip(memory_details(stats))
        if stats.idle_park_in_s is not None and self.idle_park_s:
            self.restart(stats.idle_park_in_s)  # the engine's own clock beats the local estimate

    def restart(self, left_s: float | None = None) -> None:
        """Count down from `left_s` (default: the whole idle time); nothing when the auto-park is off."""
        if not self.idle_park_s:
            self.stop()
            return
        self.deadline = time.monotonic() + (self.idle_park_s if left_s is None else left_s)
        self._expired_sent = False
        self._timer.start()
        self.tick()

    def stop(self) -> None:
        """While an answer runs or the model is parked there is nothing to count down."""
        self.deadline = None
        self._timer.stop()
        self.countdown_label.setText("")

    @property
    def counting(self) -> bool:
        return self._timer.isActive()

    def tick(self, now: float | None = None) -> None:
        if self.deadline is None:
            return
        left = self.deadline - (time.monotonic() if now is None else now)
        if left > 0:
            self.countdown_label.setText(f"auto-park in {format_countdown(left)}")
            return
        self.countdown_label.setText("auto-parking…")
        self._timer.stop()
        if not self._expired_sent:
            self._expired_sent = True
            if self.on_expired is not None:
                self.on_expired()
