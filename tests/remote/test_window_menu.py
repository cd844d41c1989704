"""File > Connect to a server… and Disconnect in the real window (on a SwitchingBackend, the way
app.py builds it), against a stub server: connecting greys out park and snapshot slots, remembers
the server (not the key), and disconnecting brings the local model back with them."""

from __future__ import annotations

from typing import Any

from ds4desk.engine.client import EngineClient
from ds4desk.remote import is_remote
from ds4desk.remote.switch import SwitchingBackend
from tests.remote.stub import Handler, stub_server
from tests.ui.conftest import WindowFactory
from tests.ui.fake_backend import FakeBackend


def unused(_h: Handler) -> None:
    raise AssertionError("connecting only lists the models")


def test_connect_and_disconnect_from_the_file_menu(qtbot: Any, make_window: WindowFactory) -> None:
    switch = SwitchingBackend(FakeBackend(), EngineClient)
    window = make_window(switch)
    remote = window.remote
    assert remote.connect_action.isVisible() and not remote.disconnect_action.isEnabled()
    assert window.park_controls.isEnabled() and window.slot_panel.isEnabled()
    local_name = switch.model_info.name
    with stub_server(unused, models=["served-model"]) as stub:
        remote.connect_action.trigger()
        dialog = remote._dialog
        assert dialog is not None and dialog.isVisible()  # window-modal, not a nested event loop
        dialog.url_edit.setText(stub.url)
        dialog.key_edit.setText("s3cret")
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: switch.remote, timeout=20_000)
        try:
            assert is_remote(switch.model_info) and switch.model_info.name == "served-model"
            assert "served-model" in window.model_label.text()
            # What a server cannot do is greyed out, and stays so when the model line is redrawn.
            window._show_model(switch.model_info)
            assert not window.park_controls.isEnabled() and not window.slot_panel.isEnabled()
            assert remote.disconnect_action.isEnabled()
            assert window.settings.remote_url == stub.url and window.settings.remote_model == "served-model"
            assert "s3cret" not in repr(window.settings)  # the key is never kept in settings
        finally:
            remote.disconnect_action.trigger()
    assert not switch.remote and switch.model_info.name == local_name
    assert window.park_controls.isEnabled() and window.slot_panel.isEnabled()
    assert not remote.disconnect_action.isEnabled()


def test_the_entries_are_hidden_where_the_backend_cannot_switch(make_window: WindowFactory) -> None:
    window = make_window(FakeBackend())
    assert not window.remote.connect_action.isVisible()
    assert not window.remote.disconnect_action.isVisible()
