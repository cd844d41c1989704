"""File > Connect to a server…: the URL, an optional API key and the model of an OpenAI-compatible
server. Connect asks the server (on the remote engine's thread, never the UI's) and closes the
dialog only once it answered: `take_engine()` then hands over a connected RemoteEngine, ready to
be the window's backend through EngineClient.

No torch here: the dialog reaches the server through ds4desk.remote only.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import EngineFailure, LoadRequest, LoadResult
from ds4desk.remote.config import RemoteConfig, base_url
from ds4desk.remote.engine import RemoteEngine
from ds4desk.remote.protocol import RemoteModel

FIRST_MODEL = "(the first one the server lists)"


class _Relay(QObject):
    """Carries a remote engine's finished future onto the UI thread (a queued signal)."""

    done = Signal(object)


class ConnectDialog(QDialog):
    def __init__(self, parent: QWidget | None = None, initial: RemoteConfig | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to a server")
        self.setMinimumWidth(440)
        initial = initial or RemoteConfig("http://127.0.0.1:8000/v1")
        self._initial = initial
        self._engine: RemoteEngine | None = None  # the one being asked, or the connected one
        self._pending: str | None = None  # "models" or "connect" while the server is asked
        self._relay = _Relay(self)
        self._relay.done.connect(self._on_done)

        self.url_edit = QLineEdit(initial.url)
        self.url_edit.setPlaceholderText("http://HOST:8000/v1")
        self.url_edit.setToolTip("ds4desk serve, vLLM, SGLang, llama.cpp's server or Ollama (…:11434/v1)")
        self.key_edit = QLineEdit(initial.api_key or "")
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("none")
        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.addItem(FIRST_MODEL)
        if initial.model:
            self.model_box.addItem(initial.model)
            self.model_box.setCurrentText(initial.model)
        self.list_button = QPushButton("List models")
        self.list_button.clicked.connect(self.list_models)
        self.status_label = QLabel(
            "Park, Unpark, snapshot slots and the memory readout do not apply to a remote model."
        )
        self.status_label.setWordWrap(True)

        form = QFormLayout()
        form.addRow("Server URL", self.url_edit)
        form.addRow("API key", self.key_edit)
        form.addRow("Model", self.model_box)
        form.addRow("", self.list_button)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton("Connect", QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setDefault(True)
        self.buttons.accepted.connect(self.connect_to_server)
        self.buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.status_label)
        layout.addWidget(self.buttons)

    # ---- what the caller reads -------------------------------------------------------------------

    def config(self) -> RemoteConfig:
        """The connection as typed: the URL as given (checked on Connect), no empty key or model."""
        model = self.model_box.currentText().strip()
        return RemoteConfig(
            url=self.url_edit.text().strip(),
            api_key=self.key_edit.text().strip() or None,
            model=None if model in ("", FIRST_MODEL) else model,
            connect_timeout_s=self._initial.connect_timeout_s,
            read_timeout_s=self._initial.read_timeout_s,
            answer_timeout_s=self._initial.answer_timeout_s,
        )

    def take_engine(self) -> RemoteEngine | None:
        """The connected engine after Connect succeeded (the caller closes it); None otherwise."""
        if self.result() != QDialog.DialogCode.Accepted:
            return None
        engine, self._engine = self._engine, None
        return engine

    # ---- asking the server -----------------------------------------------------------------------

    def list_models(self) -> None:
        engine = self._start("models", "Asking the server for its models…")
        if engine is not None:
            self._watch(engine.submit_models())

    def connect_to_server(self) -> None:
        engine = self._start("connect", "Connecting…")
        if engine is not None:
            self._watch(engine.submit_load(LoadRequest(path=engine.config.model)))

    def _start(self, what: str, message: str) -> RemoteEngine | None:
        if self._pending is not None:
            return None
        config = self.config()
        try:
            base_url(config.url)  # a URL that cannot work is said at once, without a connection
        except EngineFailure as failure:
            self._show_error(failure.error.detail)
            return None
        self._close_engine()
        self._engine = RemoteEngine(config)
        self._pending = what
        self._set_busy(True)
        self.status_label.setText(message)
        return self._engine

    def _watch(self, future: Future[Any]) -> None:
        relay = self._relay

        def finished(done: Future[Any]) -> None:  # on the remote engine's thread
            with contextlib.suppress(RuntimeError):  # the dialog is gone: nobody waits
                relay.done.emit(done)

        future.add_done_callback(finished)

    def _on_done(self, done: Future[Any]) -> None:
        what, self._pending = self._pending, None
        self._set_busy(False)
        try:
            value = done.result()
        except EngineFailure as failure:
            self._show_error(failure.error.detail)
            self._close_engine()
            return
        except Exception as exc:  # a bug: said, not raised into Qt
            self._show_error(f"{type(exc).__name__}: {exc}")
            self._close_engine()
            return
        if what == "models":
            self._show_models(value)
            self._close_engine()
        elif what == "connect":
            self._connected(value)

    def _show_models(self, models: list[RemoteModel]) -> None:
        typed = self.model_box.currentText()
        self.model_box.clear()
        self.model_box.addItem(FIRST_MODEL)
        for model in models:
            self.model_box.addItem(model.id)
            if model.context:
                tip = f"context {model.context:,} tokens"
                self.model_box.setItemData(self.model_box.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        # Keep the choice typed before, else the first real model.
        ids = [m.id for m in models]
        self.model_box.setCurrentIndex(ids.index(typed) + 1 if typed in ids else min(1, len(ids)))
        self.status_label.setText(f"The server lists {len(models)} model{'s' if len(models) != 1 else ''}.")

    def _connected(self, loaded: LoadResult) -> None:
        if not loaded.ok or loaded.info is None:
            self._show_error(loaded.error.detail if loaded.error else "the server gave no model")
            self._close_engine()
            return
        self.status_label.setText(f"Connected: {loaded.info.name}")
        self.accept()

    def _show_error(self, detail: str) -> None:
        self.status_label.setText(f"Could not connect: {detail}")
        self.status_label.setProperty("error", True)

    def _set_busy(self, busy: bool) -> None:
        for widget in (self.connect_button, self.list_button, self.url_edit, self.key_edit, self.model_box):
            widget.setEnabled(not busy)

    def _close_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close(timeout=0.2)  # its connection is closed at once; a connect still
            # under way ends at its own timeout, on the engine's thread, not here

    def reject(self) -> None:
        self._pending = None
        self._close_engine()  # an ask in flight ends with its connection
        super().reject()
