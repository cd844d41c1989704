"""The window across restarts and at its default size, on the real qasync loop with FakeBackend and a
real settings.json: geometry, docks and the chat-list splitter come back (a damaged value is
ignored), both docks fit beside the chat at 1100x750, long status lines are elided, a failed load
is a notice (not a bubble in the chat) and a failed GPU falls back to the CPU, and the small keys:
Ctrl+Z in the composer, Del and F2 from the chat list, the presets, Settings on a CPU-only machine."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QApplication, QWidget

from ds4desk.engine.api import EngineError, ErrorCode
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.chat_options import CUSTOM, PRESETS
from ds4desk.ui.main_window import DEFAULT_SIZE, MIN_CHAT_WIDTH, MainWindow
from ds4desk.ui.model_loader import PROGRESS_ROOM
from ds4desk.ui.window_loading import BUILT_IN_LOADING
from tests.ui.chat_helpers import link_hrefs, type_and_enter
from tests.ui.fake_backend import CPU_ONLY, TWO_GPUS, FakeBackend


@pytest.fixture
def settings_path(tmp_path: Path) -> Path:
    return tmp_path / "config" / "settings.json"


@pytest.fixture
def open_window(
    qtbot: Any, loop: Any, db_path: Path, settings_path: Path
) -> Iterator[Callable[..., MainWindow]]:
    """open_window(backend=None, load=True): a shown window on the settings in `settings_path` (read
    as the app reads them), saving back there; closed (which saves its state) at the end."""
    made: list[tuple[MainWindow, History]] = []

    def make(backend: FakeBackend | None = None, *, load: bool = True) -> MainWindow:
        history = History(db_path)
        backend = backend or FakeBackend()
        settings = Settings.load_checked(settings_path).settings
        window = MainWindow(
            backend, history, settings, settings_path=settings_path, list_devices=backend.list_devices
        )
        window.chat_view.render_interval_ms = 0
        made.append((window, history))
        window.show()
        qtbot.waitExposed(window)
        if load:
            loop.run_until_complete(window.load_model())
        return window

    yield make
    for window, history in made:
        if shiboken6.isValid(window):
            window.close()
            loop.run_until_complete(window.wait_idle())
            shiboken6.delete(window)
        history.close()


def close(window: MainWindow, loop: Any) -> None:
    window.close()
    loop.run_until_complete(window.wait_idle())


# ---- across restarts ------------------------------------------------------------------------------


def test_size_docks_and_splitter_come_back_after_a_restart(
    qtbot: Any, open_window: Any, loop: Any, settings_path: Path
) -> None:
    first = open_window()
    assert first.size().toTuple() == DEFAULT_SIZE
    # Within the offscreen platform's 800x800 screen: restoreGeometry keeps a window on its screen.
    first.resize(790, 650)
    first.perf_dock_action.trigger()
    qtbot.waitUntil(first.perf_dock.isVisible)
    QApplication.processEvents()
    size = first.size().toTuple()
    assert size != DEFAULT_SIZE
    first.splitter.setSizes([300, first.splitter.width() - 300 - first.splitter.handleWidth()])
    sidebar_width = first.splitter.sizes()[0]
    close(first, loop)
    saved = json.loads(settings_path.read_text())
    assert saved["window_geometry"] and saved["window_state"] and saved["splitter_state"]

    second = open_window()
    assert second.size().toTuple() == size
    assert second.perf_dock.isVisible() and not second.slot_dock.isVisible()
    assert second.splitter.sizes()[0] == sidebar_width


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_state", "AAAA"),  # base64, but no Qt state: Qt refuses it
        ("window_geometry", "AAAAAAAAAAAAAAAA"),
        ("splitter_state", "/////w=="),
        ("window_state", "not base64 at all!"),  # refused where the settings are read
        ("window_geometry", 42),
    ],
)
def test_a_damaged_saved_state_is_ignored(
    qtbot: Any, open_window: Any, settings_path: Path, field: str, value: object
) -> None:
    settings_path.parent.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps({field: value, "temperature": 0.3}))
    window = open_window()
    assert window.size().toTuple() == DEFAULT_SIZE
    assert not window.perf_dock.isVisible() and not window.slot_dock.isVisible()
    assert window.splitter.sizes()[0] > 0 and window.settings.temperature == 0.3


def test_settings_validate_the_saved_state() -> None:
    good = Settings.from_json({"window_state": "AAAA", "models_folder": "/m"})
    assert good.window_state == "AAAA" and good.models_folder == "/m"
    for bad in ("A", "AA=A", "x" * 70_000 + "==", None, ["AAAA"]):
        assert Settings.from_json({"window_state": bad}).window_state == ""
    assert Settings.from_json({"models_folder": ""}).models_folder is None


# ---- the default size with the docks open --------------------------------------------------------


def _fits(widget: QWidget) -> bool:
    """Laid out no narrower than it needs: nothing cut."""
    return widget.width() >= widget.minimumSizeHint().width()


def test_both_docks_open_at_the_default_size_leave_the_chat_its_room(qtbot: Any, open_window: Any) -> None:
    window = open_window()
    assert window.size().toTuple() == DEFAULT_SIZE
    window.slot_dock_action.trigger()
    window.perf_dock_action.trigger()
    qtbot.waitUntil(lambda: window.slot_dock.isVisible() or window.perf_dock.isVisible())
    QApplication.processEvents()

    assert window.tabifiedDockWidgets(window.slot_dock) == [window.perf_dock]  # one column, tabbed
    assert window.chat_pane.width() >= MIN_CHAT_WIDTH
    assert window.width() == DEFAULT_SIZE[0]  # the window did not grow off the screen instead
    for widget in (window.park_controls, window.chat_options, window.sidebar, window.chat_pane):
        assert _fits(widget), (widget.objectName(), widget.width(), widget.minimumSizeHint().width())
    dock = window.perf_dock if window.perf_dock.isVisible() else window.slot_dock
    assert dock.width() < window.chat_pane.width()


# ---- the status line and the load progress ---------------------------------------------------------


def test_a_long_status_is_elided_with_the_whole_text_in_the_tooltip(qtbot: Any, open_window: Any) -> None:
    window = open_window()
    long = "Could not load the model: " + "a very long reason " * 40 + "END"
    window.set_status(long, error=True)
    QApplication.processEvents()
    label = window.status_label
    assert label.text() == long and label.toolTip() == long
    assert label.shown_text().endswith("…") and "END" not in label.shown_text()
    assert label.fontMetrics().horizontalAdvance(label.shown_text()) <= label.contentsRect().width()
    assert window.model_label.isVisible() and window.model_label.x() >= label.geometry().right()


def test_load_progress_has_room_for_its_text_and_the_first_start_says_what_loads(
    qtbot: Any, open_window: Any, run: Any
) -> None:
    backend = FakeBackend(load_steps=3, pause_load_at=2)
    window = open_window(backend, load=False)
    task = window.start_load()
    run(backend.wait_load_paused())
    assert window.status_label.text().startswith(BUILT_IN_LOADING)
    assert "Loading model" not in window.status_label.text()
    bar = window.model_loader.progress_bar
    bar.setRange(0, 12345)
    bar.setValue(12345)
    assert bar.isVisible() and bar.width() >= bar.fontMetrics().horizontalAdvance(PROGRESS_ROOM)
    backend.resume_load()
    run(task)
    assert window.status_label.text().startswith("Model ")


# ---- load failures ---------------------------------------------------------------------------------


def test_a_failed_load_is_a_notice_and_the_last_answer_keeps_regenerate(
    qtbot: Any, open_window: Any, run: Any
) -> None:
    backend = FakeBackend()
    window = open_window(backend)
    type_and_enter(qtbot, window, "hello")
    run(window.wait_idle())
    answer = window.history.messages(window.current_chat_id)[-1]
    before = window.chat_view.toPlainText()
    assert f"action:regenerate/{answer.id}" in link_hrefs(window.chat_view)

    backend.fail_load = EngineError(ErrorCode.LOAD_FAILED, "not a valid GGUF file")
    run(window.load_model("/models/broken.gguf", remember=True))

    assert window.chat_view.toPlainText() == before  # nothing added to the conversation
    assert f"action:regenerate/{answer.id}" in link_hrefs(window.chat_view)
    assert window.notice_bar.isVisible() and "not a valid GGUF file" in window.notice_label.text()
    assert "fake-llama-1b is still loaded" in window.notice_label.text()
    run(window.load_model("/models/other.gguf"))  # a second failure replaces the first notice
    assert window.notice_bar.notices == [n for n in window.notice_bar.notices if "other.gguf" in n]


def test_a_saved_gpu_that_fails_to_load_falls_back_to_the_cpu_and_says_why(
    qtbot: Any, open_window: Any, run: Any, settings_path: Path
) -> None:
    Settings(device="cuda:1").save(settings_path)
    backend = FakeBackend(devices=list(TWO_GPUS), fail_devices=("cuda:1",))
    window = open_window(backend)

    assert [r.device for r in backend.load_requests] == ["cuda:1", "cpu"]
    assert window.backend.model_info is not None and window.backend.model_info.device == "cpu"
    assert "No model" not in window.model_label.text() and "cpu" in window.model_label.text()
    notice = window.notice_label.text()
    assert window.notice_bar.isVisible() and "cuda:1" in notice and "CUDA error" in notice
    assert "Settings > Device" in notice
    assert Settings.load(settings_path).device == "cuda:1"  # kept: the GPU may work next time


@pytest.mark.parametrize(
    ("device", "devices", "error"),
    [
        ("auto", CPU_ONLY, EngineError(ErrorCode.LOAD_FAILED, "broken")),  # auto is the CPU here
        ("cpu", TWO_GPUS, EngineError(ErrorCode.LOAD_FAILED, "broken")),
        ("cuda:0", TWO_GPUS, EngineError(ErrorCode.OUT_OF_MEMORY, "needs 90 GB")),  # too big, not broken
    ],
)
def test_a_load_that_would_fail_on_the_cpu_too_is_not_retried(
    qtbot: Any, open_window: Any, settings_path: Path, device: str, devices: list, error: EngineError
) -> None:
    Settings(device=device).save(settings_path)
    backend = FakeBackend(devices=list(devices), fail_load=error)
    window = open_window(backend)
    assert len(backend.load_requests) == 1
    assert error.detail in window.notice_label.text() and window.no_model_bar.isVisible()


# ---- keys and menus --------------------------------------------------------------------------------


def _two_chats(qtbot: Any, window: MainWindow, run: Any) -> tuple[int, int]:
    type_and_enter(qtbot, window, "keep me")
    run(window.wait_idle())
    keep = window.current_chat_id
    window.new_chat()
    type_and_enter(qtbot, window, "delete me")
    run(window.wait_idle())
    return keep, window.current_chat_id


def test_ctrl_z_in_the_composer_undoes_a_chat_delete_until_something_is_typed(
    qtbot: Any, open_window: Any, run: Any
) -> None:
    window = open_window(FakeBackend(replies=["a", "b"]))
    _keep, doomed = _two_chats(qtbot, window, run)
    window.delete_chat(doomed)
    assert window.composer.hasFocus() and window.history.get_chat(doomed) is None
    qtbot.keyClick(window.composer, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert window.history.get_chat(doomed) is not None

    window.delete_chat(doomed)
    qtbot.keyClicks(window.composer, "draft")
    qtbot.keyClick(window.composer, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert window.history.get_chat(doomed) is None  # this Ctrl+Z was the typing's
    assert window.composer.toPlainText() != "draft"


def test_del_deletes_the_chat_clicked_in_the_list(qtbot: Any, open_window: Any, run: Any) -> None:
    window = open_window(FakeBackend(replies=["a", "b"]))
    keep, doomed = _two_chats(qtbot, window, run)
    lst = window.chat_list
    item = window.sidebar.item_for(doomed)
    rect = lst.visualItemRect(item)
    qtbot.mouseClick(lst.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert window.current_chat_id == doomed and lst.hasFocus()  # the list keeps the focus
    qtbot.keyClick(lst, Qt.Key.Key_Delete)
    assert window.history.get_chat(doomed) is None and window.history.get_chat(keep) is not None

    # Typing in the list goes on in the composer.
    lst.setFocus()
    qtbot.keyClicks(lst, "hi")
    assert window.composer.hasFocus() and window.composer.toPlainText() == "hi"

    # Del in the conversation is not a chat delete.
    window.open_chat(keep)
    window.chat_view.setFocus()
    qtbot.keyClick(window.chat_view, Qt.Key.Key_Delete)
    assert window.history.get_chat(keep) is not None


def test_the_edit_menu_shows_delete_and_f2(qtbot: Any, open_window: Any, run: Any) -> None:
    window = open_window(FakeBackend(replies=["a", "b"]))
    edit = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Edit")
    shown = {a.text(): a.shortcut().toString() for a in edit.actions() if a.text()}
    assert shown["&Rename chat"] == "F2" and shown["&Delete chat"] == "Del"
    _keep, doomed = _two_chats(qtbot, window, run)
    window.delete_action.trigger()
    assert window.history.get_chat(doomed) is None


def test_balanced_and_custom_never_show_the_same_values(qtbot: Any, open_window: Any) -> None:
    window = open_window()
    combo = window.chat_options.preset
    texts = [combo.itemText(i) for i in range(combo.count())]
    balanced = next(p for p in PRESETS if p.name == "Balanced")
    assert combo.currentText() == "Balanced" and f"{balanced.temperature:g}" not in texts[-1]
    window.settings.temperature, window.settings.top_p = 0.42, 0.9
    window.chat_options.sync()
    assert combo.currentText() == f"{CUSTOM} (0.42 / top-p 0.9)"
    assert all("0.42" not in combo.itemText(i) for i in range(combo.count() - 1))


def test_settings_on_a_cpu_only_machine_hide_cuda_graphs_and_show_every_field(
    qtbot: Any, open_window: Any, run: Any
) -> None:
    window = open_window(FakeBackend(devices=list(CPU_ONLY)))
    dialog = window.open_settings()
    qtbot.waitExposed(dialog)
    run(window.wait_idle())
    assert not dialog.cuda_graphs.isVisible() and dialog.device.isVisible()
    last = dialog.max_new_tokens
    bottom_right = last.mapTo(dialog, QPoint(last.width(), last.height()))
    assert dialog.rect().contains(bottom_right) and last.height() >= last.minimumSizeHint().height()
    dialog.reject()

    gpu_window = open_window(FakeBackend(devices=list(TWO_GPUS)))
    gpu_dialog = gpu_window.open_settings()
    qtbot.waitExposed(gpu_dialog)
    run(gpu_window.wait_idle())
    assert gpu_dialog.cuda_graphs.isVisible()
    gpu_dialog.reject()
