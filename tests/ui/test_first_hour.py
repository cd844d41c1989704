"""Issue 21, where a new user gets stuck, on the real qasync loop with FakeBackend: Think on a model
whose chat format has no thinking, a saved device this machine does not have, Send with no model,
and the way back to the built-in model (File > Open recent, the no-model bar)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import shiboken6
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QLabel

from ds4desk.app import run_app
from ds4desk.engine.api import DeviceChoice, ThinkingFormat
from ds4desk.history import History
from ds4desk.paths import DataDirs
from ds4desk.settings import BUILT_IN_MODEL, Settings
from ds4desk.ui.chat_options import NO_THINK_HELP
from ds4desk.ui.device_choice import DeviceLister, fallback_for
from ds4desk.ui.main_window import MainWindow
from tests.ui.chat_helpers import type_and_enter
from tests.ui.fake_backend import CPU_ONLY, PROMPT_OPENS_THINKING, TWO_GPUS, FakeBackend

NO_THINKING = (
    ThinkingFormat()
)  # SmolLM2's ChatML, as the engine reports it (tests/engine/test_chat_thinking.py)
# Qwen3-style: the switch changes the prompt, the model writes <think> itself.
MODEL_WRITES_TAG = ThinkingFormat(switch=True)


@pytest.fixture
def settings_path(tmp_path: Path) -> Path:
    return tmp_path / "config" / "settings.json"


@pytest.fixture
def open_window(qtbot, loop, db_path: Path, settings_path: Path) -> Iterator[Callable[..., MainWindow]]:
    """open_window(backend, settings, load=True, device=None, lister=...): a shown window that saves
    its settings to `settings_path`, with the backend's device list (or `lister`)."""
    made: list[tuple[MainWindow, History]] = []

    def make(
        backend: FakeBackend,
        settings: Settings | None = None,
        *,
        load: bool = True,
        device: str | None = None,
        lister: DeviceLister | None = None,
    ) -> MainWindow:
        history = History(db_path)
        window = MainWindow(
            backend,
            history,
            settings or Settings(),
            settings_path=settings_path,
            device_override=device,
            list_devices=lister or backend.list_devices,
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
        window.close()
        loop.run_until_complete(window.wait_idle())
        shiboken6.delete(window)
        history.close()


# ---- Think only where the chat format has it -----------------------------------------------------


def test_think_is_not_offered_on_a_model_without_a_thinking_format(qtbot, open_window, run) -> None:
    reply = "Hello! I am SmolLM, here to help."
    backend = FakeBackend(replies=[reply], thinking=NO_THINKING)
    window = open_window(backend, Settings(thinking=True, thinking_budget_tokens=64))
    toggle = window.chat_options.thinking
    assert not toggle.isEnabled() and not toggle.isChecked() and toggle.toolTip() == NO_THINK_HELP

    type_and_enter(qtbot, window, "hi")
    run(window.wait_idle())
    request = backend.generate_requests[0]
    assert not request.thinking and request.thinking_budget is None
    answer = window.history.messages(window.current_chat_id)[-1]
    assert answer.content == reply  # nothing put in front: the model never was inside <think>
    assert "thinking_tokens" not in (answer.stats or {})
    shown = window.chat_view.toPlainText()
    assert reply in shown and "Thought for" not in shown and "Thinking" not in shown
    assert window.settings.thinking  # the wish is kept for a model that has a thinking mode

    # A model whose prompt opens <think>: Think is offered again, checked as the settings say.
    backend.thinking = PROMPT_OPENS_THINKING
    run(window.load_model("/models/v4", remember=True))
    assert toggle.isEnabled() and toggle.isChecked() and toggle.toolTip() != NO_THINK_HELP
    backend.replies = ["Two and two.</think>4"]
    type_and_enter(qtbot, window, "2+2?")
    run(window.wait_idle())
    assert backend.generate_requests[1].thinking and backend.generate_requests[1].thinking_budget is not None
    answer = window.history.messages(window.current_chat_id)[-1]
    assert answer.content == "<think>Two and two.</think>4"
    assert "Thought for" in window.chat_view.toPlainText()


def test_a_model_that_writes_its_own_think_tag_is_folded_only_inside_it(qtbot, open_window, run) -> None:
    backend = FakeBackend(replies=["<think>Short.</think>Answer A", "Answer B, no thinking"])
    backend.thinking = MODEL_WRITES_TAG
    window = open_window(backend, Settings(thinking=True))
    assert window.chat_options.thinking.isEnabled() and window.chat_options.thinking.isChecked()
    type_and_enter(qtbot, window, "first")
    run(window.wait_idle())
    type_and_enter(qtbot, window, "second")
    run(window.wait_idle())

    assert all(r.thinking for r in backend.generate_requests)
    first, second = [m for m in window.history.messages(window.current_chat_id) if m.role == "assistant"]
    assert first.content == "<think>Short.</think>Answer A"  # no second tag in front of the model's
    assert second.content == "Answer B, no thinking"  # the model did not think: nothing is folded
    shown = window.chat_view.toPlainText()
    assert shown.count("Thought for") == 1 and "Answer B, no thinking" in shown and "Short." not in shown


# ---- devices -----------------------------------------------------------------------------------


def test_a_saved_device_this_machine_lacks_falls_back_to_the_cpu_and_says_why(
    qtbot, open_window, run, settings_path: Path
) -> None:
    backend = FakeBackend(devices=list(CPU_ONLY))
    window = open_window(backend, Settings(device="cuda"))

    assert backend.load_requests[0].device == "cpu" and backend.model_info is not None
    assert "cpu" in window.model_label.text()
    assert window.notice_bar.isVisible()
    notice = window.notice_label.text()
    assert "cuda" in notice and "cpu" in notice and "Settings > Device" in notice
    assert window.settings.device == "cuda"  # the choice stays; this session loads elsewhere
    assert window.send_button.isEnabled()

    # A later load goes to the CPU too, without saying it again.
    window.dismiss_notices()
    run(window.load_model("/models/other", remember=True))
    assert backend.load_requests[-1].device == "cpu" and not window.notice_bar.isVisible()

    # Settings > Device lists what exists, and shows the saved device as missing rather than hiding it.
    dialog = window.open_settings()
    items = [(dialog.device.itemData(i), dialog.device.itemText(i)) for i in range(dialog.device.count())]
    assert [name for name, _ in items] == ["auto", "cpu", "cuda"]
    assert items[-1][1] == "cuda (not on this machine)" and dialog.device.currentData() == "cuda"
    dialog.device.setCurrentIndex(dialog.device.findData("auto"))
    dialog.accept()
    assert Settings.load(settings_path).device == "auto"
    run(window.load_model())
    assert backend.load_requests[-1].device == "auto" and window.device_fallback is None


def test_a_missing_gpu_falls_back_to_the_first_gpu_and_a_present_one_is_kept(qtbot, open_window, run) -> None:
    backend = FakeBackend(devices=list(TWO_GPUS))
    window = open_window(backend, Settings(device="cuda:1"))
    assert backend.load_requests[0].device == "cuda:1" and not window.notice_bar.isVisible()

    other = FakeBackend(devices=list(TWO_GPUS))
    window = open_window(other, Settings(device="cuda:1"), device="cuda:7")  # --device cuda:7
    assert other.load_requests[0].device == "cuda:0"
    assert "cuda:7" in window.notice_label.text() and "cuda:0" in window.notice_label.text()


def test_the_device_list_failing_never_stops_a_load(qtbot, open_window) -> None:
    async def broken() -> list[DeviceChoice]:
        raise RuntimeError("no driver today")

    backend = FakeBackend()
    window = open_window(backend, Settings(device="cpu"), lister=broken)
    assert backend.load_requests[0].device == "cpu" and backend.model_info is not None
    assert window.device_choices is None and not window.notice_bar.isVisible()


def test_settings_opened_before_the_list_is_known_fill_it_in(qtbot, open_window, run) -> None:
    backend = FakeBackend(devices=list(TWO_GPUS))
    window = open_window(backend, Settings(device="cuda:1"), load=False)
    dialog = window.open_settings()
    assert dialog.device.currentText() == "cuda:1 (not checked yet)"
    run(window.wait_idle())
    assert [dialog.device.itemData(i) for i in range(dialog.device.count())] == [d.name for d in TWO_GPUS]
    assert dialog.device.currentData() == "cuda:1"
    dialog.reject()


def test_fallback_rules() -> None:
    assert fallback_for("auto", CPU_ONLY) is None and fallback_for("CPU", CPU_ONLY) is None
    assert fallback_for("cuda", TWO_GPUS) is None  # the first GPU, as torch reads it
    assert fallback_for("cuda:1", CPU_ONLY).instead == "cpu"  # type: ignore[union-attr]
    assert fallback_for("gpu seven", TWO_GPUS).instead == "cuda:0"  # type: ignore[union-attr]


# ---- no model -------------------------------------------------------------------------------------


def test_with_no_model_send_is_off_and_the_window_says_how_to_load_one(qtbot, open_window, run) -> None:
    backend = FakeBackend(reply="Hi from the built-in model.")
    window = open_window(backend, Settings(last_model="/models/gone"), load=False)
    assert not window.send_button.isEnabled() and window.no_model_bar.isVisible()
    assert "No model is loaded" in window.chat_view.placeholderText()  # and the bar above says how
    assert "File > Open model" in window.no_model_bar.findChild(QLabel, "NoModelLabel").text()
    assert "Open one" in window.send_button.toolTip()

    window.composer.setPlainText("hello?")
    window.send_button.click()  # disabled: nothing happens
    type_and_enter(qtbot, window, "")  # Enter with the text still there
    run(window.wait_idle())
    assert backend.generate_requests == [] and window.history.list_chats() == []
    assert window.composer.toPlainText() == "hello?" and "No model is loaded" in window.status_label.text()

    # The bar's button loads the built-in model, whatever was loaded last.
    window.built_in_button.click()
    run(window.wait_idle())
    assert backend.load_requests[-1].path is None and backend.preview_requests == []
    assert window.send_button.isEnabled() and not window.no_model_bar.isVisible()
    assert window.settings.last_model is None  # the built-in model is what opens next time
    window.send_button.click()
    run(window.wait_idle())
    assert "Hi from the built-in model." in window.chat_view.toPlainText()

    # The model goes (the engine lost it): Send is off again, and Regenerate answers nothing either.
    backend._info = None
    window._show_model(None)
    assert not window.send_button.isEnabled() and window.no_model_bar.isVisible()
    assert window.regenerate() is None and len(backend.generate_requests) == 1


# ---- the way back to the built-in model ---------------------------------------------------------


def test_open_recent_always_offers_the_built_in_model(qtbot, open_window, run, settings_path: Path) -> None:
    backend = FakeBackend()
    window = open_window(
        backend, Settings(last_model="/models/tiny-random", recent_models=["/models/tiny-random"])
    )
    assert backend.load_requests[0].path == "/models/tiny-random"
    loader = window.model_loader
    assert loader.built_in_action in loader.recent_menu.actions()
    assert loader.recent_paths() == ["/models/tiny-random"]

    loader.built_in_action.trigger()
    run(window.wait_idle())
    assert backend.load_requests[-1].path is None
    saved = Settings.load(settings_path)
    assert saved.last_model is None and saved.recent_models == ["/models/tiny-random"]
    assert Settings(last_model=BUILT_IN_MODEL).load_request().path is None


def _data_dirs(root: Path) -> DataDirs:
    return DataDirs(config=root, data=root, cache=root / "cache")


def test_a_model_from_the_command_line_is_listed_in_open_recent(qapp: QApplication, tmp_path: Path) -> None:
    dirs = _data_dirs(tmp_path)
    Settings(last_model="/models/from-settings").save(dirs.settings_file)
    backend = FakeBackend()
    backend.on_load = lambda result: QTimer.singleShot(0, QApplication.closeAllWindows)
    assert (
        run_app(
            dirs, "/models/cli", "cpu", backend_factory=lambda: backend, list_devices=backend.list_devices
        )
        == 0
    )
    saved = Settings.load(dirs.settings_file)
    assert saved.recent_models == ["/models/cli"]
    assert saved.last_model == "/models/from-settings"  # for that session only
