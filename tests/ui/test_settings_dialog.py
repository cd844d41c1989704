"""The settings dialog (Ctrl+,) on the real qasync loop: values shown, checked, saved across a
restart, and used by the next model load and the next answer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import shiboken6
from PySide6.QtCore import Qt

from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.settings_dialog import SettingsDialog
from tests.ui.chat_helpers import type_and_enter
from tests.ui.fake_backend import TWO_GPUS, FakeBackend


@pytest.fixture
def settings_path(tmp_path: Path) -> Path:
    return tmp_path / "config" / "settings.json"


@pytest.fixture
def open_window(qtbot, loop, db_path: Path, settings_path: Path) -> Iterator[Callable[..., MainWindow]]:
    """A window that saves its settings to `settings_path`, loaded from there like the app does."""
    made: list[tuple[MainWindow, History]] = []

    def make(backend: FakeBackend | None = None) -> MainWindow:
        history = History(db_path)
        backend = backend or FakeBackend(devices=list(TWO_GPUS))
        window = MainWindow(
            backend,
            history,
            Settings.load(settings_path),
            settings_path=settings_path,
            list_devices=backend.list_devices,
        )
        window.chat_view.render_interval_ms = 0
        made.append((window, history))
        window.show()
        qtbot.waitExposed(window)
        loop.run_until_complete(window.load_model())
        return window

    yield make
    for window, history in made:
        window.close()
        loop.run_until_complete(window.wait_idle())
        shiboken6.delete(window)
        history.close()


def open_dialog(qtbot, window: MainWindow) -> SettingsDialog:
    qtbot.keyClick(window.composer, Qt.Key.Key_Comma, Qt.KeyboardModifier.ControlModifier)
    dialog = window.settings_dialog
    assert dialog.isVisible() and dialog.isModal()
    return dialog


def test_dialog_shows_the_current_settings(qtbot, open_window, settings_path: Path) -> None:
    Settings(
        device="cuda:1",
        dtype="bfloat16",
        context=8192,
        chunk=256,
        cuda_graphs="off",
        snapshot_slots=4,
        snapshot_memory_mb=2048,
        thinking_budget_tokens=512,
        unpark_on_generate=False,
        park_cancels_running=True,
        idle_park_minutes=15.0,
    ).save(settings_path)
    window = open_window()
    dialog = open_dialog(qtbot, window)
    assert dialog.device.currentData() == "cuda:1" and dialog.device.currentText().startswith("cuda:1 · ")
    # Only the devices the engine side listed, nothing typed in.
    assert [dialog.device.itemData(i) for i in range(dialog.device.count())] == [d.name for d in TWO_GPUS]
    assert not dialog.device.isEditable()
    assert dialog.dtype.currentText() == "bfloat16"
    assert (dialog.context.value(), dialog.chunk.value()) == (8192, 256)
    assert dialog.cuda_graphs.currentData() == "off"
    assert (dialog.snapshot_slots.value(), dialog.snapshot_memory.value()) == (4, 2048)
    assert dialog.thinking_budget.value() == 512
    assert not dialog.unpark_on_generate.isChecked() and dialog.park_cancels_running.isChecked()
    assert dialog.idle_park.value() == 15.0
    assert "next model load" in dialog.note.text() and "starts next" in dialog.note.text()
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)


def test_ok_saves_and_the_next_load_and_answer_use_them(qtbot, open_window, settings_path: Path, run) -> None:
    backend = FakeBackend(replies=["ok"])
    window = open_window(backend)
    dialog = open_dialog(qtbot, window)
    dialog.device.setCurrentIndex(dialog.device.findData("cpu"))
    dialog.dtype.setCurrentText("float32")
    dialog.context.setValue(2048)
    dialog.chunk.setValue(128)
    dialog.cuda_graphs.setCurrentIndex(dialog.cuda_graphs.findData("on"))
    dialog.snapshot_slots.setValue(3)
    dialog.snapshot_memory.setValue(512)
    dialog.thinking_budget.setValue(100)
    dialog.unpark_on_generate.setChecked(False)
    dialog.park_cancels_running.setChecked(True)
    dialog.idle_park.setValue(5.0)
    dialog.temperature.setValue(0.25)
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    assert not dialog.isVisible()

    saved = Settings.load(settings_path)
    assert saved == window.settings
    assert (saved.device, saved.dtype, saved.context, saved.chunk, saved.cuda_graphs) == (
        "cpu",
        "float32",
        2048,
        128,
        "on",
    )
    assert (saved.snapshot_slots, saved.snapshot_memory_mb, saved.thinking_budget_tokens) == (3, 512, 100)
    assert saved.engine_options() == {
        "unpark_on_generate": False,
        "park_cancels_running": True,
        "idle_park_after_s": 300.0,
        "snapshot_slots": 3,
        "snapshot_budget_bytes": 512 * 2**20,
    }
    assert "Settings saved" in window.status_label.text()
    assert window.chat_options.preset.currentText().startswith("Custom (0.25")

    run(window.load_model())
    request = backend.load_requests[-1]
    assert (request.device, request.dtype, request.context, request.chunk, request.cuda_graphs) == (
        "cpu",
        "float32",
        2048,
        128,
        True,
    )

    qtbot.mouseClick(window.chat_options.thinking, Qt.MouseButton.LeftButton)
    assert window.settings.thinking and Settings.load(settings_path).thinking
    type_and_enter(qtbot, window, "hi")
    run(window.wait_idle())
    generate = backend.generate_requests[-1]
    assert generate.sampling.temperature == 0.25
    assert generate.thinking and generate.thinking_budget is not None
    assert generate.thinking_budget.max_tokens == 100


def test_settings_survive_a_restart(qtbot, open_window, settings_path: Path) -> None:
    window = open_window()
    dialog = open_dialog(qtbot, window)
    dialog.snapshot_slots.setValue(7)
    dialog.idle_park.setValue(30.0)
    dialog.accept()
    window.close()

    again = open_window()
    assert again.settings.snapshot_slots == 7 and again.settings.idle_park_minutes == 30.0
    dialog = open_dialog(qtbot, again)
    assert dialog.snapshot_slots.value() == 7 and dialog.idle_park.value() == 30.0
    dialog.reject()


def test_bad_values_are_refused_and_nothing_changes(qtbot, open_window, settings_path: Path) -> None:
    window = open_window()
    before = Settings.load(settings_path)
    dialog = open_dialog(qtbot, window)
    dialog.device.setCurrentIndex(dialog.device.findData("cuda:1"))
    dialog.context.setValue(256)
    dialog.chunk.setValue(512)
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    assert dialog.isVisible() and "chunk" in dialog.error_label.text()
    assert window.settings.context == 4096 and window.settings.device == "auto"
    assert Settings.load(settings_path) == before

    dialog.chunk.setValue(128)
    dialog.accept()
    assert not dialog.isVisible()
    assert (window.settings.device, window.settings.context, window.settings.chunk) == ("cuda:1", 256, 128)


def test_cancel_changes_nothing(qtbot, open_window, settings_path: Path) -> None:
    window = open_window()
    dialog = open_dialog(qtbot, window)
    dialog.snapshot_slots.setValue(99)
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)
    assert window.settings.snapshot_slots == Settings().snapshot_slots
    assert not settings_path.exists()  # nothing was saved


def test_custom_preset_opens_the_settings(qtbot, open_window) -> None:
    window = open_window()
    combo = window.chat_options.preset
    combo.setCurrentIndex(combo.count() - 1)
    combo.activated.emit(combo.count() - 1)
    assert window.settings_dialog.isVisible()
    window.settings_dialog.temperature.setValue(1.5)
    window.settings_dialog.accept()
    assert window.settings.temperature == 1.5
    assert combo.currentText().startswith("Custom (1.5")


def test_weights_choice_is_shown_saved_and_used_by_the_next_load(
    qtbot, open_window, settings_path: Path, run
) -> None:
    Settings(weights="q8").save(settings_path)
    backend = FakeBackend()
    window = open_window(backend)
    assert backend.load_requests[-1].weights == "q8"  # the window's first load used the stored choice
    dialog = open_dialog(qtbot, window)
    labels = [dialog.weights.itemText(i) for i in range(dialog.weights.count())]
    assert labels == ["As stored", "8-bit (Q8_0)", "4-bit (Q4_K)"]
    assert dialog.weights.currentText() == "8-bit (Q8_0)"
    tip = dialog.weights.toolTip()
    assert "16-bit" in tip and "smaller GPU" in tip and "load" in tip

    dialog.weights.setCurrentIndex(dialog.weights.findText("4-bit (Q4_K)"))
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    assert not dialog.isVisible()
    assert window.settings.weights == "q4" and Settings.load(settings_path).weights == "q4"
    run(window.load_model())
    assert backend.load_requests[-1].weights == "q4"

    dialog = window.open_settings()  # the menu action's slot; focus may have left the composer
    assert dialog.weights.currentData() == "q4"
    dialog.weights.setCurrentIndex(dialog.weights.findData("as-stored"))
    dialog.accept()
    assert Settings.load(settings_path).weights == "as-stored"


def test_cpu_prompt_math_is_shown_saved_and_used_by_the_next_load(
    qtbot, open_window, settings_path: Path, run
) -> None:
    backend = FakeBackend()
    window = open_window(backend)
    assert backend.load_requests[-1].cpu_prefill == "float32"  # exact by default
    dialog = open_dialog(qtbot, window)
    labels = [dialog.cpu_prefill.itemText(i) for i in range(dialog.cpu_prefill.count())]
    assert labels == ["Exact (float32)", "Fast (bfloat16)"]
    assert "AVX-512 BF16" in dialog.cpu_prefill.toolTip()
    assert "CPU prompt math" in dialog.note.text()

    dialog.cpu_prefill.setCurrentIndex(dialog.cpu_prefill.findData("bfloat16"))
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    assert window.settings.cpu_prefill == "bfloat16"
    assert Settings.load(settings_path).cpu_prefill == "bfloat16"
    run(window.load_model())
    assert backend.load_requests[-1].cpu_prefill == "bfloat16"


@pytest.mark.parametrize("native", [True, False])
def test_the_model_tooltip_says_which_cpu_prompt_math_runs(
    open_window, settings_path: Path, native: bool
) -> None:
    Settings(cpu_prefill="bfloat16").save(settings_path)
    backend = FakeBackend(bf16_products=native)
    window = open_window(backend)
    assert backend.load_requests[-1].cpu_prefill == "bfloat16"
    tip = window.model_label.toolTip()
    if native:
        assert "CPU prompt math: bfloat16" in tip
    else:  # asked for, but this CPU keeps the exact products: say so
        assert "CPU prompt math: float32 (this CPU does not multiply bfloat16 natively)" in tip
