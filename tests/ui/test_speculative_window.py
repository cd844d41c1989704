"""Speculative decoding and the local server in the window, on the scripted backend: the settings
(saved and read back), what each answer asks for, the footer and chart of drafted / accepted
tokens, File > Load draft model… and the park row's "Draft model", and what a remote model greys out.
(tests/e2e/test_window_speculative.py and test_window_serve.py run the same on the real engine.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog

from ds4desk.engine.api import GenerateStats
from ds4desk.history import History
from ds4desk.settings import DEFAULT_SERVE_PORT, Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.stats_format import format_bytes
from tests.ui.chat_helpers import type_and_enter
from tests.ui.fake_backend import DRAFT_BYTES, FakeBackend


class ScriptedServer:
    """The LocalServer protocol without a socket (the real one: tests/e2e/test_window_serve.py)."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.url: str | None = None
        self.calls: list[tuple[str, int | None]] = []
        self.on_served: Callable[[str, GenerateStats], None] | None = None

    def start(self, port: int, on_served: Callable[[str, GenerateStats], None] | None = None) -> str:
        self.calls.append(("start", port))
        if self.refuse is not None:
            raise OSError(self.refuse)
        self.on_served = on_served
        self.url = f"http://127.0.0.1:{port or 54321}/v1"
        return self.url

    def stop(self) -> None:
        self.calls.append(("stop", None))
        self.url = None


def test_the_settings_are_saved_and_read_back(qtbot: Any, loop: Any, run: Any, tmp_path: Path) -> None:
    settings_path = tmp_path / "settings.json"
    server = ScriptedServer()
    history = History(tmp_path / "history.sqlite3")
    window = MainWindow(FakeBackend(), history, Settings(), settings_path=settings_path, local_server=server)
    window.show()
    try:
        dialog = window.open_settings()
        assert dialog.speculative.isEnabled() and dialog.speculative.currentData() == "auto"
        assert dialog.serve.isEnabled() and not dialog.serve.isChecked()
        assert not dialog.serve_port.isEnabled()  # until serving is checked
        dialog.speculative.setCurrentIndex(dialog.speculative.findData("lookup"))
        dialog.serve.setChecked(True)
        assert dialog.serve_port.isEnabled()
        dialog.serve_port.setValue(8123)
        dialog.accept()
        run(window.serve_control.task)
        saved = json.loads(settings_path.read_text())
        assert saved["speculative"] == "lookup"
        assert saved["serve_on_localhost"] is True and saved["serve_port"] == 8123
        assert server.calls == [("start", 8123)]
        assert window.serve_control.label.text() == "Serving http://127.0.0.1:8123/v1"
        assert "Serving the model at" in window.status_label.text()
        reread = Settings.load(settings_path)
        assert (reread.speculative, reread.serve_on_localhost, reread.serve_port) == ("lookup", True, 8123)

        dialog = window.open_settings()  # a new port: the server moves there
        assert dialog.serve_status.text() == "Serving at http://127.0.0.1:8123/v1"
        dialog.serve_port.setValue(0)
        dialog.accept()
        run(window.serve_control.task)
        assert server.calls[1:] == [("stop", None), ("start", 0)]
    finally:
        window.close()
        run(window.wait_idle())
        history.close()
    assert server.calls[-1] == ("stop", None)  # closing the window stops serving


def test_values_a_settings_file_cannot_hold_fall_back() -> None:
    read = Settings.from_json({"speculative": "mtp", "serve_port": 70_000, "serve_on_localhost": "yes"})
    assert (read.speculative, read.serve_port, read.serve_on_localhost) == ("auto", DEFAULT_SERVE_PORT, False)
    read = Settings.from_json({"speculative": "off", "serve_port": 0, "serve_on_localhost": True})
    assert (read.speculative, read.serve_port, read.serve_on_localhost) == ("off", 0, True)
    assert Settings(speculative="lookup").load_request("m").speculative == "lookup"
    assert Settings().load_request("m").draft is None  # a draft is never a stored setting


def test_without_a_local_engine_serving_is_greyed_out(make_window: Any) -> None:
    window = make_window(FakeBackend())  # no local server: a fake backend has no engine to serve
    dialog = window.open_settings()
    assert not dialog.serve.isEnabled() and not dialog.serve_port.isEnabled()
    assert "Not available" in dialog.serve_status.text()
    dialog.reject()


