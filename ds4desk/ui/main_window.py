"""The main window: chats on the left, the conversation and the composer on the right.

Everything runs on the Qt thread under qasync. The window never blocks on the engine: loads and
answers are asyncio tasks awaiting the ChatBackend, and their text arrives in batches through
`on_delta`. History is written as the answer streams, so nothing typed or generated is lost.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
from pathlib import Path
from typing import Any

import shiboken6
from PySide6.QtCore import QByteArray, Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPushButton,
    QScrollArea,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import (
    DeviceChoice,
    EngineError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    MemoryStats,
    ModelInfo,
    SaveSnapshot,
    TextDelta,
    ThinkingFormat,
)
from ds4desk.history import LEAF, History
from ds4desk.remote import is_remote
from ds4desk.settings import BUILT_IN_MODEL, Settings
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.banners import (
    LOAD_FAILED,
    NO_MODEL_HELP,
    NO_MODEL_TITLE,
    ElidedLabel,
    NoModelBar,
    NoticeBar,
)
from ds4desk.ui.chat_options import ChatOptions
from ds4desk.ui.chat_view import ChatView, NoteKind, counts_as_thinking
from ds4desk.ui.composer import Composer
from ds4desk.ui.conversation import Generation, conversation, message_note
from ds4desk.ui.device_choice import DeviceFallback, DeviceLister
from ds4desk.ui.markdown_render import split_thinking
from ds4desk.ui.markdown_render import with_think_tag as _with_think_tag
from ds4desk.ui.model_loader import LoaderHooks, ModelLoader
from ds4desk.ui.model_picker import ModelPicker
from ds4desk.ui.park_controls import ParkControls, ParkHooks
from ds4desk.ui.perf_panel import PerfPanel
from ds4desk.ui.remote_actions import RemoteActions, RemoteHooks
from ds4desk.ui.serve_control import LocalServer, ServeControl, ServeHooks
from ds4desk.ui.sidebar import UNTITLED, Sidebar
from ds4desk.ui.slot_panel import SlotPanel
from ds4desk.ui.stats_format import status_speed
from ds4desk.ui.theme import ThemeWatcher
from ds4desk.ui.window_chats import ChatNavigation
from ds4desk.ui.window_loading import ModelLoading

log = logging.getLogger(__name__)

WINDOW_TITLE = "ds4desk"
SEND_HELP = "Send (Enter or Ctrl+Enter)"
EMPTY_CHAT = "Ask anything. Answers stream in here."
# One short line: QTextBrowser draws its placeholder unwrapped; the bar above says the rest.
NO_MODEL_CHAT = "No model is loaded: load one with the buttons above."
SERVE_FAILED = "serve-failed"  # the notice of a local server that could not start
DEFAULT_SIZE = (1100, 750)
# The conversation keeps at least this width when docks open beside it: the park row, the chat
# options and the composer's buttons need it.
MIN_CHAT_WIDTH = 520
DOCK_WIDTH = 340  # a dock's width when it first opens; the user may drag it wider
SIDEBAR_MIN_WIDTH = 180  # the chat list stays readable when docks open


class MainWindow(ModelLoading, ChatNavigation, QMainWindow):
    def __init__(
        self,
        backend: ChatBackend,
        history: History,
        settings: Settings,
        *,
        settings_path: Path | None = None,
        device_override: str | None = None,
        list_devices: DeviceLister | None = None,
        local_server: LocalServer | None = None,
        parent: QWidget | None = None,
    ) -> None:
        """`settings_path`: where to save settings the window changes (None: don't save).
        `device_override`: the --device flag, used for this session's loads only.
        `list_devices`: asks the engine side which devices this torch sees (None: not known, the
        device is not checked before a load). `local_server`: serves the window's engine over the
        OpenAI API when Settings say so (None: the option is greyed out)."""
        super().__init__(parent)
        self.backend = backend
        self.history = history
        self.settings = settings
        self._settings_path = settings_path
        self._device_override = device_override
        self._list_devices = list_devices
        self.device_choices: list[DeviceChoice] | None = None  # once the engine side listed them
        self.device_fallback: DeviceFallback | None = None  # the device used instead of a missing one
        self._device_task: asyncio.Task[None] | None = None  # listing them for an open Settings
        self._loads_running = 0
        self._answering = False  # Send is off while an answer is written
        self.current_chat_id: int | None = None
        self._generation: Generation | None = None
        self._send_task: asyncio.Task[GenerateResult | None] | None = None
        self._closed = False
        self.current_model_path: str | None = None  # what the loaded model was opened as
        self.model_picker: ModelPicker | None = None
        self._loads_done = 0  # the first load also starts the engine: its status says so
        self._undo_steps_at_delete: int | None = None  # the composer's undo stack when a chat was deleted

        self.setWindowTitle(WINDOW_TITLE)
        self.resize(*DEFAULT_SIZE)
        self.setMinimumSize(640, 420)
        self._build_widgets()
        self._build_slot_and_perf_docks()
        self._build_actions()
        self._build_status_bar()
        # Drops, File > Open recent, load progress and Cancel; it owns the running load.
        self.model_loader = ModelLoader(
            self,
            backend,
            settings,
            LoaderHooks(
                load=lambda path: self.load_model(path, remember=True),
                say=self.set_status,
                warn=functools.partial(self.set_status, error=True),
                status_text=self.status_label.text,
                show_error=lambda text: self.show_notice(text, key=LOAD_FAILED),
                save_settings=self._save_settings,
                closed=lambda: self._closed,
            ),
            open_action=self.open_model_action,
            device_override=device_override,
        )
        self.model_loader.loading_changed.connect(self._update_send)
        self.model_loader.loading_changed.connect(self._update_draft_action)
        self.serve_control = ServeControl(
            local_server,
            settings,
            ServeHooks(
                say=self.set_status,
                warn=self._serve_failed,
                started=lambda: self.notice_bar.remove(SERVE_FAILED),
                served=self.perf_panel.add_served,
                closed=lambda: self._closed,
            ),
            self,
        )
        # The first permanent widget, after the one status line: the URL before the speed and model.
        self.statusBar().insertPermanentWidget(1, self.serve_control.label)
        self.restore_window_state()
        self._follow_theme()
        self._refresh_sidebar()
        self._show_model(backend.model_info)
        self.composer.setFocus()  # given the focus once the window is shown and active
        if settings.serve_on_localhost and self.serve_control.available:
            self.serve_control.apply()  # before a model is there: requests get 503 until it is

    # ---- construction ---------------------------------------------------------------------

    def _build_widgets(self) -> None:
        self.sidebar = sidebar = Sidebar(self.history)
        self.new_chat_button = sidebar.new_chat_button
        self.chat_list = sidebar.chat_list
        sidebar.new_chat_requested.connect(self.new_chat)
        # Picked in the list, the list keeps the focus (arrows walk the chats, Del and F2 work);
        # typing there goes on in the composer (eventFilter).
        sidebar.chat_selected.connect(lambda chat_id: self.open_chat(chat_id, focus_composer=False))
        self.chat_list.installEventFilter(self)
        sidebar.delete_requested.connect(self.delete_chat)
        sidebar.chat_restored.connect(self._on_chat_restored)

        self.chat_view = ChatView()
        self.chat_view.action_requested.connect(self._on_message_action)
        self.composer = Composer()
        self.composer.submitted.connect(self.submit)
        self.chat_options = ChatOptions(self.settings)
        self.chat_options.changed.connect(self._save_settings)
        self.chat_options.custom_requested.connect(self.open_settings)
        self.send_button = QPushButton("Send", objectName="SendButton")
        self.send_button.setToolTip(SEND_HELP)
        self.send_button.setAccessibleName("Send")
        self.send_button.clicked.connect(self.submit)
        self.stop_button = QPushButton("Stop", objectName="StopButton")
        self.stop_button.setAccessibleName("Stop")
        self.stop_button.setToolTip("Stop the answer (Esc); what was written stays")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        for button in (self.send_button, self.stop_button):
            button.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # keep the focus in the composer
            button.setCursor(Qt.CursorShape.PointingHandCursor)
        buttons = QVBoxLayout()
        buttons.setSpacing(6)
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        composer_row = QHBoxLayout()
        composer_row.setSpacing(8)
        composer_row.addWidget(self.composer, 1)
        composer_row.addLayout(buttons)

        park_box = self._build_park_row()

        main = QWidget(objectName="ChatPane")
        # Not on the pane itself: an explicit minimum would override what its rows (the park row,
        # the chat options) need; the conversation's own minimum adds to theirs instead.
        self.chat_view.setMinimumWidth(MIN_CHAT_WIDTH)
        self.chat_pane = main
        column = QVBoxLayout(main)
        column.setContentsMargins(0, 0, 0, 12)
        column.setSpacing(10)
        self.notice_bar = NoticeBar()
        self.notice_label, self.notice_dismiss = self.notice_bar.label, self.notice_bar.dismiss_button
        self.no_model_bar = NoModelBar(
            open_model=lambda: self.open_model_action.trigger(),
            load_built_in=lambda: self.model_loader.open_path(BUILT_IN_MODEL),
            choose_model=lambda: self.open_model_picker(),
        )
        self.built_in_button = self.no_model_bar.built_in_button
        column.addWidget(self.notice_bar)
        column.addWidget(self.no_model_bar)
        column.addWidget(self.chat_view, 1)
        column.addWidget(park_box)
        column.addWidget(self.chat_options)
        composer_box = QWidget(objectName="ComposerBox")
        composer_box.setLayout(composer_row)
        composer_row.setContentsMargins(16, 0, 16, 0)
        column.addWidget(composer_box)

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(sidebar)
        splitter.addWidget(main)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([250, 850])
        splitter.setChildrenCollapsible(False)
        sidebar.setMinimumWidth(SIDEBAR_MIN_WIDTH)
        self.splitter = splitter
        self.setCentralWidget(splitter)

    def _build_park_row(self) -> ParkControls:
        idle_s = self.settings.idle_park_minutes * 60 if self.settings.idle_park_minutes > 0 else None
        hooks = ParkHooks(
            say=self.set_status,
            warn=functools.partial(self.set_status, error=True),
            model_changed=lambda: self._show_model(self.backend.model_info),
            show_memory=self._show_memory,
            refresh_memory=self.refresh_memory,
            closed=lambda: self._closed,
        )
        self.park_controls = controls = ParkControls(self.backend, idle_s, hooks)
        self.park_selector = controls.park_selector
        self.park_button, self.unpark_button = controls.park_button, controls.unpark_button
        self.park_readout = controls.park_readout
        return controls

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

    def _build_actions(self) -> None:
        self.open_model_action = QAction("&Open model…", self)
        self.open_model_action.setShortcut(QKeySequence("Ctrl+O"))
        self.open_model_action.setStatusTip("Load a model folder (safetensors) or a .gguf file")
        self.choose_model_action = QAction("&Choose model…", self)
        self.choose_model_action.setShortcut(QKeySequence("Ctrl+L"))
        self.choose_model_action.setStatusTip(
            "The built-in model, recent models and those in your models folder, with their sizes"
        )
        self.choose_model_action.triggered.connect(self.open_model_picker)
        self.load_draft_action = QAction("Load &draft model…", self)
        self.load_draft_action.setStatusTip(
            "A small model with the same vocabulary, loaded beside this one for speculative decoding"
        )
        self.load_draft_action.triggered.connect(self.choose_draft_model)
        self.load_draft_action.setEnabled(False)
        self.new_chat_action = QAction("&New chat", self)
        self.new_chat_action.setShortcut(QKeySequence("Ctrl+N"))
        self.new_chat_action.triggered.connect(self.new_chat)
        self.quit_action = QAction("&Quit", self)
        self.quit_action.setShortcut(QKeySequence("Ctrl+Q"))
        self.quit_action.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
        self.quit_action.triggered.connect(self.close)
        self.stop_action = QAction("Stop", self)
        self.stop_action.setShortcut(QKeySequence(Qt.Key.Key_Escape))
        self.stop_action.triggered.connect(self.stop)
        self.addAction(self.stop_action)  # shortcut only, no menu entry
        self.settings_action = QAction("&Settings…", self)
        self.settings_action.setShortcut(QKeySequence("Ctrl+,"))
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
        self.settings_action.triggered.connect(self.open_settings)
        self.search_action = QAction("&Search chats", self)
        self.search_action.setShortcuts([QKeySequence("Ctrl+F"), QKeySequence("Ctrl+K")])
        self.search_action.triggered.connect(self.sidebar.focus_search)
        self.undo_delete_action = QAction("&Undo delete chat", self)
        # A focused text box keeps its own Ctrl+Z, except the composer right after a delete
        # (eventFilter): the delete is then the last thing done.
        self.undo_delete_action.setShortcut(QKeySequence("Ctrl+Z"))
        self.undo_delete_action.triggered.connect(self.sidebar.undo_delete)
        # F2 and Del act on the chat list's current chat; typing in a text box keeps its own keys.
        self.rename_action = QAction("&Rename chat", self)
        self.rename_action.setShortcut(QKeySequence(Qt.Key.Key_F2))
        self.rename_action.triggered.connect(self.rename_current_chat)
        self.delete_action = QAction("&Delete chat", self)
        self.delete_action.setShortcut(QKeySequence(QKeySequence.StandardKey.Delete))
        self.delete_action.setStatusTip("Delete the chat selected in the list (Ctrl+Z brings it back)")
        self.delete_action.triggered.connect(self.delete_current_chat)
        # Del means "delete this chat" only in the chat list; everywhere else (a text box, the
        # conversation, a dock's table) it is that widget's own key.
        self.delete_action.setShortcutContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
        self.sidebar.addAction(self.delete_action)
        self.composer.installEventFilter(self)

        self.remote = RemoteActions(
            RemoteHooks(
                window=self,
                backend=self.backend,
                settings=self.settings,
                save_settings=self._save_settings,
                show_model=self._show_model,
                set_status=self.set_status,
                answering=lambda: self._answering,
                local_only=[self.park_controls, self.slot_panel],
            )
        )
        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction(self.open_model_action)
        file_menu.addAction(self.choose_model_action)
        file_menu.addAction(self.load_draft_action)
        file_menu.addAction(self.remote.connect_action)
        file_menu.addAction(self.remote.disconnect_action)
        file_menu.addAction(self.new_chat_action)
        file_menu.addAction(self.settings_action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        edit_menu = self.menuBar().addMenu("&Edit")
        for action in (self.search_action, self.rename_action, self.delete_action, self.undo_delete_action):
            edit_menu.addAction(action)
        view_menu = self.menuBar().addMenu("&View")
        self.slot_dock_action = self.slot_dock.toggleViewAction()
        self.slot_dock_action.setText("Snapshot s&lots")
        self.slot_dock_action.setStatusTip("List the snapshot slots; free, pin, save or load them")
        self.perf_dock_action = self.perf_dock.toggleViewAction()
        self.perf_dock_action.setText("&Live speed")
        self.perf_dock_action.setStatusTip("Live decode speed, prefill speed, first token and memory")
        view_menu.addAction(self.slot_dock_action)
        view_menu.addAction(self.perf_dock_action)

    def _follow_theme(self) -> None:
        """Light or dark as the system says, now and whenever it switches."""
        app = QApplication.instance()
        if isinstance(app, QApplication):
            self.theme_watcher = ThemeWatcher(app, self)
            self.theme_watcher.changed.connect(self.chat_view.set_dark)
            self.chat_view.set_dark(self.theme_watcher.dark)

    def _build_status_bar(self) -> None:
        self.status_label = ElidedLabel("Ready", objectName="StatusLabel")
        self.model_label = QLabel(objectName="ModelLabel")
        self.speed_label = QLabel(objectName="SpeedLabel")
        self.model_button = QToolButton(objectName="ModelPickerButton")
        self.model_button.setDefaultAction(self.choose_model_action)
        self.model_button.setText("Models…")
        self.model_button.setAccessibleName("Choose a model")
        self.model_button.setToolTip("Switch models: built-in, recent, or from your models folder (Ctrl+L)")
        self.model_button.setAutoRaise(True)
        bar = self.statusBar()
        bar.setSizeGripEnabled(False)
        bar.addWidget(self.status_label, 1)
        bar.addPermanentWidget(self.speed_label)
        bar.addPermanentWidget(self.model_label)
        bar.addPermanentWidget(self.model_button)

    # ---- status ---------------------------------------------------------------------------

    def show_notice(self, text: str, key: str | None = None) -> None:
        """Shown above the chat until dismissed; several notices stack (one per `key`)."""
        self.notice_bar.add(text, key)
        self.set_status(text, error=True)

    def dismiss_notices(self) -> None:
        self.notice_bar.dismiss()

    def set_status(self, text: str, *, error: bool = False) -> None:
        self.status_label.setText(text)  # elided to the room it has; the whole text is its tooltip
        if self.status_label.property("error") != error:
            self.status_label.setProperty("error", error)
            # A dynamic property only restyles after a re-polish.
            self.status_label.style().unpolish(self.status_label)
            self.status_label.style().polish(self.status_label)

    def _serve_failed(self, text: str) -> None:
        """A port already taken (or the like): a notice that stays, the window goes on unserved."""
        self.show_notice(f"{text}. Choose another port in Settings > Local server.", key=SERVE_FAILED)

    def report_exception(self, summary: str) -> None:
        """The crash hooks land here: say it in the status bar, keep running."""
        if not self._closed:
            self.set_status(f"Internal error: {summary} (details in the crash log)", error=True)

    def _show_model(self, info: ModelInfo | None) -> None:
        self.park_controls.update_buttons()
        if hasattr(self, "remote"):  # not yet while the window is being built
            self.remote.apply_state()
        self.perf_panel.set_model(info.name if info is not None else None)  # marks a model switch
        self._update_send()
        self._update_draft_action()
        self.chat_options.offer_thinking(info is None or info.thinking.switch)
        if info is None:
            self.model_label.setText("No model loaded")
            self.model_label.setToolTip("")
            return
        parked = "  (parked)" if self.backend.parked else ""
        draft = getattr(info, "draft", "")
        with_draft = f"  ·  draft {Path(draft).name or draft}" if draft else ""
        self.model_label.setText(f"{info.name}  ·  {info.device}  ·  {info.dtype}{with_draft}{parked}")
        self.model_label.setToolTip(
            f"{info.architecture}, {info.parameters / 1e9:.2f} B parameters\n"
            f"context {info.context}, tokenizer {info.tokenizer}\n{info.path}"
            + (f"\ndraft model: {draft}" if draft else "")
        )

    # ---- sending and streaming ------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._send_task is not None and not self._send_task.done()

    def submit(self) -> None:
        """Enter or Send: take the composer's text and answer it in the background."""
        text = self.composer.text().strip()
        if not text:
            return
        if not self.can_send:
            self.set_status(f"{NO_MODEL_TITLE} {NO_MODEL_HELP}", error=True)
            return  # the text stays in the composer
        if self.busy:
            self.set_status("Still answering: press Stop (Esc) to interrupt it first.")
            return  # the text stays in the composer
        parent: int | str | None = LEAF
        edited = self.history.get_message(self.composer.finish_edit() or 0)
        if edited is not None and edited.chat_id == self.current_chat_id:
            parent = edited.parent_id  # the edit becomes a sibling: a new branch, the old one stays
        self.composer.clear()
        self._set_busy(True)  # now, not when the task first runs: a second Enter must see it
        self._send_task = asyncio.ensure_future(self.send_message(text, parent_id=parent))

    def stop(self) -> None:
        if self._generation is not None:
            self.backend.cancel(self._generation.request_id)
            self.set_status("Stopping…")
        elif self.composer.editing is not None:
            self.composer.cancel_edit()
            self.set_status("Edit cancelled.")

    async def wait_idle(self) -> None:
        """Until no load, park or answer is running (tests, and a clean shutdown)."""
        while True:
            tasks = (self.model_loader.task, self._send_task, self.park_controls.task, *self._panel_tasks())
            pending = [t for t in tasks if t is not None and not t.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    async def send_message(
        self, text: str | None, *, parent_id: int | str | None = LEAF
    ) -> GenerateResult | None:
        """Store and show the user's message, then stream the answer into history and the view.
        `parent_id`: where the message goes (LEAF: after the last one; else a new branch). With
        `text` None (regenerate) only a new answer is written, under `parent_id`."""
        self._set_busy(True)
        try:
            return await self._answer(text, parent_id)
        finally:
            self._generation = None
            if not self._closed:
                self._set_busy(False)

    async def _answer(self, text: str | None, parent_id: int | str | None) -> GenerateResult | None:
        chat_id = self.current_chat_id
        if chat_id is None or self.history.get_chat(chat_id) is None:
            if text is None:
                return None  # nothing to regenerate
            info = self.backend.model_info
            chat_id = self.history.create_chat(model=info.name if info else None).id
            self.current_chat_id = chat_id
            parent_id = LEAF
        branching = parent_id != LEAF
        answer_parent: int | str | None = LEAF
        if text is not None:
            user = self.history.add_message(chat_id, "user", text, parent_id=parent_id)
            if not branching:
                self.chat_view.add_message("user", text, message_id=user.id)
            else:
                self.open_chat(chat_id)  # the new branch, with its "< 2/2 >" switcher
        else:
            answer_parent = parent_id  # regenerate: a sibling of the old answer
        self._refresh_sidebar()
        # Let the loop draw the question before the answer's frame is made: two short steps rather
        # than one long one (in a long chat each new frame costs a relayout of the whole chat).
        await asyncio.sleep(0)
        if self._closed:
            return None

        # The engine keeps the current model answering while the next one loads: only wait without one.
        load = self.model_loader.task
        if load is not None and not load.done() and self.backend.model_info is None:
            self.set_status("Waiting for the model to finish loading…")
            await asyncio.wait([load])
            if self._closed:
                return None

        # Think only where the chat format has a thinking mode; the answer is shown as thinking only
        # from the model's own <think>, or from the one the prompt opened.
        info = self.backend.model_info
        chat_format = info.thinking if info is not None else ThinkingFormat()
        thinking = self.settings.thinking and chat_format.switch
        until = answer_parent if text is None else None  # regenerate: the question, not the old answer
        speculative, speculative_note = self._speculative_for(info)
        request = GenerateRequest(
            messages=conversation(self.history, chat_id, self.settings.system_prompt, until=until),
            sampling=self.settings.sampling(),
            max_new_tokens=self.settings.max_new_tokens,
            thinking=thinking,
            thinking_budget=self.settings.thinking_budget() if thinking else None,
            speculative=speculative,
            # The next turn's prompt starts with this one and its answer: keep the state there, so
            # a follow-up prefills only the new message.
            save_snapshot=SaveSnapshot(tag=str(chat_id)),  # the slot panel shows whose it is
        )
        row = self.history.add_message(chat_id, "assistant", "", parent_id=answer_parent, finished=False)
        generation = Generation(chat_id, request.request_id, self.history.streaming_writer(row.id))
        generation.think_tag_pending = chat_format.opened(thinking)
        self._generation = generation
        if self.current_chat_id == chat_id:
            if text is None:
                self.open_chat(chat_id)  # shows the new, still empty answer with its switcher
            else:
                self.chat_view.begin_stream(message_id=row.id)
        self.set_status("Answering…" + speculative_note)
        self.perf_panel.begin_answer()
        self.park_readout.stop()  # the engine does not count idle time while it answers

        def on_delta(delta: TextDelta) -> None:
            if self._closed:
                return
            self.perf_panel.on_delta(delta)
            text = delta.text
            if generation.think_tag_pending and text:
                generation.think_tag_pending = False
                text = _with_think_tag(text)
            before = generation.writer.text
            if counts_as_thinking(before, text):
                generation.thinking_tokens += len(delta.tokens)
            generation.writer.append(text)
            if self.current_chat_id == chat_id:
                self.chat_view.append_stream(text, len(delta.tokens))

        try:
            result = await self.backend.generate(request, on_delta)
        except Exception as exc:  # the backend promises not to raise; a bug must not wedge the window
            log.exception("generate raised")
            result = GenerateResult(
                request_id=request.request_id,
                error=EngineError(ErrorCode.DECODE_FAILED, f"{type(exc).__name__}: {exc}"),
            )
        if self._closed:
            return result  # closeEvent already saved what had streamed
        self._finish(generation, result)
        return result

    def _finish(self, generation: Generation, result: GenerateResult) -> None:
        cancelled = result.finish_reason == FinishReason.CANCELLED or (
            result.error is not None and result.error.code == ErrorCode.CANCELLED
        )
        if cancelled:
            reason = FinishReason.CANCELLED
        elif result.error is not None:
            reason = FinishReason.ERROR
        else:
            reason = result.finish_reason
        stats: dict[str, Any] = {"finish_reason": str(reason), **result.stats.to_json()}
        if result.error is not None and not cancelled:
            stats["error"] = result.error.to_json()
        # The engine's final text is the reference (it decodes the whole sequence at once); on an
        # error it has none, so what streamed stays.
        content = result.text or generation.writer.text
        if result.text and generation.writer.text.lstrip().startswith("<think>"):
            content = _with_think_tag(content)  # the same text as streamed, <think> included
        if split_thinking(content)[0] is not None:
            stats["thinking_tokens"] = generation.thinking_tokens
        finished = reason in (FinishReason.STOP, FinishReason.LENGTH)
        generation.writer.finish(finished=finished, stats=stats, content=content)
        info = self.backend.model_info
        if info is not None:
            self.history.set_chat_model(generation.chat_id, info.name)
        self._show_model(info)  # an answer to a parked model loads it back

        message = self.history.get_message(generation.writer.message_id)
        note, kind = message_note(message) if message else (None, NoteKind.INFO)
        if self.current_chat_id == generation.chat_id:
            self.chat_view.end_stream(
                content, note=note, note_kind=kind, thinking_tokens=stats.get("thinking_tokens")
            )
        self._refresh_sidebar()

        if reason == FinishReason.ERROR:
            error = result.error
            self.set_status(f"Generation failed: {error.detail if error else 'unknown error'}", error=True)
        elif cancelled:
            self.set_status("Stopped. The partial answer was kept.")
        else:
            self.set_status("Ready")
        self.perf_panel.end_answer(result.stats)
        self.park_controls.restart_idle_countdown()
        self.refresh_memory()
        if self.slot_dock.isVisible():
            self.slot_panel.refresh()
        # The same source as the answer's footer and the Live speed charts: one figure everywhere.
        speed_text, speed_tip = status_speed(result.stats)
        if speed_text:
            self.speed_label.setText(speed_text)
            self.speed_label.setToolTip(speed_tip)

    def _speculative_for(self, info: ModelInfo | None) -> tuple[str | None, str]:
        """The answer's speculative mode from Settings, and what to say of it. A remote model gets
        none (its server decides); "draft" without a draft model loaded answers with "auto" and says
        so, rather than failing the answer."""
        if info is None or is_remote(info):
            return None, ""
        mode = self.settings.speculative
        if mode == "draft" and not getattr(info, "draft", ""):
            return "auto", " (no draft model is loaded: File > Load draft model…; speculating with auto)"
        return mode, ""

    def _set_busy(self, busy: bool) -> None:
        # Set before the answer's task exists, and cleared while it still runs: `busy` cannot say.
        self._answering = busy
        self.stop_button.setEnabled(busy)
        self.remote.set_busy(busy)
        self._update_send()

    @property
    def can_send(self) -> bool:
        """A model is there to answer, or one is loading (a message sent meanwhile waits for it)."""
        loading = self._loads_running > 0 or self.model_loader.loading
        return self.backend.model_info is not None or loading

    def _update_send(self) -> None:
        """Send only when something can answer; otherwise the window says how to load a model."""
        if self._closed:
            return
        can_send = self.can_send
        self.send_button.setEnabled(can_send and not self._answering)
        self.send_button.setToolTip(SEND_HELP if can_send else NO_MODEL_HELP)
        self.no_model_bar.setVisible(not can_send)
        self.chat_view.setPlaceholderText(EMPTY_CHAT if can_send else NO_MODEL_CHAT)

    # ---- shutdown -------------------------------------------------------------------------

    # ---- window state across restarts -------------------------------------------------------

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

    def closeEvent(self, event: QCloseEvent) -> None:
        self.serve_control.shut_down()  # its requests are cut (so cancelled) before the engine stops
        self.remember_window_state()
        self._save_settings()
        self.sidebar.purge_pending()  # the undo window ends with the window
        if self._generation is not None:
            # The answer cannot finish now: save what streamed (unfinished) and stop the engine.
            self.backend.cancel(self._generation.request_id)
            self._generation.writer.flush()
        self._closed = True
        super().closeEvent(event)


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
