"""File > Connect to a server… and Disconnect: a model on an OpenAI-compatible server (ds4desk serve,
vLLM, SGLang, llama.cpp's server, Ollama) as the model of the chats.

The window keeps one backend; where it is a SwitchingBackend (ds4desk.remote.switch) these actions
switch it between the local engine and a server in place. What a server cannot do (park, snapshot
slots) is greyed out, not broken. The API key is taken from $DS4DESK_API_KEY or typed into the
dialog, and never written to settings.json.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QWidget

from ds4desk.engine.api import ModelInfo
from ds4desk.remote import RemoteConfig, is_remote
from ds4desk.settings import Settings

DEFAULT_URL = "http://127.0.0.1:8000/v1"


@dataclass(slots=True)
class RemoteHooks:
    window: QWidget  # the dialog's parent
    backend: object  # a SwitchingBackend (else the actions stay hidden)
    settings: Settings
    save_settings: Callable[[], None]
    show_model: Callable[[ModelInfo | None], None]
    set_status: Callable[[str], None]
    answering: Callable[[], bool]
    local_only: list[QWidget]  # greyed out while a server answers (park row, slot panel)


class RemoteActions(QObject):
    def __init__(self, hooks: RemoteHooks) -> None:
        super().__init__(hooks.window)
        self.hooks = hooks
        switchable = hasattr(hooks.backend, "use_remote")
        self.connect_action = QAction("Connect to a &server…", self)
        self.connect_action.setStatusTip(
            "Answer with a model on an OpenAI-compatible server (ds4desk serve, vLLM, SGLang, llama.cpp,"
            " Ollama)"
        )
        self.connect_action.triggered.connect(self.connect_to_server)
        self.connect_action.setVisible(switchable)
        self.disconnect_action = QAction("&Disconnect from the server", self)
        self.disconnect_action.triggered.connect(self.disconnect)
        self.disconnect_action.setEnabled(False)
        self.disconnect_action.setVisible(switchable)
        self._dialog: QWidget | None = None

    def connect_to_server(self) -> None:
        from ds4desk.remote.connect_dialog import ConnectDialog

        hooks = self.hooks
        if hooks.answering():
            hooks.set_status("Stop the answer first, then connect.")
            return
        initial = RemoteConfig(
            hooks.settings.remote_url or DEFAULT_URL,
            api_key=os.environ.get("DS4DESK_API_KEY"),
            model=hooks.settings.remote_model or None,
        )
        dialog = ConnectDialog(hooks.window, initial)
        self._dialog = dialog
        # open(), not exec(): a nested event loop under qasync would stall the asyncio side.
        dialog.finished.connect(lambda _code: self._connected(dialog))
        dialog.open()

    def _connected(self, dialog: object) -> None:
        engine = dialog.take_engine()  # type: ignore[attr-defined]
        dialog.deleteLater()  # type: ignore[attr-defined]
        self._dialog = None
        if engine is None:
            return
        hooks = self.hooks
        hooks.backend.use_remote(engine)  # type: ignore[attr-defined]
        hooks.settings.remote_url = engine.config.url
        hooks.settings.remote_model = engine.model_info.name
        hooks.save_settings()
        hooks.show_model(engine.model_info)
        hooks.set_status(f"Connected: {engine.model_info.name} on {engine.config.url}")
        self.apply_state()

    def disconnect(self) -> None:
        self.hooks.backend.use_local()  # type: ignore[attr-defined]
        self.hooks.show_model(self.hooks.backend.model_info)  # type: ignore[attr-defined]
        self.hooks.set_status("Disconnected from the server.")
        self.apply_state()

    def apply_state(self) -> None:
        """Grey out what a server cannot do; called after every change of model."""
        remote = is_remote(self.hooks.backend.model_info)  # type: ignore[attr-defined]
        for widget in self.hooks.local_only:
            widget.setEnabled(not remote)
        self.disconnect_action.setEnabled(remote)

    def set_busy(self, busy: bool) -> None:
        self.connect_action.setEnabled(not busy)