def test_a_port_that_cannot_be_had_is_a_notice(qtbot: Any, loop: Any, run: Any, tmp_path: Path) -> None:
    server = ScriptedServer(refuse="cannot listen on 127.0.0.1:8000: Address already in use")
    history = History(tmp_path / "history.sqlite3")
    settings = Settings(serve_on_localhost=True)
    window = MainWindow(FakeBackend(), history, settings, local_server=server)
    window.show()
    try:
        run(window.serve_control.task)  # asked for by the saved setting, at start
        assert server.calls == [("start", DEFAULT_SERVE_PORT)]
        assert window.serve_control.url is None and window.serve_control.label.isHidden()
        assert any("Address already in use" in text for text in window.notice_bar.notices)
        assert window.serve_control.problem is not None
        server.refuse = None  # the port is free again: the next OK in Settings serves, the notice goes
        run(window.serve_control.apply())
        assert window.serve_control.url is not None and not window.serve_control.label.isHidden()
        assert not any("Address already in use" in text for text in window.notice_bar.notices)
        assert window.serve_control.problem is None
    finally:
        window.close()
        run(window.wait_idle())
        history.close()


def test_each_answer_asks_for_the_speculative_setting(qtbot: Any, make_window: Any, run: Any) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    assert backend.load_requests[-1].speculative == "auto"
    for mode in ("lookup", "off", "auto"):
        window.settings.speculative = mode
        type_and_enter(qtbot, window, f"with {mode}")
        run(window.wait_idle())
        assert backend.generate_requests[-1].speculative == mode
    seen: list[str] = []
    backend.after_batch = lambda: seen.append(window.status_label.text())
    window.settings.speculative = "draft"  # no draft loaded: auto, and the window says why
    type_and_enter(qtbot, window, "with draft")
    run(window.wait_idle())
    assert backend.generate_requests[-1].speculative == "auto"
    assert seen and "no draft model is loaded" in seen[0]


def test_footer_status_and_chart_report_drafted_and_accepted(qtbot: Any, make_window: Any, run: Any) -> None:
    backend = FakeBackend(speculation=("lookup", 40, 30))
    window = make_window(backend)
    panel = window.perf_panel
    assert panel.acceptance_chart.isHidden()
    type_and_enter(qtbot, window, "Repeat after me")
    run(window.wait_idle())
    chat = window.history.list_chats()[0]
    answer = window.history.messages(chat.id)[-1]
    assert answer.stats["drafted_tokens"] == 40 and answer.stats["accepted_tokens"] == 30
    line = "lookup: 30 of 40 drafted tokens accepted (75%)"
    assert line in window.chat_view.toPlainText()
    assert line in window.speed_label.toolTip()
    assert panel.acceptance_chart.values() == [75.0] and not panel.acceptance_chart.isHidden()

    backend.speculation = None  # an answer that did not speculate: no line, no acceptance bar
    type_and_enter(qtbot, window, "Something new")
    run(window.wait_idle())
    assert window.chat_view.toPlainText().count("drafted tokens accepted") == 1
    assert panel.acceptance_chart.values() == [75.0] and len(panel.decode_chart.values()) == 2


def test_load_draft_model_then_park_and_unpark_it(
    qtbot: Any, make_window: Any, run: Any, monkeypatch: Any
) -> None:
    backend = FakeBackend()
    window = make_window(backend, load=False)
    assert not window.load_draft_action.isEnabled()  # nothing to draft for yet
    run(window.model_loader.open_path("/models/target.gguf"))
    assert window.load_draft_action.isEnabled()
    selector = window.park_selector
    draft_index = selector.findData("draft")
    assert not selector.model().item(draft_index).isEnabled()  # no draft model yet

    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *args: ("/models/draft.gguf", ""))
    window.load_draft_action.trigger()
    assert window.model_loader.task is not None
    run(window.model_loader.task)
    request = backend.load_requests[-1]
    assert (request.path, request.draft) == ("/models/target.gguf", "/models/draft.gguf")
    assert "draft draft.gguf" in window.model_label.text()
    assert "Draft model draft.gguf loaded beside" in window.status_label.text()
    assert window.settings.last_model == "/models/target.gguf"  # the draft is no model of its own

    assert selector.model().item(draft_index).isEnabled()
    selector.setCurrentIndex(draft_index)
    assert window.park_button.isEnabled() and not window.unpark_button.isEnabled()
    qtbot.mouseClick(window.park_button, Qt.MouseButton.LeftButton)
    run(window.park_controls.task)
    assert backend.park_calls[-1] == ("park", "draft")
    assert f"Parked (draft): freed {format_bytes(DRAFT_BYTES)}" in window.status_label.text()
    assert not window.park_button.isEnabled() and window.unpark_button.isEnabled()
    assert not backend.parked  # the target goes on answering
    qtbot.mouseClick(window.unpark_button, Qt.MouseButton.LeftButton)
    run(window.park_controls.task)
    assert f"Unparked (draft): loaded {format_bytes(DRAFT_BYTES)}" in window.status_label.text()
    assert window.park_button.isEnabled() and not window.unpark_button.isEnabled()

    run(window.model_loader.open_path("/models/other.gguf"))  # another model: its own, no draft
    assert backend.load_requests[-1].draft is None
    assert "draft" not in window.model_label.text()
    assert selector.currentData() == "all" and not selector.model().item(draft_index).isEnabled()


