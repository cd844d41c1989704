"""Issue 21 with the real engine thread and the embedded SmolLM2: Think on a chat format without a
thinking mode, a saved device that does not exist, and the devices the engine side lists; then a new
user's whole first hour in the real window, with a screenshot of each state in $DS4DESK_SCREENSHOTS."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
import torch
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QLabel, QWidget

from ds4desk.app import engine_devices
from ds4desk.cli import build_parser
from ds4desk.engine import Engine, EngineClient, GenerateRequest, SamplingParams
from ds4desk.engine.devices import visible_devices
from ds4desk.history import History
from ds4desk.settings import BUILT_IN_MODEL, Settings
from ds4desk.ui.main_window import DEFAULT_SIZE, MIN_CHAT_WIDTH, MainWindow
from ds4desk.ui.model_picker import FAMILY, FITS, NAME, SIZE, TYPES
from ds4desk.ui.theme import apply_theme
from ds4desk.ui.window_loading import BUILT_IN_LOADING
from tests.real_models import smollm2_gguf

MISSING_GPU = "cuda:99"  # no machine has it
SETTINGS = Settings(
    temperature=0.0,
    max_new_tokens=16,
    context=1024,
    chunk=64,
    device=MISSING_GPU,
    thinking=True,
    thinking_budget_tokens=8,
)


def test_the_engine_lists_only_the_devices_this_torch_sees(run: Any) -> None:
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    names = [d.name for d in visible_devices()]
    assert names == ["auto", "cpu", *gpus]
    assert run(engine_devices()) == visible_devices()  # the window's lister, off the Qt thread


def test_generate_and_session_default_to_auto() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "hi"]).device == "auto"
    assert parser.parse_args(["session"]).device == "auto"


def test_smollm2_with_think_on_and_a_missing_gpu(
    qtbot: Any, loop: Any, run: Any, client: EngineClient, tmp_path: Path
) -> None:
    history = History(tmp_path / "history.sqlite3")
    window = MainWindow(client, history, SETTINGS, list_devices=engine_devices)
    window.show()
    qtbot.waitExposed(window)
    try:
        loaded = run(window.load_model())
        # The saved GPU does not exist: the model loads on the first GPU, else the CPU, and says so.
        first = "cuda:0" if torch.cuda.is_available() else "cpu"
        assert loaded.ok, loaded.error
        assert client.model_info is not None and client.model_info.device == first
        assert window.notice_bar.isVisible() and MISSING_GPU in window.notice_label.text()

        # SmolLM2's ChatML has no thinking mode: Think is not offered, and the answer is not folded.
        assert not client.model_info.thinking.switch
        assert not window.chat_options.thinking.isEnabled()
        qtbot.keyClicks(window.composer, "Say hello.")
        qtbot.keyClick(window.composer, Qt.Key.Key_Return)
        run(window.wait_idle())
        answer = window.history.messages(window.current_chat_id)[-1]
        assert answer.finished and answer.content.strip()
        direct = run(
            client.generate(
                GenerateRequest(
                    messages=[{"role": "user", "content": "Say hello."}],
                    sampling=SamplingParams(temperature=0.0),
                    max_new_tokens=SETTINGS.max_new_tokens,
                )
            )
        )
        assert answer.content == direct.text  # exactly the model's words, no <think> put in front
        shown = window.chat_view.toPlainText()
        assert "Thought for" not in shown and answer.content.split()[0] in shown
    finally:
        window.close()
        loop.run_until_complete(window.wait_idle())
        shiboken6.delete(window)
        history.close()


# ---- the whole first hour, on screen ------------------------------------------------------------------
#
# Run under Xvfb with a window manager for the real platform plugin, e.g.
#   xvfb-run -a -s "-screen 0 1600x1000x24" sh -c 'openbox & QT_QPA_PLATFORM=xcb \
#     DS4DESK_SCREENSHOTS=/tmp/shots21 .venv/bin/python -m pytest -q tests/e2e/test_window_first_hour.py'
# Without a display the tests' default, the offscreen plugin, draws the same widgets.

SCREENSHOTS_ENV = "DS4DESK_SCREENSHOTS"
FIRST_HOUR = Settings(temperature=0.0, max_new_tokens=12, context=512, chunk=64)


def screenshot(widget: QWidget, name: str) -> None:
    """`widget` as drawn now, as NAME.png in $DS4DESK_SCREENSHOTS (nothing when it is unset)."""
    folder = os.environ.get(SCREENSHOTS_ENV)
    if not folder:
        return
    QApplication.processEvents()
    Path(folder).mkdir(parents=True, exist_ok=True)
    assert widget.grab().save(str(Path(folder) / f"{name}.png"))


def wait_for(run: Any, condition: Callable[[], bool]) -> None:
    """Drive the Qt + asyncio loop until `condition` holds (no timed assertion: pytest's timeout
    and the engine's own limits end a load that never comes)."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.02)

    run(poll())


@pytest.fixture(scope="module")
def models_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a user keeps in a models folder: SmolLM2's GGUF and a tiny Llama checkpoint."""
    from tests.engine.tiny_dense import save_tiny

    folder = tmp_path_factory.mktemp("my-models")
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(smollm2_gguf())
    tiny = folder / "tiny-llama"
    save_tiny("llama", tiny)
    shutil.copy(Path(__file__).parents[1] / "engine" / "tiny_tokenizer.json", tiny / "tokenizer.json")
    return folder


@pytest.fixture
def windows(qtbot: Any, loop: Any, tmp_path: Path) -> Iterator[Callable[..., MainWindow]]:
    """windows(client, lister=engine_devices): a shown window on tmp_path's settings.json and history,
    as the app opens it; each is closed (saving its state) at the end, or when the test closes it."""
    made: list[tuple[MainWindow, History]] = []
    settings_path = tmp_path / "settings.json"

    def make(backend: EngineClient, lister: Any = engine_devices) -> MainWindow:
        history = History(tmp_path / "history.sqlite3")
        settings = Settings.load_checked(settings_path).settings
        window = MainWindow(backend, history, settings, settings_path=settings_path, list_devices=lister)
        made.append((window, history))
        window.show()
        qtbot.waitExposed(window)
        return window

    yield make
    for window, history in made:
        if shiboken6.isValid(window):
            window.close()
            loop.run_until_complete(window.wait_idle())
            shiboken6.delete(window)
        history.close()


@pytest.fixture
def themed(qapp: QApplication) -> Iterator[None]:
    """The app's own look (style, font, style sheet), as `ds4desk` shows it; restored afterwards."""
    style, font, sheet = qapp.style().name(), qapp.font(), qapp.styleSheet()
    apply_theme(qapp, dark=False)
    yield
    qapp.setStyleSheet(sheet)
    qapp.setFont(font)
    qapp.setStyle(style)


def close(window: MainWindow, run: Any) -> None:
    window.close()
    run(window.wait_idle())


def test_a_new_users_first_hour(
    qtbot: Any,
    run: Any,
    client: EngineClient,
    windows: Any,
    tmp_path: Path,
    models_folder: Path,
    themed: None,
) -> None:
    settings_path = tmp_path / "settings.json"
    FIRST_HOUR.save(settings_path)
    gpu = "cuda:0" if torch.cuda.is_available() else "cpu"

    # 1. First start: the built-in model loads, and the window says so while it does.
    window = windows(client)
    assert window.size().toTuple() == DEFAULT_SIZE
    load = window.start_load()
    wait_for(run, lambda: window.model_loader.progress_bar.isVisible() or load.done())
    assert window.status_label.text().startswith(BUILT_IN_LOADING)
    screenshot(window, "01-first-start-loading")
    assert run(load).ok
    assert "SmolLM2" in window.model_label.text() and gpu in window.model_label.text()
    assert window.status_label.text().startswith("Model SmolLM2")
    screenshot(window, "02-built-in-model-loaded")

    # 2. Think on a model whose chat format has none: not offered, and the answer is not folded.
    assert not window.chat_options.thinking.isEnabled() and not window.chat_options.thinking.isChecked()
    qtbot.keyClicks(window.composer, "Say hello.")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    run(window.wait_idle())
    answer = window.history.messages(window.current_chat_id)[-1]
    assert answer.finished and answer.content.strip() and "<think>" not in answer.content
    assert "Thought for" not in window.chat_view.toPlainText()
    window.settings.thinking = True  # what a user who ticked Think on a thinking model left behind
    window.chat_options.sync()
    assert not window.chat_options.thinking.isChecked()
    screenshot(window, "03-think-not-offered-answer-not-folded")
    close(window, run)

    # 3. A saved device that does not exist: the window loads elsewhere and says why, twice over:
    # when the engine's device list shows it is missing, and when only the load itself fails.
    settings = Settings.load(settings_path)
    settings.device = MISSING_GPU
    settings.save(settings_path)
    window = windows(client)
    assert run(window.start_load()).ok
    assert client.model_info is not None and client.model_info.device == gpu
    assert window.notice_bar.isVisible() and MISSING_GPU in window.notice_label.text()
    assert "No model loaded" not in window.model_label.text()
    screenshot(window, "04-missing-device-listed")
    close(window, run)

    window = windows(client, lister=None)  # the list is not known: only the load can tell
    assert run(window.start_load()).ok
    assert client.model_info is not None and client.model_info.device == "cpu"
    notice = window.notice_label.text()
    assert window.notice_bar.isVisible() and MISSING_GPU in notice and "CPU" in notice
    assert "No model loaded" not in window.model_label.text()
    assert window.chat_view.toPlainText().strip() == ""  # no red bubble in the chat
    screenshot(window, "05-missing-device-failed-at-load")
    window.settings.device = "auto"  # the user follows the notice to Settings > Device
    close(window, run)
    window = windows(client)
    assert run(window.start_load()).ok and not window.notice_bar.isVisible()

    # 4. The model picker: the built-in, recent and models-folder models; switch, then back.
    window.settings.models_folder = str(models_folder)
    picker = window.open_model_picker()
    run(window.wait_idle())
    tiny = str(models_folder / "tiny-llama")
    gguf = str(models_folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert picker.paths() == [BUILT_IN_MODEL, gguf, tiny]
    for path in picker.paths():
        row = picker.row_texts(path)
        assert row[FAMILY] == "llama" and row[SIZE] and row[TYPES] and row[FITS] == "yes", row
    assert picker.row_texts(BUILT_IN_MODEL)[NAME].endswith("(loaded)")
    screenshot(picker, "06-model-picker")
    assert picker.select_path(tiny)
    picker.load_button.click()
    run(window.wait_idle())
    assert "tiny-llama" in window.model_label.text(), window.status_label.text()
    screenshot(window, "07-switched-to-tiny-llama")
    picker = window.open_model_picker()
    run(window.wait_idle())
    assert picker.paths()[:2] == [BUILT_IN_MODEL, tiny] and picker.row_texts(tiny)[NAME].endswith("(loaded)")
    screenshot(picker, "08-model-picker-with-recent")
    assert picker.select_path(BUILT_IN_MODEL)
    picker.load_button.click()
    run(window.wait_idle())
    assert "SmolLM2" in window.model_label.text() and window.settings.last_model is None
    screenshot(window, "09-back-to-the-built-in-model")

    # 5. Both docks open at the default size: the chat keeps its room, nothing is cut.
    window.resize(*DEFAULT_SIZE)
    window.open_chat(window.history.list_chats()[0].id)
    window.slot_dock_action.trigger()
    window.perf_dock_action.trigger()
    run(window.wait_idle())
    window.refresh_memory()
    run(window.wait_idle())
    assert window.slot_dock.isVisible() or window.perf_dock.isVisible()
    assert window.chat_pane.width() >= MIN_CHAT_WIDTH
    for part in (window.park_controls, window.chat_options, window.sidebar):
        assert part.width() >= part.minimumSizeHint().width(), part.objectName()
    screenshot(window, "10-both-docks-open")
    window.perf_dock.raise_()
    screenshot(window, "11-both-docks-other-tab")
    dialog = window.open_settings()
    qtbot.waitExposed(dialog)
    run(window.wait_idle())
    assert dialog.cuda_graphs.isVisible() == torch.cuda.is_available()
    screenshot(dialog, "12-settings")
    dialog.reject()
    close(window, run)

    # 6. Send with no model: a fresh engine with nothing loaded. Send is off, Enter sends nothing
    # and the empty chat says how to load a model.
    empty = Engine()
    try:
        fresh = EngineClient(empty)
        window = windows(fresh)
        assert window.perf_dock.isVisible() or window.slot_dock.isVisible()  # the docks came back
        assert not window.send_button.isEnabled() and window.no_model_bar.isVisible()
        chats = len(window.history.list_chats())
        qtbot.keyClicks(window.composer, "Is anyone there?")
        qtbot.keyClick(window.composer, Qt.Key.Key_Return)
        run(window.wait_idle())
        assert (
            len(window.history.list_chats()) == chats and window.composer.toPlainText() == "Is anyone there?"
        )
        assert "No model is loaded" in window.status_label.text()
        status = window.status_label  # bold and red now: still elided to its room, not cut
        assert status.fontMetrics().horizontalAdvance(status.shown_text()) <= status.contentsRect().width()
        assert status.shown_text().endswith("…")
        help_label = window.no_model_bar.findChild(QLabel, "NoModelLabel")
        assert help_label.height() >= help_label.heightForWidth(help_label.width())  # read whole
        window.new_chat()
        screenshot(window, "13-send-with-no-model")
        close(window, run)
    finally:
        empty.close()
