"""The main window: chats on the left, the conversation and the composer on the right.

Everything runs on the Qt thread under qasync. The window never blocks on the engine: loads and
answers are asyncio tasks awaiting the ChatBackend, and their text arrives in batches through
`on_delta`. History is written as the answer streams, so nothing typed or generated is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QComboBox,
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import (
    EngineError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    LoadResult,
    ModelInfo,
    ParkResult,
    SaveSnapshot,
    TextDelta,
)
from ds4desk.history import Chat, History, Message, StreamingWriter
from ds4desk.settings import Settings
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.chat_view import ChatView, NoteKind
from ds4desk.ui.composer import Composer
from ds4desk.ui.markdown_render import split_thinking
from ds4desk.ui.speed_chart import SpeedChart
from ds4desk.ui.stats_format import format_bytes, stats_footer

log = logging.getLogger(__name__)

WINDOW_TITLE = "ds4desk"
UNTITLED = "New chat"
_CHAT_ID = Qt.ItemDataRole.UserRole
PARK_CHOICES = (("All models", "all"), ("Target model", "target"), ("Draft model", "draft"))


@dataclass(slots=True)
class _Generation:
    """The answer being written: its chat may not be the one on screen (the user can switch)."""

    chat_id: int
    request_id: int
    writer: StreamingWriter


def message_note(message: Message) -> tuple[str | None, NoteKind]:
    """What to say under an assistant message: how a finished one went (speed, reuse), or why an
    unfinished one stopped."""
    if message.role != "assistant":
        return None, NoteKind.INFO
    stats = message.stats or {}
    reason = stats.get("finish_reason")
    if message.finished:
        lines = [stats_footer(stats)]
        if reason == FinishReason.LENGTH:
            lines.insert(0, "Stopped at the length limit (max new tokens).")
        return "\n".join(line for line in lines if line) or None, NoteKind.INFO
    if reason == FinishReason.CANCELLED:
        return "Stopped.", NoteKind.INFO
    if reason == FinishReason.ERROR:
        error = stats.get("error") or {}
        detail = error.get("detail") or error.get("code") or "unknown error"
        return f"Generation failed: {detail}", NoteKind.ERROR
    return "Interrupted: ds4desk closed before this answer finished.", NoteKind.WARNING


class MainWindow(QMainWindow):
    def __init__(
        self,
        backend: ChatBackend,
        history: History,
        settings: Settings,
        *,
        settings_path: Path | None = None,
        device_override: str | None = None,
        parent: QWidget | None = None,
    ) -> None:
        """`settings_path`: where to save settings the window changes (None: don't save).
        `device_override`: the --device flag, used for this session's loads only."""
        super().__init__(parent)
        self.backend = backend
        self.history = history
        self.settings = settings
        self._settings_path = settings_path
        self._device_override = device_override
        self.current_chat_id: int | None = None
        self._generation: _Generation | None = None
        self._send_task: asyncio.Task[GenerateResult | None] | None = None
        self._load_task: asyncio.Task[LoadResult] | None = None
        self._park_task: asyncio.Task[ParkResult] | None = None
        self._closed = False

        self.setWindowTitle(WINDOW_TITLE)
        self.resize(1100, 750)
        self.setMinimumSize(640, 420)
        self._build_widgets()
        self._build_speed_dock()
        self._build_actions()
        self._build_status_bar()
        self._refresh_sidebar()
        self._show_model(backend.model_info)
        self.composer.setFocus()  # given the focus once the window is shown and active

    # ---- construction ---------------------------------------------------------------------

    def _build_widgets(self) -> None:
        sidebar = QWidget(objectName="Sidebar")
        self.new_chat_button = QPushButton("+  New chat", objectName="NewChatButton")
        self.new_chat_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_chat_button.clicked.connect(self.new_chat)
        self.chat_list = QListWidget(objectName="ChatList")
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.chat_list.customContextMenuRequested.connect(self._chat_menu)
        self.chat_list.currentItemChanged.connect(self._on_chat_selected)
        self.chat_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.chat_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        side = QVBoxLayout(sidebar)
        side.setContentsMargins(10, 12, 10, 10)
        side.setSpacing(10)
        side.addWidget(self.new_chat_button)
        side.addWidget(self.chat_list, 1)

        self.chat_view = ChatView()
        self.composer = Composer()
        self.composer.submitted.connect(self.submit)
        self.send_button = QPushButton("Send", objectName="SendButton")
        self.send_button.setToolTip("Send (Enter)")
        self.send_button.clicked.connect(self.submit)
        self.stop_button = QPushButton("Stop", objectName="StopButton")
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
        column = QVBoxLayout(main)
        column.setContentsMargins(0, 0, 0, 12)
        column.setSpacing(10)
        column.addWidget(self.chat_view, 1)
        column.addWidget(park_box)
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
        self.setCentralWidget(splitter)

    def _build_park_row(self) -> QWidget:
        """Park / Unpark sit right above the composer: freeing the GPU for something else and
        getting it back are everyday actions, not settings."""
        self.park_selector = QComboBox(objectName="ParkSelector")
        for label, selector in PARK_CHOICES:
            self.park_selector.addItem(label, selector)
        self.park_selector.setToolTip("Which model Park and Unpark act on")
        self.park_button = QPushButton("Park", objectName="ParkButton")
        self.park_button.setToolTip("Free the model's memory; the next answer loads it back")
        self.park_button.clicked.connect(self.start_park)
        self.unpark_button = QPushButton("Unpark", objectName="UnparkButton")
        self.unpark_button.setToolTip("Load the parked model back now")
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
        box = QWidget(objectName="ParkRow")
        box.setLayout(row)
        return box

    def _build_speed_dock(self) -> None:
        """Per-answer speed over the session; hidden until asked for (View > Speed)."""
        self.speed_chart = SpeedChart()
        self.speed_dock = QDockWidget("Speed", self, objectName="SpeedDock")
        self.speed_dock.setWidget(self.speed_chart)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.speed_dock)
        self.speed_dock.hide()

    def _build_actions(self) -> None:
        self.open_model_action = QAction("&Open model…", self)
        self.open_model_action.setShortcut(QKeySequence("Ctrl+O"))
        self.open_model_action.setStatusTip("Load a model folder (safetensors) or a .gguf file")
        self.open_model_action.triggered.connect(self._on_open_model)
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

        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction(self.open_model_action)
        file_menu.addAction(self.new_chat_action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        self.speed_dock_action = self.speed_dock.toggleViewAction()  # stays in step with the dock's X
        self.speed_dock_action.setText("&Speed")
        self.speed_dock_action.setStatusTip("Show decode speed and time to first token per answer")
        view_menu = self.menuBar().addMenu("&View")
        view_menu.addAction(self.speed_dock_action)

    def _build_status_bar(self) -> None:
        self.status_label = QLabel("Ready", objectName="StatusLabel")
        self.model_label = QLabel(objectName="ModelLabel")
        self.speed_label = QLabel(objectName="SpeedLabel")
        bar = self.statusBar()
        bar.setSizeGripEnabled(False)
        bar.addWidget(self.status_label, 1)
        bar.addPermanentWidget(self.speed_label)
        bar.addPermanentWidget(self.model_label)

    # ---- status ---------------------------------------------------------------------------

    def set_status(self, text: str, *, error: bool = False) -> None:
        self.status_label.setText(text)
        self.status_label.setToolTip(text)
        if self.status_label.property("error") != error:
            self.status_label.setProperty("error", error)
            # A dynamic property only restyles after a re-polish.
            self.status_label.style().unpolish(self.status_label)
            self.status_label.style().polish(self.status_label)

    def report_exception(self, summary: str) -> None:
        """The crash hooks land here: say it in the status bar, keep running."""
        if not self._closed:
            self.set_status(f"Internal error: {summary} (details in the crash log)", error=True)

    def _show_model(self, info: ModelInfo | None) -> None:
        self._update_park_buttons()
        if info is None:
            self.model_label.setText("No model loaded")
            self.model_label.setToolTip("")
            return
        parked = "  (parked)" if self.backend.parked else ""
        self.model_label.setText(f"{info.name}  ·  {info.device}  ·  {info.dtype}{parked}")
        self.model_label.setToolTip(
            f"{info.architecture}, {info.parameters / 1e9:.2f} B parameters\n"
            f"context {info.context}, tokenizer {info.tokenizer}\n{info.path}"
        )

    # ---- parking ----------------------------------------------------------------------------

    @property
    def parking(self) -> bool:
        return self._park_task is not None and not self._park_task.done()

    def _update_park_buttons(self) -> None:
        """Park only what is loaded, unpark only what is parked, and one action at a time."""
        has_model = self.backend.model_info is not None
        parked = self.backend.parked
        self.park_button.setEnabled(has_model and not parked and not self.parking)
        self.unpark_button.setEnabled(has_model and parked and not self.parking)

    def start_park(self) -> asyncio.Task[ParkResult]:
        return self._start_park_action(park=True)

    def start_unpark(self) -> asyncio.Task[ParkResult]:
        return self._start_park_action(park=False)

    def _start_park_action(self, *, park: bool) -> asyncio.Task[ParkResult]:
        selector = str(self.park_selector.currentData())
        self._park_task = asyncio.ensure_future(self.set_parked(park, selector))
        self._update_park_buttons()  # now, not when the task first runs: a second click must see it
        return self._park_task

    async def set_parked(self, park: bool, selector: str) -> ParkResult:
        """Park or unpark `selector` and say what it freed or took; never raises."""
        self.set_status(f"{'Parking' if park else 'Unparking'} ({selector})…")
        try:
            result = await (self.backend.park(selector) if park else self.backend.unpark(selector))
        except Exception as exc:  # the backend promises not to raise; a bug must not kill the window
            log.exception("park/unpark raised")
            # LOAD_FAILED is only the nearest code: what the user sees is the detail.
            error = EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}")
            result = ParkResult(selector, self.backend.parked, error=error)
        if self._closed:
            return result
        self._park_task = None  # done: the buttons below must not count it as running
        self._show_model(self.backend.model_info)
        if result.error is not None:
            action = "park" if park else "unpark"
            self.set_status(f"Could not {action} the model: {result.error.detail}", error=True)
        elif result.bytes:
            moved = f"freed {format_bytes(result.bytes)}" if park else f"loaded {format_bytes(result.bytes)}"
            done = "Parked" if park else "Unparked"
            self.set_status(f"{done} ({selector}): {moved} in {result.seconds:.1f} s")
        else:
            self.set_status(f"{'Park' if park else 'Unpark'} ({selector}): nothing to do")
        return result

    # ---- model loading --------------------------------------------------------------------

    def start_load(self, path: str | None = None, *, remember: bool = False) -> asyncio.Task[LoadResult]:
        """Load in the background; a message sent meanwhile waits for it."""
        self._load_task = asyncio.ensure_future(self.load_model(path, remember=remember))
        return self._load_task

    async def load_model(self, path: str | None = None, *, remember: bool = False) -> LoadResult:
        """`remember`: a successful load becomes the model to load next time."""
        request = self.settings.load_request(path, self._device_override)
        label = Path(request.path).name if request.path else "the default model"
        self.set_status(f"Loading model {label}…")
        self.model_label.setText("Loading…")
        self.open_model_action.setEnabled(False)
        started = time.monotonic()
        try:
            result = await self.backend.load(request)
        except Exception as exc:  # the backend promises not to raise; a bug must not kill the window
            log.exception("load raised")
            result = LoadResult(error=EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}"))
        if self._closed:
            return result
        self.open_model_action.setEnabled(True)
        self._show_model(self.backend.model_info)  # a failed load may have kept the previous model
        if result.ok and result.info is not None:
            seconds = result.seconds or time.monotonic() - started
            self.set_status(f"Model {result.info.name} loaded in {seconds:.1f} s")
            if remember and request.path:
                self.settings.last_model = request.path
                self._save_settings()
        else:
            detail = result.error.detail if result.error else "the engine gave no reason"
            self.set_status(f"Could not load the model: {detail}", error=True)
            self.chat_view.add_error(f"Could not load the model ({label}): {detail}")
        return result

    def _on_open_model(self) -> None:
        path = self._choose_model_path()
        if path:
            self.start_load(path, remember=True)

    def _choose_model_path(self) -> str | None:
        """One dialog for both kinds: a .gguf file, or any file of a model folder (its folder is
        used). The engine decides whether it is a model."""
        start = self.settings.last_model or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(
            self,
            "Open model",
            str(Path(start).parent if Path(start).is_file() else start),
            "Models (*.gguf config.json *.safetensors);;All files (*)",
        )
        if not path:
            return None
        chosen = Path(path)
        return str(chosen if chosen.suffix.lower() == ".gguf" else chosen.parent)

    def _save_settings(self) -> None:
        if self._settings_path is None:
            return
        try:
            self.settings.save(self._settings_path)
        except OSError as exc:
            self.set_status(f"Could not save settings: {exc}", error=True)

    # ---- chats ----------------------------------------------------------------------------

    def _refresh_sidebar(self) -> None:
        self.chat_list.blockSignals(True)  # rebuilding must not look like the user picking a chat
        try:
            self.chat_list.clear()
            for chat in self.history.list_chats():
                item = QListWidgetItem(chat.title or UNTITLED)
                item.setData(_CHAT_ID, chat.id)
                item.setToolTip(_chat_tooltip(chat))
                self.chat_list.addItem(item)
                if chat.id == self.current_chat_id:
                    self.chat_list.setCurrentItem(item)
        finally:
            self.chat_list.blockSignals(False)

    def _on_chat_selected(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if item is not None:
            self.open_chat(int(item.data(_CHAT_ID)))

    def open_chat(self, chat_id: int) -> None:
        if self.history.get_chat(chat_id) is None:
            return
        self.current_chat_id = chat_id
        self.chat_view.clear_messages()
        generation = self._generation if self._generation and self._generation.chat_id == chat_id else None
        for message in self.history.messages(chat_id):
            if generation and message.id == generation.writer.message_id:
                self.chat_view.begin_stream(generation.writer.text)  # still streaming: keep following it
                continue
            note, kind = message_note(message)
            self.chat_view.add_message(message.role, message.content, note=note, note_kind=kind)
        self._select_in_sidebar(chat_id)
        self.composer.setFocus()

    def new_chat(self) -> None:
        """The chat row is created with the first message, so empty chats never pile up."""
        self.current_chat_id = None
        self.chat_view.clear_messages()
        self._select_in_sidebar(None)
        self.composer.setFocus()

    def rename_chat(self, chat_id: int, title: str) -> None:
        if title.strip():
            self.history.rename_chat(chat_id, title)
            self._refresh_sidebar()

    def delete_chat(self, chat_id: int) -> bool:
        if self._generation and self._generation.chat_id == chat_id:
            self.set_status("Stop the answer before deleting its chat.", error=True)
            return False
        self.history.delete_chat(chat_id)
        if chat_id == self.current_chat_id:
            self.new_chat()
        self._refresh_sidebar()
        return True

    def _select_in_sidebar(self, chat_id: int | None) -> None:
        self.chat_list.blockSignals(True)
        try:
            self.chat_list.setCurrentItem(None)  # type: ignore[arg-type]
            self.chat_list.clearSelection()
            for row in range(self.chat_list.count()):
                item = self.chat_list.item(row)
                if item.data(_CHAT_ID) == chat_id:
                    self.chat_list.setCurrentItem(item)
                    break
        finally:
            self.chat_list.blockSignals(False)

    def _chat_menu(self, pos: QPoint) -> None:
        item = self.chat_list.itemAt(pos)
        if item is None:
            return
        chat_id = int(item.data(_CHAT_ID))
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        delete = menu.addAction("Delete")
        delete.setEnabled(not (self._generation and self._generation.chat_id == chat_id))
        chosen = menu.exec(self.chat_list.viewport().mapToGlobal(pos))
        if chosen is rename:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=item.text())
            if ok:
                self.rename_chat(chat_id, title)
        elif chosen is delete:
            answer = QMessageBox.question(self, "Delete chat", f"Delete “{item.text()}” and its messages?")
            if answer == QMessageBox.StandardButton.Yes:
                self.delete_chat(chat_id)

    # ---- sending and streaming ------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._send_task is not None and not self._send_task.done()

    def submit(self) -> None:
        """Enter or Send: take the composer's text and answer it in the background."""
        text = self.composer.text().strip()
        if not text:
            return
        if self.busy:
            self.set_status("Still answering: press Stop (Esc) to interrupt it first.")
            return  # the text stays in the composer
        self.composer.clear()
        self._set_busy(True)  # now, not when the task first runs: a second Enter must see it
        self._send_task = asyncio.ensure_future(self.send_message(text))

    def stop(self) -> None:
        if self._generation is not None:
            self.backend.cancel(self._generation.request_id)
            self.set_status("Stopping…")

    async def wait_idle(self) -> None:
        """Until no load, park or answer is running (tests, and a clean shutdown)."""
        while True:
            tasks = (self._load_task, self._send_task, self._park_task)
            pending = [t for t in tasks if t is not None and not t.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    async def send_message(self, text: str) -> GenerateResult | None:
        """Store and show the user's message, then stream the answer into history and the view."""
        self._set_busy(True)
        try:
            return await self._answer(text)
        finally:
            self._generation = None
            if not self._closed:
                self._set_busy(False)

    async def _answer(self, text: str) -> GenerateResult | None:
        chat_id = self.current_chat_id
        if chat_id is None or self.history.get_chat(chat_id) is None:
            info = self.backend.model_info
            chat_id = self.history.create_chat(model=info.name if info else None).id
            self.current_chat_id = chat_id
        self.history.add_message(chat_id, "user", text)
        self.chat_view.add_message("user", text)
        self._refresh_sidebar()

        if self._load_task is not None and not self._load_task.done():
            self.set_status("Waiting for the model to finish loading…")
            await asyncio.wait([self._load_task])
            if self._closed:
                return None

        request = GenerateRequest(
            messages=self._conversation(chat_id),
            sampling=self.settings.sampling(),
            max_new_tokens=self.settings.max_new_tokens,
            # The next turn's prompt starts with this one and its answer: keep the state there, so
            # a follow-up prefills only the new message.
            save_snapshot=SaveSnapshot(),
        )
        row = self.history.add_message(chat_id, "assistant", "", finished=False)
        generation = _Generation(chat_id, request.request_id, self.history.streaming_writer(row.id))
        self._generation = generation
        if self.current_chat_id == chat_id:
            self.chat_view.begin_stream()
        self.set_status("Answering…")

        def on_delta(delta: TextDelta) -> None:
            if self._closed:
                return
            generation.writer.append(delta.text)
            if self.current_chat_id == chat_id:
                self.chat_view.append_stream(delta.text)

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

    def _finish(self, generation: _Generation, result: GenerateResult) -> None:
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
        finished = reason in (FinishReason.STOP, FinishReason.LENGTH)
        generation.writer.finish(finished=finished, stats=stats, content=content)
        info = self.backend.model_info
        if info is not None:
            self.history.set_chat_model(generation.chat_id, info.name)
        self._show_model(info)  # an answer to a parked model loads it back

        message = self.history.get_message(generation.writer.message_id)
        note, kind = message_note(message) if message else (None, NoteKind.INFO)
        if self.current_chat_id == generation.chat_id:
            self.chat_view.end_stream(content, note=note, note_kind=kind)
        self._refresh_sidebar()

        if reason == FinishReason.ERROR:
            error = result.error
            self.set_status(f"Generation failed: {error.detail if error else 'unknown error'}", error=True)
        elif cancelled:
            self.set_status("Stopped. The partial answer was kept.")
        else:
            self.set_status("Ready")
        if result.stats.generated_tokens:
            s = result.stats
            self.speed_chart.add_answer(s.decode_tok_s, s.time_to_first_token_s)
            self.speed_label.setText(f"{s.generated_tokens} tokens  ·  {s.decode_tok_s:.1f} tok/s")
            self.speed_label.setToolTip(
                f"prompt {s.prompt_tokens} tokens ({s.reused_tokens} reused), "
                f"prefill {s.prefill_tok_s:.0f} tok/s\n"
                f"first token after {s.time_to_first_token_s:.2f} s, decode {s.decode_tok_s:.1f} tok/s"
            )

    def _conversation(self, chat_id: int) -> list[dict[str, str]]:
        messages: list[dict[str, str]] = []
        if self.settings.system_prompt.strip():
            messages.append({"role": "system", "content": self.settings.system_prompt})
        for message in self.history.messages(chat_id):
            content = message.content
            if message.role == "assistant":
                # Earlier reasoning is not sent back: models are trained without it in the context.
                content = split_thinking(content)[1]
            if content.strip():
                messages.append({"role": message.role, "content": content})
        return messages

    def _set_busy(self, busy: bool) -> None:
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)

    # ---- shutdown -------------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:
        if self._generation is not None:
            # The answer cannot finish now: save what streamed (unfinished) and stop the engine.
            self.backend.cancel(self._generation.request_id)
            self._generation.writer.flush()
        self._closed = True
        super().closeEvent(event)


def _chat_tooltip(chat: Chat) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated))
    return f"{chat.title or UNTITLED}\n{when}" + (f"  ·  {chat.model}" if chat.model else "")
