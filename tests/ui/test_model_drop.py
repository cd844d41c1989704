"""Opening models on the real qasync loop: real QDragEnterEvent / QDropEvent objects carrying file URLs,
the preflight refusals, the progress bar and its Cancel button, and the recent-models menu; then the
same drops against the real engine thread and real files."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication, QWidget

from ds4desk.engine.api import WARM_UP_UNIT, EngineError, ErrorCode, ModelPreview
from ds4desk.history import History
from ds4desk.settings import MAX_RECENT_MODELS, Settings
from ds4desk.ui.main_window import MainWindow
from tests.ui.fake_backend import FakeBackend

# Qt 6 has only the QPoint constructor of QDragEnterEvent, which PySide6 marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:Function.*QDragEnterEvent:DeprecationWarning")


def mime_for(*paths: Path | str, urls: list[QUrl] | None = None) -> QMimeData:
    mime = QMimeData()
    mime.setUrls(urls if urls is not None else [QUrl.fromLocalFile(str(p)) for p in paths])
    return mime


def drag_enter(target: QWidget, mime: QMimeData) -> QDragEnterEvent:
    event = QDragEnterEvent(
        target.rect().center(),
        Qt.DropAction.CopyAction,
        mime,
        Qt.MouseButton.LeftButton,
        Qt.KeyboardModifier.NoModifier,
    )
    QApplication.sendEvent(target, event)
    return event


def drop(target: QWidget, mime: QMimeData) -> QDropEvent:
    """Drag in, then drop, as Qt delivers them (the drop only goes where the enter was accepted)."""
    assert drag_enter(target, mime).isAccepted()
    event = QDropEvent(
        QPointF(target.rect().center()),
        Qt.DropAction.CopyAction,
        mime,
        Qt.MouseButton.LeftButton,
        Qt.KeyboardModifier.NoModifier,
    )
    QApplication.sendEvent(target, event)
    return event


def bad_preview(path: str, detail: str) -> ModelPreview:
    return ModelPreview(path, error=EngineError(ErrorCode.LOAD_FAILED, detail), message=detail)


# ---- against the scripted backend ----------------------------------------------------------------


def test_drag_enter_accepts_local_files_only(make_window: Any, tmp_path: Path) -> None:
    window = make_window(FakeBackend())
    assert window.acceptDrops()
    assert drag_enter(window, mime_for(tmp_path)).isAccepted()
    text = QMimeData()
    text.setText("just some text")
    assert not drag_enter(window, text).isAccepted()
    assert not drag_enter(window, mime_for(urls=[QUrl("https://example.com/model.gguf")])).isAccepted()


def test_a_dropped_model_is_checked_then_loaded_and_remembered(
    make_window: Any, run: Any, tmp_path: Path
) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    folder = tmp_path / "my-model"
    folder.mkdir()
    event = drop(window, mime_for(folder))
    assert event.isAccepted()
    run(window.wait_idle())

    assert [r.path for r in backend.preview_requests] == [str(folder)]
    assert [r.path for r in backend.load_requests][-1] == str(folder)
    assert "fake-llama-1b" in window.model_label.text()
    assert "loaded in" in window.status_label.text() and window.status_label.property("error") is False
    assert window.settings.last_model == str(folder)
    assert window.settings.recent_models == [str(folder)]
    assert window.model_loader.recent_paths() == [str(folder)]
    assert not window.model_loader.progress_bar.isVisible()


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("notes.txt", "notes.txt is not a model: expected a folder with config.json or a .gguf file"),
        ("broken.gguf", "broken.gguf is not a valid GGUF file (truncated: tensor 'x' needs bytes 0..9)"),
        ("empty-folder", "no config.json in empty-folder: not a Hugging Face model folder"),
    ],
)
def test_a_dropped_non_model_changes_nothing(
    make_window: Any, run: Any, tmp_path: Path, name: str, detail: str
) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    before = window.model_label.text()
    path = tmp_path / name
    path.write_text("not a model") if "." in name else path.mkdir()
    backend.previews[str(path)] = bad_preview(str(path), detail)

    drop(window, mime_for(path))
    run(window.wait_idle())

    assert window.status_label.text() == f"{name} cannot be opened: {detail}"
    assert window.status_label.property("error") is True
    assert detail in window.notice_label.text() and detail not in window.chat_view.toPlainText()
    assert len(backend.load_requests) == 1  # only the load the window started with
    assert window.model_label.text() == before
    assert window.settings.recent_models == [] and window.settings.last_model is None


def test_a_model_that_does_not_fit_is_refused_with_what_to_do(
    make_window: Any, run: Any, tmp_path: Path
) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    path = str(tmp_path / "huge.gguf")
    message = (
        "needs 14.2 GB, 9.8 GB free on cuda:0: choose a smaller context, another device or park the "
        "current model"
    )
    backend.previews[path] = ModelPreview(path, fits=False, message=message, weight_bytes=14_000_000_000)
    (tmp_path / "huge.gguf").write_bytes(b"GGUF")

    drop(window, mime_for(path))
    run(window.wait_idle())

    assert window.status_label.text() == f"huge.gguf does not fit: {message}"
    assert window.status_label.property("error") is True
    assert len(backend.load_requests) == 1


def test_progress_bar_and_cancel_button(make_window: Any, run: Any, qtbot: Any, tmp_path: Path) -> None:
    backend = FakeBackend(load_steps=4)
    window = make_window(backend, load=False)
    loader = window.model_loader
    run(window.load_model())  # the model that must survive the cancelled load
    assert loader.progress_updates >= 4 and loader.progress_bar.maximum() == 4
    first = backend.model_info
    backend.load_steps, backend.pause_load_at = 10, 3
    updates_before = loader.progress_updates

    drop(window, mime_for(tmp_path))
    run(backend.wait_load_paused())
    assert loader.progress_bar.isVisible() and loader.cancel_button.isVisible()
    assert (loader.progress_bar.value(), loader.progress_bar.maximum()) == (3, 10)
    assert loader.progress_updates > updates_before

    # A second drop while loading is refused, and changes nothing.
    assert loader.open_path(str(tmp_path / "other")) is None
    assert "still loading" in window.status_label.text()

    qtbot.mouseClick(loader.cancel_button, Qt.MouseButton.LeftButton)
    assert backend.cancel_load_calls == 1
    run(window.wait_idle())
    assert window.status_label.text().startswith(f"Loading {tmp_path.name} cancelled")
    assert window.status_label.property("error") is False
    assert backend.model_info is first and "fake-llama-1b" in window.model_label.text()
    assert not loader.progress_bar.isVisible() and not loader.cancel_button.isVisible()
    assert window.settings.recent_models == []  # a cancelled model is not remembered


def test_a_drop_on_the_composer_opens_the_model_instead_of_pasting_its_path(
    make_window: Any, run: Any, tmp_path: Path
) -> None:
    backend = FakeBackend()
    window = make_window(backend)
    target = window.composer.viewport() if hasattr(window.composer, "viewport") else window.composer
    drop(target, mime_for(tmp_path))
    run(window.wait_idle())
    assert backend.load_requests[-1].path == str(tmp_path)
    assert window.composer.toPlainText() == ""


def test_a_message_sent_during_a_load_is_answered_by_the_loaded_model(
    make_window: Any, run: Any, qtbot: Any, tmp_path: Path
) -> None:
    backend = FakeBackend(replies=["from the model loaded before"])
    window = make_window(backend)
    backend.load_steps, backend.pause_load_at = 5, 2
    drop(window, mime_for(tmp_path))
    run(backend.wait_load_paused())
    qtbot.keyClicks(window.composer, "still there?")
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)
    run(window._send_task)  # answered while the load is still paused
    assert "from the model loaded before" in window.chat_view.toPlainText()
    backend.resume_load()
    run(window.wait_idle())
    assert backend.load_requests[-1].path == str(tmp_path)


@pytest.fixture
def window_with_settings_file(qtbot: Any, loop: Any, tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[MainWindow, History]] = []

    def make(settings_path: Path, backend: FakeBackend) -> MainWindow:
        history = History(tmp_path / "history.sqlite3")
        window = MainWindow(backend, history, Settings.load(settings_path), settings_path=settings_path)
        window.show()
        qtbot.waitExposed(window)
        made.append((window, history))
        return window

    yield make
    for window, history in made:
        window.close()
        loop.run_until_complete(window.wait_idle())
        shiboken6.delete(window)
        history.close()


def test_recent_models_survive_a_restart(window_with_settings_file: Any, run: Any, tmp_path: Path) -> None:
    settings_file = tmp_path / "config" / "settings.json"
    first = window_with_settings_file(settings_file, FakeBackend())
    models = [tmp_path / name for name in ("a", "b", "c")]
    for model in models:
        model.mkdir()
    for model in (*models, models[0]):  # opening one again moves it to the front
        run(first.model_loader.open_path(str(model)))
    expected = [str(models[0]), str(models[2]), str(models[1])]
    assert first.model_loader.recent_paths() == expected
    first.close()

    assert Settings.load(settings_file).recent_models == expected
    backend = FakeBackend()
    second = window_with_settings_file(settings_file, backend)
    assert second.model_loader.recent_paths() == expected
    assert [a.text() for a in second.model_loader.recent_menu.actions()][:3] == ["a", "c", "b"]
    # The File menu holds the submenu, and choosing an entry opens that model (preflight first).
    file_menu = second.menuBar().actions()[0].menu()
    assert second.model_loader.recent_menu.menuAction() in file_menu.actions()
    second.model_loader.recent_menu.actions()[2].trigger()
    run(second.wait_idle())
    assert [r.path for r in backend.preview_requests] == [str(models[1])]
    assert backend.load_requests[-1].path == str(models[1])
    assert second.model_loader.recent_paths()[0] == str(models[1])


def test_recent_models_setting_is_validated() -> None:
    many = [f"/models/m{i}" for i in range(12)]
    assert Settings.from_json({"recent_models": many}).recent_models == many[:MAX_RECENT_MODELS]
    assert Settings.from_json({"recent_models": ["/a", "/b", "/a"]}).recent_models == ["/a", "/b"]
    assert Settings.from_json({"recent_models": ["/a", 3]}).recent_models == []
    assert Settings.from_json({"recent_models": "/a"}).recent_models == []
    assert Settings.from_json({"recent_models": ["/a", ""]}).recent_models == []


# ---- against the real engine, with real files ----------------------------------------------------

REAL = Settings(temperature=0.0, max_new_tokens=8, context=256, chunk=64, device="cpu")


@pytest.fixture(scope="module")
def real_client() -> Iterator[Any]:
    from ds4desk.engine import Engine, EngineClient

    engine = Engine()
    yield EngineClient(engine)
    engine.close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.tiny_dense import save_tiny

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    save_tiny("llama", folder)
    shutil.copy(Path(__file__).parents[1] / "engine" / "tiny_tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture
def real_window(qtbot: Any, loop: Any, real_client: Any, tmp_path: Path) -> Iterator[MainWindow]:
    history = History(tmp_path / "history.sqlite3")
    window = MainWindow(real_client, history, Settings(**{**REAL.to_json()}))
    window.show()
    qtbot.waitExposed(window)
    yield window
    window.close()
    loop.run_until_complete(window.wait_idle())
    shiboken6.delete(window)
    history.close()


def send(qtbot: Any, window: MainWindow, text: str) -> None:
    qtbot.keyClicks(window.composer, text)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)


def test_real_drops_corrupt_files_keep_the_model_and_a_good_folder_loads(
    real_window: MainWindow, run: Any, qtbot: Any, tiny_folder: Path, tmp_path: Path
) -> None:
    window = real_window
    assert run(window.load_model()).ok  # the embedded SmolLM2
    assert "SmolLM2" in window.model_label.text()

    noise = tmp_path / "noise.gguf"
    noise.write_bytes(os.urandom(8192))
    truncated = tmp_path / "truncated-llama"
    shutil.copytree(tiny_folder, truncated)
    os.truncate(truncated / "model.safetensors", (truncated / "model.safetensors").stat().st_size // 3)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for bad, words in (
        (noise, "not a valid GGUF"),
        (truncated, "model.safetensors"),
        (notes, "is not a model"),
        (tmp_path, "no config.json"),
    ):
        drop(window, mime_for(bad))
        run(window.wait_idle())
        assert words in window.status_label.text(), window.status_label.text()
        assert window.status_label.property("error") is True
        assert "SmolLM2" in window.model_label.text()

    # Still loaded, and it answers.
    send(qtbot, window, "Say hello.")
    run(window.wait_idle())
    chat = window.history.list_chats()[0]
    answer = window.history.messages(chat.id)[-1]
    assert answer.role == "assistant" and answer.finished and answer.content.strip()

    updates = window.model_loader.progress_updates
    drop(window, mime_for(tiny_folder))
    run(window.wait_idle())
    assert "tiny-llama" in window.model_label.text(), window.status_label.text()
    assert "Model tiny-llama loaded in" in window.status_label.text()
    assert window.model_loader.progress_updates > updates
    assert window.model_loader.progress_bar.maximum() > 0  # the last update counted real tensors
    assert window.settings.recent_models == [str(tiny_folder)]
    assert window.backend.model_info.path == str(tiny_folder)


def test_the_warm_up_stage_reads_as_warming_up(make_window: Any) -> None:
    loader = make_window(FakeBackend(), load=False).model_loader
    loader._on_progress(7, 272, "tensors")
    assert loader.progress_bar.format() == "%v / %m tensors"
    loader._on_progress(2, 5, WARM_UP_UNIT)  # what the engine reports after the tensors
    assert loader.progress_bar.format() == "Warming up… %v / %m"
    assert (loader.progress_bar.value(), loader.progress_bar.maximum()) == (2, 5)