def test_a_failed_draft_leaves_the_model_and_says_why(qtbot: Any, make_window: Any, run: Any) -> None:
    from ds4desk.engine.api import EngineError, ErrorCode

    backend = FakeBackend()
    window = make_window(backend)
    backend.fail_load = EngineError(ErrorCode.LOAD_FAILED, "the draft's vocabulary (320) is not the target's")
    task = window.load_draft("/models/wide-draft")
    assert task is not None
    assert not run(task).ok
    assert any("wide-draft" in text and "vocabulary" in text for text in window.notice_bar.notices)
    assert window.backend.model_info is not None and "draft" not in window.model_label.text()


def test_a_remote_model_greys_out_draft_and_speculation(qtbot: Any, make_window: Any, run: Any) -> None:
    backend = FakeBackend()
    window = make_window(backend, settings=Settings(device="remote"))  # what a RemoteEngine reports
    assert window.backend.model_info is not None and window.backend.model_info.device == "remote"
    assert not window.load_draft_action.isEnabled()
    assert window.load_draft("/models/draft.gguf") is None
    assert "local model first" in window.status_label.text()
    dialog = window.open_settings()
    assert not dialog.speculative.isEnabled()
    dialog.reject()
    type_and_enter(qtbot, window, "Hello server")
    run(window.wait_idle())
    assert backend.generate_requests[-1].speculative is None  # the server decides


def test_served_requests_cross_threads_into_hatched_bars(
    qtbot: Any, loop: Any, run: Any, tmp_path: Path
) -> None:
    server = ScriptedServer()
    history = History(tmp_path / "history.sqlite3")
    backend = FakeBackend()
    window = MainWindow(
        backend, history, Settings(serve_on_localhost=True, serve_port=0), local_server=server
    )
    window.show()
    try:
        run(window.load_model())
        run(window.serve_control.task)
        assert server.on_served is not None
        type_and_enter(qtbot, window, "The window's own")
        run(window.wait_idle())
        stats = GenerateStats(
            generated_tokens=9,
            time_to_first_token_s=0.2,
            decode_s=0.4,
            prefill_tokens=5,
            prefill_s=0.1,
            speculative="draft",
            drafted_tokens=8,
            accepted_tokens=6,
        )
        reporter = threading.Thread(target=server.on_served, args=("served-model", stats))
        reporter.start()  # as the server's own thread calls it
        reporter.join()
        panel = window.perf_panel
        qtbot.waitUntil(lambda: panel.served == 1)
        bars = list(panel.decode_chart.bars)
        assert [(bar.served, bar.model) for bar in bars] == [(False, "fake-llama-1b"), (True, "served-model")]
        assert bars[1].value == stats.decode_tok_s and panel.ttft_chart.bars[1].value == 0.2
        assert panel.acceptance_chart.values() == [75.0] and panel.acceptance_chart.bars[0].served
        assert "1 request served" in panel.served_label.text()
        chart = panel.decode_chart
        chart.resize(320, 160)
        layout = chart.chart_layout()
        assert [bar.served for _rect, bar in layout.bars] == [False, True]
        assert chart.readout_at(layout.bars[1][0].center()) == (
            f"served request 2: served-model: {chart.value_text(stats.decode_tok_s)}"
        )
        painted = chart.paints
        chart.grab()  # the hatched bar is drawn without error
        assert chart.paints == painted + 1
    finally:
        window.close()
        run(window.wait_idle())
        history.close()
