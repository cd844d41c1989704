"""Opening models: drag and drop anywhere on the window, File > Open and File > Open recent.

What was dropped is checked first: the engine's preflight reads headers only, on a worker thread,
so the window never waits on it. Something that is no model, or does not fit in memory, is refused
with its reason and nothing changes. Otherwise the window's load runs with a progress bar and a
Cancel button in the status bar; the engine keeps the current model until the new one is ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QEvent, QMimeData, QObject, Signal
from PySide6.QtGui import QAction, QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QFileDialog, QMainWindow, QMenu, QProgressBar, QPushButton, QWidget

from ds4desk.engine.api import WARM_UP_UNIT, EngineError, ErrorCode, LoadRequest, LoadResult, ModelPreview
from ds4desk.settings import BUILT_IN_LABEL, BUILT_IN_MODEL, MAX_RECENT_MODELS, Settings
from ds4desk.ui.backend import ChatBackend

log = logging.getLogger(__name__)

_DRAG_EVENTS = (QEvent.Type.DragEnter, QEvent.Type.DragMove)
PROGRESS_ROOM = "00000 / 00000 tensors"


def dropped_paths(mime: QMimeData | None) -> list[str]:
    """The local files and folders a drag carries (web links and text are not models)."""
    if mime is None or not mime.hasUrls():
        return []
    return [url.toLocalFile() for url in mime.urls() if url.isLocalFile() and url.toLocalFile()]


def remembered(recent: list[str], path: str) -> list[str]:
    """`recent` with `path` moved to the front, at most MAX_RECENT_MODELS long."""
    return [path, *(p for p in recent if p != path)][:MAX_RECENT_MODELS]


@dataclass(slots=True, frozen=True)
class LoaderHooks:
    """What the loader asks of the window it serves, and nothing more."""

    load: Callable[[str], Awaitable[LoadResult]]  # the window's load of a checked path, remembered
    say: Callable[[str], None]  # the status line
    warn: Callable[[str], None]  # the status line, as an error
    status_text: Callable[[], str]  # what the status line says now
    show_error: Callable[[str], None]  # a notice above the conversation, never a line in it
    save_settings: Callable[[], None]
    closed: Callable[[], bool]  # the window has closed: touch no widget


class ModelLoader(QObject):
    """Owns the running load (`task`): one at a time, whoever started it."""

    loading_changed = Signal()  # a load was tracked, or the tracked one ended

    def __init__(
        self,
        window: QMainWindow,
        backend: ChatBackend,
        settings: Settings,
        hooks: LoaderHooks,
        *,
        open_action: QAction,
        device_override: str | None = None,
    ) -> None:
        """`open_action`: File > Open model…, under which Open recent goes. `device_override`: the
        --device flag, used for this session's loads only."""
        super().__init__(window)
        self._window = window
        self._backend = backend
        self._settings = settings
        self._hooks = hooks
        self._open_action = open_action
        # The --device flag, or the device used instead of a missing one (the window decides).
        self.device_override = device_override
        self.last_preview: ModelPreview | None = None
        self.progress_updates = 0  # how many batches of progress reached the bar
        self.task: asyncio.Task[LoadResult] | None = None  # the load running or last run

        self.progress_bar = QProgressBar(objectName="LoadProgress")
        # Wide enough for "12345 / 12345 tensors" in the bar's own font: never wrapped or cut.
        room = self.progress_bar.fontMetrics().horizontalAdvance(PROGRESS_ROOM) + 32
        self.progress_bar.setMinimumWidth(room)
        self.progress_bar.setMaximumWidth(room + 80)
        self.progress_bar.setAccessibleName("Model loading progress")
        self.cancel_button = QPushButton("Cancel", objectName="CancelLoadButton")
        self.cancel_button.setToolTip("Stop loading; the model loaded before stays")
        self.cancel_button.setAccessibleName("Cancel loading")
        self.cancel_button.clicked.connect(self.cancel)
        bar = window.statusBar()
        bar.addPermanentWidget(self.progress_bar)
        bar.addPermanentWidget(self.cancel_button)
        self._show_progress(False)

        open_action.triggered.connect(self._on_open_model)
        self.recent_menu = QMenu("Open &recent", window, objectName="RecentModelsMenu")
        self.recent_menu.setToolTipsVisible(True)
        self._insert_recent_menu()
        self.rebuild_recent_menu()

        # Drops anywhere: the window, and the widgets that would otherwise take a dropped file's
        # path as text (the composer, the conversation).
        window.setAcceptDrops(True)
        window.installEventFilter(self)
        for child in window.findChildren(QWidget):
            if child.acceptDrops():
                child.installEventFilter(self)

    # ---- state ------------------------------------------------------------------------------

    @property
    def loading(self) -> bool:
        return self.task is not None and not self.task.done()

    def track(self, task: asyncio.Task[LoadResult]) -> asyncio.Task[LoadResult]:
        """`task` is now the running load: a message sent meanwhile waits for it."""
        self.task = task
        self.loading_changed.emit()
        task.add_done_callback(lambda _task: None if self._hooks.closed() else self.loading_changed.emit())
        return task

    # ---- drag and drop ----------------------------------------------------------------------

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind not in (*_DRAG_EVENTS, QEvent.Type.Drop):
            return False
        try:
            return self._drag_event(event, kind)  # type: ignore[arg-type]
        except Exception as exc:  # whatever was dropped, the window goes on
            log.exception("handling a drop failed")
            self._hooks.warn(f"Could not take what was dropped: {exc}")
            return True

    def _drag_event(self, event: QDragEnterEvent | QDropEvent, kind: QEvent.Type) -> bool:
        paths = dropped_paths(event.mimeData())
        if not paths:
            return False  # text and the like: the widget under the cursor handles it
        event.acceptProposedAction()
        if kind == QEvent.Type.Drop:
            if len(paths) > 1:
                self._hooks.say(f"{len(paths)} items dropped: opening the first, {Path(paths[0]).name}")
            self.open_path(paths[0])
        return True

    # ---- opening ----------------------------------------------------------------------------

    def open_path(self, path: str) -> asyncio.Task[LoadResult] | None:
        """Preflight `path`, then load it; None (and a status line) while another load runs."""
        if self.loading:
            self._hooks.warn(
                "A model is still loading: cancel it (Cancel, bottom right) before opening another."
            )
            return None
        return self.track(asyncio.ensure_future(self._open(path)))

    async def _open(self, path: str) -> LoadResult:
        if path == BUILT_IN_MODEL:  # ships with ds4desk and always fits: nothing to check
            return await self._hooks.load(path)
        name = Path(path).name or path
        request = self._settings.load_request(path, self.device_override)
        self._hooks.say(f"Checking {name}…")
        try:
            preview = await self._backend.preview(request)
        except Exception as exc:  # the backend promises not to raise; a bug must not kill the window
            log.exception("preview raised")
            error = EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
            preview = ModelPreview(path, error=error, message=error.detail)
        if self._hooks.closed():
            return LoadResult(error=EngineError(ErrorCode.CANCELLED, "the window closed"))
        self.last_preview = preview
        if preview.error is not None:
            return self._refuse(preview.error, f"{name} cannot be opened: {preview.error.detail}")
        if not preview.fits:
            error = EngineError(ErrorCode.OUT_OF_MEMORY, preview.message)
            return self._refuse(error, f"{name} does not fit: {preview.message}")
        return await self._hooks.load(path)

    def _on_open_model(self) -> None:
        path = self.choose_path("Open model")
        if path:
            self.open_path(path)

    def choose_path(self, title: str) -> str | None:
        """One dialog for both kinds: a .gguf file, or any file of a model folder (its folder is
        used). The engine decides whether it is a model. (File > Open model, File > Load draft model.)"""
        start = self._settings.last_model or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(
            self._window,
            title,
            str(Path(start).parent if Path(start).is_file() else start),
            "Models (*.gguf config.json *.safetensors);;All files (*)",
        )
        if not path:
            return None
        chosen = Path(path)
        return str(chosen if chosen.suffix.lower() == ".gguf" else chosen.parent)

    def _refuse(self, error: EngineError, text: str) -> LoadResult:
        """Nothing was loaded or let go: say why, in the status bar and a notice above the chat."""
        self._hooks.warn(text)
        self._hooks.show_error(text)
        return LoadResult(error=error)

    async def load(self, request: LoadRequest) -> LoadResult:
        """The backend's load, with the progress bar and the Cancel button up while it runs."""
        preview = self.last_preview
        if preview is not None and preview.path == request.path:
            self.progress_bar.setToolTip(preview.message)
            if preview.needs_unload:
                self._hooks.say(
                    f"{self._hooks.status_text()} Memory holds only one model: the current one is "
                    "unloaded first and cannot answer until this one is ready."
                )
        self._on_progress(0, 0, "tensors")
        self.cancel_button.setEnabled(True)
        self._show_progress(True)
        try:
            return await self._backend.load(request, self._on_progress)
        finally:
            if not self._hooks.closed():
                self._show_progress(False)

    def _on_progress(self, done: int, total: int, unit: str) -> None:
        if self._hooks.closed():
            return
        self.progress_updates += 1
        bar = self.progress_bar
        if total <= 0:
            bar.setRange(0, 0)  # busy: converting a GGUF, reading headers
            bar.setFormat("Preparing…")
            return
        bar.setRange(0, total)
        bar.setValue(min(done, total))
        # The load's last stage runs what a first answer would otherwise pay for (kernels, graphs).
        bar.setFormat("Warming up… %v / %m" if unit == WARM_UP_UNIT else f"%v / %m {unit}")

    def cancel(self) -> None:
        if not self.loading:
            return
        self._backend.cancel_load()
        self.cancel_button.setEnabled(False)  # once is enough; the load stops at its next tensor
        self._hooks.say("Cancelling the load…")

    def _show_progress(self, shown: bool) -> None:
        self.progress_bar.setVisible(shown)
        self.cancel_button.setVisible(shown)

    # ---- recent models ----------------------------------------------------------------------

    def _insert_recent_menu(self) -> None:
        """Under File > Open model…, wherever the File menu is."""
        opener = self._open_action
        for action in self._window.menuBar().actions():
            menu = action.menu()
            if isinstance(menu, QMenu) and opener in menu.actions():
                actions = menu.actions()
                after = actions[actions.index(opener) + 1] if opener is not actions[-1] else None
                if after is None:
                    menu.addMenu(self.recent_menu)
                else:
                    menu.insertMenu(after, self.recent_menu)
                return
        self._window.menuBar().addMenu(self.recent_menu)

    def remember(self, path: str) -> None:
        """A model loaded from `path`: the one to open next time, first in the recent list (the
        built-in model is always listed, and is what no last model means)."""
        settings = self._settings
        settings.last_model = None if path == BUILT_IN_MODEL else path
        self.add_recent(path)

    def add_recent(self, path: str) -> None:
        """First in the recent list, without becoming the model to open next time (a model given
        on the command line is for that session)."""
        if path != BUILT_IN_MODEL:
            self._settings.recent_models = remembered(self._settings.recent_models, path)
        self.rebuild_recent_menu()

    def rebuild_recent_menu(self) -> None:
        menu = self.recent_menu
        menu.clear()
        recent = self._settings.recent_models
        for path in recent:
            action = QAction(Path(path).name or path, menu)
            action.setToolTip(path)
            action.setStatusTip(path)
            action.setData(path)
            action.triggered.connect(lambda _checked=False, p=path: self.open_path(p))
            menu.addAction(action)
        if recent:
            menu.addSeparator()
        # Always there: the way back from a model that answers badly to the one that ships.
        self.built_in_action = QAction(BUILT_IN_LABEL, menu, objectName="BuiltInModelAction")
        self.built_in_action.setToolTip("The small model that ships with ds4desk")
        self.built_in_action.setStatusTip("The small model that ships with ds4desk")
        self.built_in_action.triggered.connect(lambda _checked=False: self.open_path(BUILT_IN_MODEL))
        menu.addAction(self.built_in_action)
        if recent:
            menu.addSeparator()
            menu.addAction("Clear recent models").triggered.connect(self.clear_recent)

    def clear_recent(self) -> None:
        self._settings.recent_models = []
        self._hooks.save_settings()
        self.rebuild_recent_menu()

    def recent_paths(self) -> list[str]:
        """What the menu offers, in its order (for the window's tests and accessibility checks)."""
        return [str(a.data()) for a in self.recent_menu.actions() if a.data()]
