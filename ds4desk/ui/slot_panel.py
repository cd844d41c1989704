"""Snapshot slots: a table of what the engine keeps (tokens, memory, age, hits, pinned, on disk, owning
chat) with Free, Pin/Unpin, Save to disk and Load from disk.

Every action is an asyncio task awaiting the backend; its SlotResult lists the slots afterwards, so
the table is redrawn from the engine's own answer, never from a guess. One action at a time. Only the
Age column moves between two listings: it ticks locally once a second while the panel is visible,
from the age the engine gave and the time since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import EngineError, ErrorCode, SlotInfo, SlotResult
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.stats_format import format_bytes

log = logging.getLogger(__name__)

# The chat's title last: it takes what the numbers leave, so a narrow dock shows the numbers first.
COLUMNS = ("Slot", "Tokens", "Memory", "Age", "Hits", "Pinned", "On disk", "Chat")
_AGE = COLUMNS.index("Age")
_NUMBERS = {COLUMNS.index(name) for name in ("Slot", "Tokens", "Memory", "Hits")}  # right-aligned
_SLOT = Qt.ItemDataRole.UserRole


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class SlotPanel(QWidget):
    def __init__(
        self,
        backend: ChatBackend,
        *,
        chat_title: Callable[[str | None], str] | None = None,
        snapshot_dir: Path | None = None,
        parent: QWidget | None = None,
    ) -> None:
        """`chat_title`: the chat a slot's tag names (the window passes its chat id as the tag).
        `snapshot_dir`: where Save to disk writes and Load from disk starts."""
        super().__init__(parent)
        self.setObjectName("SlotPanel")
        self.backend = backend
        self.chat_title = chat_title or (lambda tag: tag or "")
        self.snapshot_dir = snapshot_dir
        self.slots: list[SlotInfo] = []
        self.listed_at = time.monotonic()  # when the engine gave `slots` (their age_s is as of then)
        self._task: asyncio.Task[SlotResult] | None = None
        self._age_timer = QTimer(self)
        self._age_timer.setInterval(1000)
        self._age_timer.timeout.connect(self.tick_ages)

        self.table = QTableWidget(0, len(COLUMNS), objectName="SlotTable")
        self.table.setAccessibleName("Snapshot slots")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        # The chat title takes what the numbers leave (elided), so a long title never pushes
        # the numbers out of sight.
        header.setSectionResizeMode(COLUMNS.index("Chat"), QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._update_buttons)

        self.free_button = self._button("Free", "Free slot", "Drop the selected snapshot", self.free_selected)
        self.pin_button = self._button(
            "Pin", "Pin or unpin slot", "A pinned slot is never evicted", self.toggle_pin_selected
        )
        self.save_button = self._button(
            "Save to disk", "Save slot to disk", "Write the selected snapshot to a file", self.save_selected
        )
        self.load_button = self._button(
            "Load from disk", "Load slot from disk", "Read a snapshot file into a slot", self._choose_and_load
        )
        self.refresh_button = self._button("Refresh", "Refresh slots", "List the slots again", self.refresh)
        self.status = QLabel("", objectName="SlotStatus")
        self.status.setAccessibleName("Snapshot slot status")
        self.status.setWordWrap(True)

        # Two rows of buttons: in one row they alone would make the dock ~480 px wide, and a dock
        # beside the chat gets about 340.
        slot_buttons = QHBoxLayout()
        slot_buttons.setSpacing(4)
        for button in (self.free_button, self.pin_button):
            slot_buttons.addWidget(button)
        slot_buttons.addStretch(1)
        slot_buttons.addWidget(self.refresh_button)
        disk_buttons = QHBoxLayout()
        disk_buttons.setSpacing(4)
        for button in (self.save_button, self.load_button):
            disk_buttons.addWidget(button)
        disk_buttons.addStretch(1)
        column = QVBoxLayout(self)
        column.setContentsMargins(4, 4, 4, 4)
        column.addWidget(self.table, 1)
        column.addLayout(slot_buttons)
        column.addLayout(disk_buttons)
        column.addWidget(self.status)
        self._update_buttons()

    def _button(self, text: str, name: str, tip: str, slot: Callable[[], object]) -> QPushButton:
        button = QPushButton(text)
        button.setAccessibleName(name)
        button.setToolTip(tip)
        button.setFocusPolicy(Qt.FocusPolicy.NoFocus)

        def clicked() -> None:  # the actions return their task; a Qt slot returns nothing
            slot()

        button.clicked.connect(clicked)
        return button

    # ---- state ----------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def selected(self) -> SlotInfo | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows:
            return None
        index = self.table.item(rows[0].row(), 0).data(_SLOT)
        return next((s for s in self.slots if s.slot == index), None)

    def select_slot(self, index: int) -> None:
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(_SLOT) == index:
                self.table.selectRow(row)
                return

    def _update_buttons(self) -> None:
        chosen = self.selected()
        idle = not self.busy
        for button in (self.free_button, self.pin_button, self.save_button):
            button.setEnabled(idle and chosen is not None)
        self.save_button.setEnabled(idle and chosen is not None and self.snapshot_dir is not None)
        self.load_button.setEnabled(idle)
        self.refresh_button.setEnabled(idle)
        self.pin_button.setText("Unpin" if chosen is not None and chosen.pinned else "Pin")

    # ---- actions --------------------------------------------------------------------------

    def refresh(self) -> asyncio.Task[SlotResult] | None:
        return self._start("list")

    def free_selected(self) -> asyncio.Task[SlotResult] | None:
        chosen = self.selected()
        return self._start("free", chosen.slot) if chosen else None

    def toggle_pin_selected(self) -> asyncio.Task[SlotResult] | None:
        chosen = self.selected()
        if chosen is None:
            return None
        return self._start("unpin" if chosen.pinned else "pin", chosen.slot)

    def save_selected(self) -> asyncio.Task[SlotResult] | None:
        chosen = self.selected()
        if chosen is None or self.snapshot_dir is None:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        owner = "".join(c for c in (chosen.tag or "none") if c.isalnum() or c in "-_")[:40] or "none"
        path = self.snapshot_dir / f"slot{chosen.slot}-chat{owner}-{stamp}.safetensors"
        return self._start("save", chosen.slot, path)

    def load_from(self, path: Path) -> asyncio.Task[SlotResult] | None:
        return self._start("load", None, path)

    def _choose_and_load(self) -> None:
        start = str(self.snapshot_dir) if self.snapshot_dir else ""
        path, _ = QFileDialog.getOpenFileName(
            self, "Load snapshot", start, "Snapshots (*.safetensors);;All files (*)"
        )
        if path:
            self.load_from(Path(path))

    def _start(
        self, op: str, slot: int | None = None, path: Path | None = None
    ) -> asyncio.Task[SlotResult] | None:
        if self.busy:
            if op == "list":  # the running action lists the slots when it is done anyway
                return self._task
            self.status.setText("Busy: wait for the last slot action.")
            return None
        self._task = asyncio.ensure_future(self._run(op, slot, path))
        self._update_buttons()  # now: a second click must see it running
        return self._task

    async def _run(self, op: str, slot: int | None, path: Path | None) -> SlotResult:
        try:
            result = await self.backend.slots(op, slot, path)
        except Exception as exc:  # the backend promises not to raise; a bug must not kill the panel
            log.exception("slot command raised")
            result = SlotResult(
                slot=slot, error=EngineError(ErrorCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
            )
        self._task = None
        if result.error is not None:
            if result.error.code == ErrorCode.MODEL_NOT_LOADED:
                self.show_slots([])
                self.status.setText("No model loaded: no snapshots.")
            else:
                self.status.setText(f"Could not {op} the slot: {result.error.detail}")
                if op != "list":
                    self.refresh()  # show what is there now
        else:
            self.show_slots(result.slots)
            self.status.setText(_done_text(op, result, path))
            if result.slot is not None and op in ("load", "pin", "unpin", "save"):
                self.select_slot(result.slot)
        self._update_buttons()
        return result

    async def wait_idle(self) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.wait([self._task])

    # ---- the table --------------------------------------------------------------------------

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self._age_timer.start()
        self.tick_ages()

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self._age_timer.stop()  # nobody sees the ages: no work

    @property
    def ticking(self) -> bool:
        return self._age_timer.isActive()

    def tick_ages(self, now: float | None = None) -> None:
        """The Age column as of `now` (default: this moment); the other cells stay as listed."""
        since = (time.monotonic() if now is None else now) - self.listed_at
        for row, info in enumerate(self.slots):
            item = self.table.item(row, _AGE)
            text = format_age(info.age_s + since)
            if item is not None and item.text() != text:
                item.setText(text)

    def show_slots(self, slots: list[SlotInfo]) -> None:
        keep = self.selected()
        self.slots = list(slots)
        self.listed_at = time.monotonic()
        self.table.setRowCount(len(slots))
        for row, info in enumerate(slots):
            on_disk = Path(info.path).name if info.path and Path(info.path).exists() else "no"
            cells = {
                "Slot": str(info.slot),
                "Tokens": f"{info.tokens:,}",
                "Memory": format_bytes(info.bytes),
                "Age": format_age(info.age_s),
                "Hits": str(info.hits),
                "Pinned": "yes" if info.pinned else "no",
                "On disk": on_disk,
                "Chat": self.chat_title(info.tag),
            }
            for col, name in enumerate(COLUMNS):
                item = QTableWidgetItem(cells[name])
                if col in _NUMBERS:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if name == "On disk" and info.path:
                    item.setToolTip(info.path)
                item.setData(_SLOT, info.slot)
                self.table.setItem(row, col, item)
        if keep is not None:
            self.select_slot(keep.slot)
        self._update_buttons()

    def row_texts(self) -> list[list[str]]:
        """The table as shown (tests and the accessibility tree read the same)."""
        return [
            [self.table.item(row, col).text() for col in range(self.table.columnCount())]
            for row in range(self.table.rowCount())
        ]


def _done_text(op: str, result: SlotResult, path: Path | None) -> str:
    count = len(result.slots)
    listed = f"{count} snapshot slot{'s' if count != 1 else ''} in use"
    if op == "save" and path is not None:
        return f"Saved slot {result.slot} to {path}"
    if op == "load" and path is not None:
        return f"Loaded {path.name} into slot {result.slot}"
    if op in ("free", "pin", "unpin"):
        return f"{op.capitalize()}{'d' if op == 'free' else 'ned'} slot {result.slot}.  {listed}"
    return listed
