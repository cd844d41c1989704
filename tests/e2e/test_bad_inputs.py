"""Every kind of bad model input gives a clear error from `check`, from `generate` and in the
window, and nothing dies: the window keeps the model it had and goes on chatting."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import shiboken6
from PySide6.QtCore import Qt
from safetensors.torch import load_file, save_file

from ds4desk.cli import main as cli_main
from ds4desk.engine import EngineClient
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from tests.engine.tiny_dense import make_hf_model


@pytest.fixture(scope="module")
def good_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with SmolLM2's real tokenizer: loads in a blink."""
    folder = tmp_path_factory.mktemp("good") / "tiny-llama"
    make_hf_model("llama", vocab_size=49152).save_pretrained(folder, safe_serialization=True)
    smol = read_source(default_model_path())
    assert smol.tokenizer is not None
    smol.tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    settings = {**smol.tokenizer.special_tokens, "chat_template": smol.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def _copy(good: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(good, tmp / "model"))


def truncated_safetensors(good: Path, tmp: Path) -> tuple[Path, str]:
    folder = _copy(good, tmp)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder, "truncated"


def gguf_cut_in_half(good: Path, tmp: Path) -> tuple[Path, str]:
    source = default_model_path()
    half = tmp / "half.gguf"
    with source.open("rb") as whole:
        half.write_bytes(whole.read(source.stat().st_size // 2))
    return half, "half.gguf"


def folder_without_config(good: Path, tmp: Path) -> tuple[Path, str]:
    folder = _copy(good, tmp)
    (folder / "config.json").unlink()
    return folder, "config.json"


def _edit_config(good: Path, tmp: Path, **changes: Any) -> Path:
    folder = _copy(good, tmp)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def unknown_architecture(good: Path, tmp: Path) -> tuple[Path, str]:
    return _edit_config(good, tmp, architectures=["FrobnicatorForCausalLM"]), "FrobnicatorForCausalLM"


def shapes_that_do_not_match(good: Path, tmp: Path) -> tuple[Path, str]:
    return _edit_config(good, tmp, intermediate_size=96), "config says"


def _tiny_v4(tmp: Path) -> Path:
    folder = tmp / "v4"
    make_tiny("deepseek_v4", folder, seed=1, layout="official", fp8=True)
    return folder


def v4_missing_shard(good: Path, tmp: Path) -> tuple[Path, str]:
    folder = _tiny_v4(tmp)
    (folder / "model-00002-of-00002.safetensors").unlink()
    return folder, "model-00002-of-00002.safetensors"


def v4_wrong_shape(good: Path, tmp: Path) -> tuple[Path, str]:
    folder = _tiny_v4(tmp)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    return folder, "shape"


def v4_tid2eid_names_a_missing_expert(good: Path, tmp: Path) -> tuple[Path, str]:
    folder = tmp / "v4"
    make_tiny("deepseek_v4", folder, seed=1)
    weights = load_file(str(folder / "model.safetensors"))
    table = next(name for name in weights if name.endswith("tid2eid"))
    weights[table][3, 0] = 999
    save_file(weights, str(folder / "model.safetensors"))
    return folder, "999"


BAD_INPUTS: list[Callable[[Path, Path], tuple[Path, str]]] = [
    truncated_safetensors,
    gguf_cut_in_half,
    folder_without_config,
    unknown_architecture,
    shapes_that_do_not_match,
    v4_missing_shard,
    v4_wrong_shape,
    v4_tid2eid_names_a_missing_expert,
]


@pytest.fixture(params=BAD_INPUTS, ids=lambda make: make.__name__)
def bad_input(request: pytest.FixtureRequest, good_model: Path, tmp_path: Path) -> tuple[Path, str]:
    return request.param(good_model, tmp_path)


def test_check_says_why(
    bad_input: tuple[Path, str], ds4_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = bad_input
    assert cli_main(["--data-dir", str(ds4_home), "check", str(path)]) == 2
    out = capsys.readouterr()
    assert expected in out.err and "Traceback" not in out.err
    assert out.err.startswith(f"cannot load {path}")


def test_generate_says_why(
    bad_input: tuple[Path, str], ds4_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = bad_input
    code = cli_main(["--data-dir", str(ds4_home), "generate", str(path), "--raw", "hi", "--json"])
    assert code == 1
    out = capsys.readouterr()
    answer = json.loads(out.out.strip().splitlines()[-1])
    assert answer["error"]["code"] == "load_failed" and expected in answer["error"]["detail"]
    assert "Traceback" not in out.err


def test_the_window_shows_why_and_goes_on(
    bad_input: tuple[Path, str], good_model: Path, client: EngineClient, qtbot: Any, run: Any, tmp_path: Path
) -> None:
    path, expected = bad_input
    history = History(tmp_path / "history.sqlite3")
    window = MainWindow(
        client, history, Settings(temperature=0.0, max_new_tokens=4, context=256, device="cpu")
    )
    window.show()
    qtbot.waitExposed(window)
    try:
        assert run(window.load_model(str(good_model))).ok
        label = window.model_label.text()
        failed = run(window.load_model(str(path)))
        assert not failed.ok and failed.error is not None and expected in failed.error.detail
        # Said in a notice above the chat, never as a message inside it.
        assert expected in window.notice_label.text()
        assert expected not in window.chat_view.toPlainText()
        assert "Could not load" in window.status_label.text()
        assert window.model_label.text() == label  # the model it had is still there
        qtbot.keyClicks(window.composer, "Still there?")
        qtbot.keyClick(window.composer, Qt.Key.Key_Return)
        run(window.wait_idle())
        answer = history.messages(history.list_chats()[0].id)[-1]
        assert answer.role == "assistant" and answer.finished and answer.stats["generated_tokens"] > 0
    finally:
        window.close()
        run(window.wait_idle())
        shiboken6.delete(window)  # on this thread, not whichever thread the GC runs on
        history.close()


def test_a_deepseek_v4_model_chats_in_the_window(
    client: EngineClient, qtbot: Any, run: Any, tmp_path: Path
) -> None:
    folder = tmp_path / "tiny-v4"
    make_tiny("deepseek_v4", folder, seed=3, layout="official", fp8=True)
    history = History(tmp_path / "history.sqlite3")
    window = MainWindow(
        client, history, Settings(temperature=0.0, max_new_tokens=6, context=128, device="cpu")
    )
    window.show()
    qtbot.waitExposed(window)
    try:
        loaded = run(window.load_model(str(folder)))
        assert loaded.ok and loaded.info is not None and loaded.info.family == "deepseek_v4"
        assert "tiny-v4" in window.model_label.text()
        qtbot.keyClicks(window.composer, "hello")
        qtbot.keyClick(window.composer, Qt.Key.Key_Return)
        run(window.wait_idle())
        answer = history.messages(history.list_chats()[0].id)[-1]
        assert answer.role == "assistant" and answer.stats["generated_tokens"] > 0
        assert "error" not in answer.stats
    finally:
        window.close()
        run(window.wait_idle())
        shiboken6.delete(window)  # on this thread, not whichever thread the GC runs on
        history.close()
