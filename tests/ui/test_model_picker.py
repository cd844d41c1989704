"""The model picker: the folder walk on real trees (symlink loops, hidden folders, split GGUF parts,
bounds), then the picker in the real window with the real engine's header reads on real files (the
SmolLM2 GGUF, a tiny Hugging Face folder), switching models through it and back to the built-in."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6

from ds4desk.history import History
from ds4desk.settings import BUILT_IN_LABEL, BUILT_IN_MODEL, Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.model_picker import BUILT_IN, FAMILY, FITS, FOLDER, NAME, RECENT, SIZE, SOURCE, TYPES
from ds4desk.ui.model_scan import model_size, scan_models_folder
from ds4desk.ui.stats_format import format_bytes
from tests.real_models import smollm2_gguf
from tests.ui.chat_helpers import type_and_enter
from tests.ui.fake_backend import FakeBackend

# ---- the folder walk -----------------------------------------------------------------------------


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def test_the_walk_finds_gguf_files_and_model_folders_and_never_loops(tmp_path: Path) -> None:
    root = tmp_path / "models"
    _file(root / "a.gguf", 1000)
    _file(root / "sub" / "b.GGUF", 2000)
    _file(root / "split" / "big-00001-of-00002.gguf", 300)
    _file(root / "split" / "big-00002-of-00002.gguf", 300)  # a later part is no model of its own
    hf = root / "org" / "tiny-hf"
    (hf / "config.json").parent.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    _file(hf / "model-00001-of-00002.safetensors", 700)
    _file(hf / "model-00002-of-00002.safetensors", 500)
    _file(hf / "extra" / "inside.gguf", 10)  # inside a model folder: part of that model
    _file(root / ".cache" / "hidden.gguf", 10)
    _file(root / "1" / "2" / "3" / "4" / "5" / "too-deep.gguf", 10)
    _file(root / "1" / "2" / "3" / "4" / "deep-enough.gguf", 10)
    (root / "loop").symlink_to(root, target_is_directory=True)  # a walk that followed it never ends
    (root / "sub" / "up").symlink_to(root.parent, target_is_directory=True)
    (root / "linked.gguf").symlink_to(root / "a.gguf")  # a linked file is a model (Hugging Face cache)

    result = scan_models_folder(root)

    assert not result.truncated and result.error is None
    found = {m.path: m for m in result.models}
    assert sorted(Path(p).relative_to(root).as_posix() for p in found) == [
        "1/2/3/4/deep-enough.gguf",
        "a.gguf",
        "linked.gguf",
        "org/tiny-hf",
        "split/big-00001-of-00002.gguf",
        "sub/b.GGUF",
    ]
    assert found[str(hf)].kind == "folder" and found[str(hf)].size_bytes == 1200
    assert found[str(root / "sub" / "b.GGUF")].size_bytes == 2000
    assert found[str(root / "linked.gguf")].size_bytes == 1000  # the target's size
    assert model_size(str(hf)) == 1200 and model_size(str(root / "a.gguf")) == 1000


def test_the_walk_is_bounded_and_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "many"
    for index in range(60):
        _file(root / f"f{index:02}" / "x.bin", 1)
    result = scan_models_folder(root, max_entries=20)
    assert result.truncated and result.error is None

    few = scan_models_folder(root, max_models=3)  # plenty of entries, but no model: not truncated
    assert few.models == [] and not few.truncated

    gone = scan_models_folder(tmp_path / "nowhere")
    assert gone.error and gone.models == []


# ---- the picker in the window, scripted backend -----------------------------------------------------


def test_the_picker_lists_every_way_a_model_was_opened(
    qtbot: Any, make_window: Any, run: Any, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    gguf = _file(folder / "from-folder.gguf", 5000)
    dropped = _file(tmp_path / "dropped.gguf", 100)
    window = make_window(FakeBackend(), settings=Settings(models_folder=str(folder)))
    window.model_loader.open_path(str(dropped))  # as a drop or File > Open does
    run(window.wait_idle())
    window.model_loader.add_recent("/models/from-the-command-line")  # as a --model start does

    picker = window.open_model_picker()
    run(window.wait_idle())

    assert picker.isVisible()
    assert picker.paths() == [BUILT_IN_MODEL, "/models/from-the-command-line", str(dropped), str(gguf)]
    assert [picker.row_texts(p)[SOURCE] for p in picker.paths()] == [BUILT_IN, RECENT, RECENT, FOLDER]
    assert picker.row_texts(BUILT_IN_MODEL)[NAME] == BUILT_IN_LABEL
    assert picker.row_texts(str(gguf))[SIZE] == format_bytes(5000)
    assert picker.row_texts(str(dropped))[NAME].endswith("(loaded)")  # the model loaded now
    assert "1 model in the models folder" in picker.status_label.text()
    assert picker.row_texts("/models/from-the-command-line")[FITS] == "missing"  # no such file here
    assert picker.row_texts(str(gguf))[FITS] == "yes"  # FakeBackend's preview: it fits

    picker.close_button.click()
    qtbot.waitUntil(lambda: not shiboken6.isValid(picker) or not picker.isVisible())


def test_choosing_a_folder_is_saved_and_rescans(
    qtbot: Any, make_window: Any, run: Any, tmp_path: Path
) -> None:
    settings_path = tmp_path / "settings.json"
    window = make_window(FakeBackend())
    window._settings_path = settings_path
    picker = window.open_model_picker()
    run(window.wait_idle())
    assert picker.paths() == [BUILT_IN_MODEL] and "No models folder" in picker.folder_label.text()

    gguf = _file(tmp_path / "lib" / "x.gguf", 10)
    picker.set_models_folder(str(tmp_path / "lib"))
    run(window.wait_idle())
    assert picker.paths() == [BUILT_IN_MODEL, str(gguf)]
    assert Settings.load(settings_path).models_folder == str(tmp_path / "lib")
    picker.reject()


def test_with_no_model_the_bar_and_the_menu_open_the_picker(qtbot: Any, make_window: Any, run: Any) -> None:
    window = make_window(FakeBackend(), load=False)
    assert window.no_model_bar.isVisible() and window.no_model_bar.choose_button is not None
    window.no_model_bar.choose_button.click()
    picker = window.model_picker
    assert picker is not None and picker.isVisible()
    run(window.wait_idle())
    picker.reject()
    assert window.choose_model_action in window.menuBar().actions()[0].menu().actions()
    assert window.choose_model_action.shortcut().toString() == "Ctrl+L"


# ---- against the real engine, with real files ----------------------------------------------------------

REAL = Settings(temperature=0.0, max_new_tokens=6, context=256, chunk=64, device="cpu")


@pytest.fixture(scope="module")
def real_client() -> Iterator[Any]:
    from ds4desk.engine import Engine, EngineClient

    engine = Engine()
    yield EngineClient(engine)
    engine.close()


@pytest.fixture(scope="module")
def models_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's GGUF (linked, as a Hugging Face cache does) and a tiny Llama folder."""
    from tests.engine.tiny_dense import save_tiny

    folder = tmp_path_factory.mktemp("library")
    (folder / "smollm2.gguf").symlink_to(smollm2_gguf())
    tiny = folder / "tiny-llama"
    save_tiny("llama", tiny)
    shutil.copy(Path(__file__).parents[1] / "engine" / "tiny_tokenizer.json", tiny / "tokenizer.json")
    return folder


