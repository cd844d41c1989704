"""The window's docks (Snapshot slots, Live speed) with the memory readings they share with the park
row, and the window's size, docks and splitter across restarts. MainWindow inherits it."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path
from typing import Any

import shiboken6
from PySide6.QtCore import QByteArray, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QFrame, QScrollArea, QWidget

from ds4desk.engine.api import MemoryStats
from ds4desk.ui.perf_panel import PerfPanel
from ds4desk.ui.sidebar import UNTITLED
from ds4desk.ui.slot_panel import SlotPanel

log = logging.getLogger(__name__)

DEFAULT_SIZE = (1100, 750)
DOCK_WIDTH = 340  # a dock's width when it first opens; the user may drag it wider


class DockPanels:
    """MainWindow's docks and saved layout; the widgets and state they read are MainWindow's."""

    def _build_slot_and_perf_docks(self) -> None:
        """Snapshot slots and live speed, hidden until asked for (View menu)."""
        # Snapshot files go beside the history, in the data dir (None for an in-memory history).
        db = self.history.path
        snapshot_dir = None if db == ":memory:" else Path(db).parent / "snapshots"
        self.slot_panel = SlotPanel(self.backend, chat_title=self._chat_title_of, snapshot_dir=snapshot_dir)
        self.slot_dock = QDockWidget("Snapshot slots", self, objectName="SlotDock")
        self.slot_dock.setWidget(_scrolled(self.slot_panel))
        # getattr: a stand-in backend (the engine could not start) may have no memory reading.
        self.perf_panel = PerfPanel(getattr(self.backend, "memory", None))
        self.perf_panel.memory_polled.connect(self._show_polled_memory)
        self.perf_dock = QDockWidget("Live speed", self, objectName="PerfDock")
        self.perf_dock.setWidget(_scrolled(self.perf_panel))
        for dock in (self.slot_dock, self.perf_dock):
            self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
            dock.hide()
        # Tabbed: both open take one column's width, not two, and the chat keeps its room.
        self.tabifyDockWidget(self.slot_dock, self.perf_dock)
        # The docks that opened once (or came from a saved layout): their width is the user's now.
        self._docks_sized: set[QDockWidget] = set()
        for dock in (self.slot_dock, self.perf_dock):
            dock.visibilityChanged.connect(lambda shown, d=dock: self._on_dock_shown(d, shown))
        self.slot_dock.visibilityChanged.connect(self._on_slot_dock_shown)
        self._memory_task: asyncio.Task[None] | None = None

    def _on_slot_dock_shown(self, shown: bool) -> None:
        if shown:
            self.slot_panel.refresh()

    def _on_dock_shown(self, dock: QDockWidget, shown: bool) -> None:
        """The first time a dock opens it takes DOCK_WIDTH, not its panel's wish: the chat stays
        readable at the default window size. After that the user's width is kept."""
        if shown and dock not in self._docks_sized and not dock.isFloating():
            self._docks_sized.add(dock)
            # After the layout placed it: a resize now would be undone by the show's own layout.
            QTimer.singleShot(0, lambda: self._narrow_dock(dock))

    def _narrow_dock(self, dock: QDockWidget) -> None:
        if not self._closed and shiboken6.isValid(dock) and dock.isVisible() and dock.width() > DOCK_WIDTH:
            self.resizeDocks([dock], [DOCK_WIDTH], Qt.Orientation.Horizontal)

    def _show_polled_memory(self, stats: MemoryStats) -> None:
        """The Live speed dock's reading: the park row shows the same figure (the dock already has it)."""
        if not self._closed:
            self.park_readout.show_memory(stats)

    def _chat_title_of(self, tag: str | None) -> str:
        chat = self.history.get_chat(int(tag)) if tag and tag.isdigit() else None
        return (chat.title or UNTITLED) if chat else (tag or "")

    def refresh_memory(self) -> None:
        """Read the device memory in the background and show it (park row, memory chart)."""
        if self._memory_task is None or self._memory_task.done():
            self._memory_task = asyncio.ensure_future(self._read_memory())

    async def _read_memory(self) -> None:
        try:
            stats = await self.backend.memory()
        except Exception as exc:  # a reading is a nicety: never an error dialog
            log.warning("memory reading failed: %s", exc)
            return
        if not self._closed:
            self._show_memory(stats)

    def _panel_tasks(self) -> list[asyncio.Future[Any]]:
        """The docks' background reads, so wait_idle (and a clean shutdown) waits for them too."""
        tasks = [self._memory_task, self.slot_panel._task, self.perf_panel._memory_task, self._device_task]
        tasks.append(self.serve_control.task if hasattr(self, "serve_control") else None)
        tasks.append(getattr(self.model_picker, "task", None))  # a Python attribute: there after deletion
        return [t for t in tasks if t is not None]

    def _show_memory(self, stats: MemoryStats | None) -> None:
        if stats is not None:
            self.park_readout.show_memory(stats)
            self.perf_panel.add_memory(stats)
        if self.backend.parked:
            self.park_readout.stop()
            self._show_model(self.backend.model_info)  # the engine may have parked itself

    # ---- window state across restarts ---------------------------------------------------

    def restore_window_state(self) -> bool:
        """The size, docks and chat-list width as the window was closed. A value Qt does not take
        (damaged, from another Qt) is ignored: the defaults stay. Returns whether the docks were."""
        s = self.settings
        geometry, state, splitter = (_blob(v) for v in (s.window_geometry, s.window_state, s.splitter_state))
        if geometry is not None and not self.restoreGeometry(geometry):
            log.warning("saved window geometry ignored")
            self.resize(*DEFAULT_SIZE)
        if splitter is not None and not self.splitter.restoreState(splitter):
            log.warning("saved splitter state ignored")
        restored = state is not None and self.restoreState(state)
        if state is not None and not restored:
            log.warning("saved dock state ignored")
        if restored:  # an open dock keeps the width it was closed with; one never opened, DOCK_WIDTH
            self._docks_sized.update(d for d in (self.slot_dock, self.perf_dock) if not d.isHidden())
        return restored

    def remember_window_state(self) -> None:
        """Into the settings (saved with them): the next start opens the window as it is now."""
        s = self.settings
        s.window_geometry = _base64(self.saveGeometry())
        s.window_state = _base64(self.saveState())
        s.splitter_state = _base64(self.splitter.saveState())


def _scrolled(panel: QWidget) -> QScrollArea:
    """A dock's panel in a scroll area: the dock may then be narrower than the panel would like
    (the slot table wants 450 px) without taking that width from the chat and the chat list."""
    area = QScrollArea(objectName=f"{panel.objectName() or 'Panel'}Scroll")
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    area.setWidget(panel)
    return area


def _blob(text: str) -> QByteArray | None:
    """A saved Qt state from its base64 text; None for none or text that is not base64."""
    if not text:
        return None
    try:
        return QByteArray(base64.b64decode(text, validate=True))
    except ValueError:
        return None


def _base64(blob: QByteArray) -> str:
    return base64.b64encode(bytes(blob.data())).decode("ascii")
