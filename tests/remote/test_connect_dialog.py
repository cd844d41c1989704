"""File > Connect to a server…, against a real (stub) HTTP server: models listed off the UI thread,
Connect accepted only once the server answered, errors shown in the dialog."""

from __future__ import annotations

import socket
from typing import Any

from PySide6.QtWidgets import QDialog

from ds4desk.remote import RemoteConfig, is_remote
from ds4desk.remote.connect_dialog import FIRST_MODEL, ConnectDialog
from tests.remote.stub import Handler, stub_server


def unused(_h: Handler) -> None:
    raise AssertionError("the dialog only lists models")


def test_list_the_models_then_connect_to_one(qtbot: Any) -> None:
    with stub_server(unused, models=["alpha", "beta"]) as stub:
        dialog = ConnectDialog(initial=RemoteConfig(stub.url, api_key="k3y"))
        qtbot.addWidget(dialog)
        dialog.list_button.click()
        # The answer arrives later, through the loop: the click itself did not wait for the server.
        assert not dialog.list_button.isEnabled() and not dialog.connect_button.isEnabled()
        qtbot.waitUntil(lambda: dialog.model_box.count() == 3, timeout=20_000)
        assert [dialog.model_box.itemText(i) for i in range(3)] == [FIRST_MODEL, "alpha", "beta"]
        assert dialog.model_box.currentText() == "alpha" and dialog.list_button.isEnabled()
        dialog.model_box.setCurrentIndex(2)
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: dialog.result() == QDialog.DialogCode.Accepted, timeout=20_000)
        engine = dialog.take_engine()
        assert engine is not None
        try:
            assert engine.model_info is not None and engine.model_info.name == "beta"
            assert is_remote(engine.model_info)
            assert engine.config.api_key == "k3y"
        finally:
            engine.close()
    assert stub.seen and all(seen.headers.get("Authorization") == "Bearer k3y" for seen in stub.seen)


def test_a_server_that_is_not_there_keeps_the_dialog_open(qtbot: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dialog = ConnectDialog(initial=RemoteConfig(f"http://127.0.0.1:{port}/v1"))
    qtbot.addWidget(dialog)
    dialog.connect_button.click()
    qtbot.waitUntil(dialog.connect_button.isEnabled, timeout=20_000)
    assert "connection refused" in dialog.status_label.text()
    assert dialog.result() != QDialog.DialogCode.Accepted and dialog.take_engine() is None


def test_a_url_that_cannot_work_is_said_without_connecting(qtbot: Any) -> None:
    dialog = ConnectDialog(initial=RemoteConfig("ftp://files.example/v1"))
    qtbot.addWidget(dialog)
    dialog.connect_button.click()
    assert "http:// or https://" in dialog.status_label.text()
    assert dialog.connect_button.isEnabled() and dialog.take_engine() is None
