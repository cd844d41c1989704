"""The main window: chats on the left, the conversation and the composer on the right.

Everything runs on the Qt thread under qasync. The window never blocks on the engine: loads and
answers are asyncio tasks awaiting the ChatBackend, and their text arrives in batches through
`on_delta`. History is written as the answer streams, so nothing typed or generated is lost.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPushButton,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import (
    DeviceChoice,
    GenerateResult,
    ModelInfo,
)
from ds4desk.history import History
from ds4desk.settings import BUILT_IN_MODEL, Settings
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.banners import (
    LOAD_FAILED,
    ElidedLabel,
    NoModelBar,
    NoticeBar,
)
from ds4desk.ui.chat_options import ChatOptions
from ds4desk.ui.chat_view import ChatView
from ds4desk.ui.composer import Composer
from ds4desk.ui.conversation import Generation
from ds4desk.ui.device_choice import DeviceFallback, DeviceLister
from ds4desk.ui.model_loader import LoaderHooks, ModelLoader
from ds4desk.ui.model_picker import ModelPicker
from ds4desk.ui.park_controls import ParkControls, ParkHooks
from ds4desk.ui.remote_actions import RemoteActions, RemoteHooks
from ds4desk.ui.serve_control import LocalServer, ServeControl, ServeHooks
from ds4desk.ui.sidebar import Sidebar
from ds4desk.ui.theme import ThemeWatcher
from ds4desk.ui.window_answers import SEND_HELP, Answering
from ds4desk.ui.window_chats import ChatNavigation
from ds4desk.ui.window_docks import DEFAULT_SIZE, DockPanels
from ds4desk.ui.window_loading import ModelLoading

WINDOW_TITLE = "ds4desk"
SERVE_FAILED = "serve-failed"  # the notice of a local server that could not start
# The conversation keeps at least this width when docks open beside it: the park row, the chat
# options and the composer's buttons need it.
MIN_CHAT_WIDTH = 520
SIDEBAR_MIN_WIDTH = 180  # the chat list stays readable when docks open


class MainWindow(Answering, DockPanels, ModelLoading, ChatNavigation, QMainWindow):
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
            + self._prompt_math_line(info)
        )

    def _prompt_math_line(self, info: ModelInfo) -> str:
        """What Settings > CPU prompt math came to for a model on the CPU; "" on a GPU."""
        done = getattr(info, "cpu_prefill", "")
        if not done:
            return ""
        if self.settings.cpu_prefill == "bfloat16" and done != "bfloat16":
            return "\nCPU prompt math: float32 (this CPU does not multiply bfloat16 natively)"
        return f"\nCPU prompt math: {done}"

    # ---- waiting -------------------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Until no load, park or answer is running (tests, and a clean shutdown)."""
        while True:
            tasks = (self.model_loader.task, self._send_task, self.park_controls.task, *self._panel_tasks())
            pending = [t for t in tasks if t is not None and not t.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    # ---- shutdown -------------------------------------------------------------------------

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
