"""The park row above the composer: which model, Park, Unpark, and the memory readout beside them.

Freeing the GPU for something else and getting it back are everyday actions, not settings, so they
sit where the user types. One park or unpark runs at a time; the row says what it freed or took.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QPushButton, QWidget

from ds4desk.engine.api import EngineError, ErrorCode, MemoryStats, ModelInfo, ParkResult
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.park_readout import ParkReadout
from ds4desk.ui.stats_format import format_bytes

log = logging.getLogger(__name__)

PARK_CHOICES = (("All models", "all"), ("Target model", "target"), ("Draft model", "draft"))


@dataclass(slots=True, frozen=True)
class ParkHooks:
    """What the row asks of the window it sits in."""

    say: Callable[[str], None]  # the status line
    warn: Callable[[str], None]  # the status line, as an error
    model_changed: Callable[[], None]  # show the backend's model (loaded, parked, none) again
    show_memory: Callable[[MemoryStats], None]  # a reading the park or unpark brought back
    refresh_memory: Callable[[], None]  # take a reading in the background and show it
    closed: Callable[[], bool]  # the window has closed: touch no widget


class ParkControls(QWidget):
    def __init__(self, backend: ChatBackend, idle_park_s: float | None, hooks: ParkHooks) -> None:
        """`idle_park_s`: the engine's auto-park time (None: off), counted down beside the buttons."""
        super().__init__(objectName="ParkRow")
        self._backend = backend
        self._hooks = hooks
        self.task: asyncio.Task[ParkResult] | None = None  # the park or unpark running

        self.park_selector = QComboBox(objectName="ParkSelector")
        for label, selector in PARK_CHOICES:
            self.park_selector.addItem(label, selector)
        self.park_selector.setToolTip("Which model Park and Unpark act on")
        self.park_selector.setAccessibleName("Model to park")
        self.park_selector.currentIndexChanged.connect(lambda _index: self.update_buttons())
        # The draft model (File > Load draft model…) parks on its own: whether it is parked now. A
        # new ModelInfo (a load, the target's unpark) brings the draft back with its target.
        self.draft_parked = False
        self._info_seen: ModelInfo | None = None
        self.park_button = QPushButton("Park", objectName="ParkButton")
        self.park_button.setToolTip("Free the model's memory; the next answer loads it back")
        self.park_button.setAccessibleName("Park")
        self.park_button.clicked.connect(self.start_park)
        self.unpark_button = QPushButton("Unpark", objectName="UnparkButton")
        self.unpark_button.setToolTip("Load the parked model back now")
        self.unpark_button.setAccessibleName("Unpark")
        self.unpark_button.clicked.connect(self.start_unpark)
        row = QHBoxLayout()
        row.setContentsMargins(16, 0, 16, 0)
        row.setSpacing(6)
        row.addWidget(QLabel("Memory:"))
        row.addWidget(self.park_selector)
        for button in (self.park_button, self.unpark_button):
            button.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # keep the focus in the composer
            row.addWidget(button)
        row.addStretch(1)
        self.park_readout = ParkReadout(idle_park_s, on_expired=hooks.refresh_memory)
        row.addWidget(self.park_readout)
        self.setLayout(row)

    @property
    def parking(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def has_draft(self) -> bool:
        info = self._backend.model_info
        return info is not None and bool(getattr(info, "draft", ""))

    def update_buttons(self) -> None:
        """Park only what is loaded, unpark only what is parked, and one action at a time; the
        "Draft model" choice only while a draft model is loaded beside the model."""
        info = self._backend.model_info
        if info is not self._info_seen:
            self._info_seen = info
            self.draft_parked = False
        has_model = info is not None
        parked = self._backend.parked
        has_draft = self.has_draft
        self._offer_draft(has_draft)
        if self.park_selector.currentData() == "draft":
            # A parked target has no draft to free; its unpark brings the draft back.
            self.park_button.setEnabled(
                has_draft and not parked and not self.draft_parked and not self.parking
            )
            self.unpark_button.setEnabled(has_draft and not parked and self.draft_parked and not self.parking)
            return
        self.park_button.setEnabled(has_model and not parked and not self.parking)
        self.unpark_button.setEnabled(has_model and parked and not self.parking)

    def _offer_draft(self, has_draft: bool) -> None:
        index = self.park_selector.findData("draft")
        item = self.park_selector.model().item(index)  # type: ignore[attr-defined]
        if item is not None and item.isEnabled() != has_draft:
            item.setEnabled(has_draft)
            item.setToolTip("" if has_draft else "No draft model is loaded (File > Load draft model…)")
        if not has_draft and self.park_selector.currentIndex() == index:
            self.park_selector.setCurrentIndex(self.park_selector.findData("all"))

    def restart_idle_countdown(self) -> None:
        """After an answer, load or unpark: the engine counts its idle time from there."""
        if self._backend.parked or self._backend.model_info is None:
            self.park_readout.stop()
        else:
            self.park_readout.restart()

    def start_park(self) -> asyncio.Task[ParkResult]:
        return self._start(park=True)

    def start_unpark(self) -> asyncio.Task[ParkResult]:
        return self._start(park=False)

    def _start(self, *, park: bool) -> asyncio.Task[ParkResult]:
        selector = str(self.park_selector.currentData())
        self.task = asyncio.ensure_future(self.set_parked(park, selector))
        self.update_buttons()  # now, not when the task first runs: a second click must see it
        return self.task

    async def set_parked(self, park: bool, selector: str) -> ParkResult:
        """Park or unpark `selector` and say what it freed or took; never raises."""
        self._hooks.say(f"{'Parking' if park else 'Unparking'} ({selector})…")
        try:
            backend = self._backend
            result = await (backend.park(selector) if park else backend.unpark(selector))
        except Exception as exc:  # the backend promises not to raise; a bug must not kill the window
            log.exception("park/unpark raised")
            # LOAD_FAILED is only the nearest code: what the user sees is the detail.
            error = EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
            result = ParkResult(selector, self._backend.parked, error=error)
        if self._hooks.closed():
            return result
        self.task = None  # done: the buttons below must not count it as running
        if selector == "draft" and result.error is None and self.has_draft:
            self.draft_parked = park
        self._hooks.model_changed()
        if result.error is None:
            self.restart_idle_countdown()
        if result.memory is not None:
            self._hooks.show_memory(result.memory)
        else:
            self._hooks.refresh_memory()
        if result.error is not None:
            action = "park" if park else "unpark"
            self._hooks.warn(f"Could not {action} the model: {result.error.detail}")
        elif result.bytes:
            moved = f"freed {format_bytes(result.bytes)}" if park else f"loaded {format_bytes(result.bytes)}"
            done = "Parked" if park else "Unparked"
            self._hooks.say(f"{done} ({selector}): {moved} in {result.seconds:.1f} s")
        else:
            self._hooks.say(f"{'Park' if park else 'Unpark'} ({selector}): nothing to do")
        return result