@pytest.fixture
def real_window(
    qtbot: Any, loop: Any, real_client: Any, tmp_path: Path, models_folder: Path
) -> Iterator[MainWindow]:
    history = History(tmp_path / "history.sqlite3")
    settings = Settings(**{**REAL.to_json(), "models_folder": str(models_folder)})
    window = MainWindow(real_client, history, settings, settings_path=tmp_path / "settings.json")
    window.show()
    qtbot.waitExposed(window)
    yield window
    window.close()
    loop.run_until_complete(window.wait_idle())
    shiboken6.delete(window)
    history.close()


def test_real_headers_fill_the_rows_and_the_picker_switches_models_and_back(
    real_window: MainWindow, run: Any, qtbot: Any, models_folder: Path
) -> None:
    window = real_window
    assert run(window.load_model()).ok and window.current_model_path == BUILT_IN_MODEL

    picker = window.open_model_picker()
    run(window.wait_idle())
    gguf, tiny = str(models_folder / "smollm2.gguf"), str(models_folder / "tiny-llama")
    assert picker.paths() == [BUILT_IN_MODEL, gguf, tiny]
    built_in, smol, tiny_row = (picker.row_texts(p) for p in picker.paths())
    assert built_in[NAME].endswith("(loaded)") and built_in[FAMILY] == "llama"
    # SmolLM2's file holds Q4_1 blocks (and Q8_0): the header says so, and so does the row.
    assert smol[FAMILY] == "llama" and smol[TYPES].startswith("Q4_1") and "Q8_0" in smol[TYPES]
    assert smol[SIZE] == format_bytes(smollm2_gguf().stat().st_size)
    assert smol[FITS] == "yes" and tiny_row[FITS] == "yes"
    assert tiny_row[FAMILY] == "llama" and tiny_row[TYPES] == "F32"
    assert tiny_row[SIZE] == format_bytes((models_folder / "tiny-llama" / "model.safetensors").stat().st_size)

    # Choose the tiny model: the same path as File > Open (checked, loaded, remembered).
    assert picker.select_path(tiny)
    picker.load_button.click()
    run(window.wait_idle())
    assert not shiboken6.isValid(picker) or not picker.isVisible()  # it closed (and may be gone)
    assert "tiny-llama" in window.model_label.text(), window.status_label.text()
    assert window.settings.last_model == tiny and window.settings.recent_models[0] == tiny

    # And back to the built-in one.
    picker = window.open_model_picker()
    run(window.wait_idle())
    assert picker.paths()[:2] == [BUILT_IN_MODEL, tiny]  # the tiny one is recent now, listed once
    assert picker.paths().count(tiny) == 1
    assert picker.row_texts(tiny)[NAME].endswith("(loaded)")
    item = picker.table.topLevelItem(0)
    picker.table.itemActivated.emit(item, 0)  # a double-click or Enter on the row
    run(window.wait_idle())
    assert "SmolLM2" in window.model_label.text(), window.status_label.text()
    assert window.settings.last_model is None and window.current_model_path == BUILT_IN_MODEL
    type_and_enter(qtbot, window, "Say hi.")
    run(window.wait_idle())
    answer = window.history.messages(window.current_chat_id)[-1]
    assert answer.finished and answer.content.strip()
