"""Issue 21 with the real engine thread and the embedded SmolLM2: Think on a chat format without a
thinking mode, a saved device that does not exist, and the devices the engine side lists."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shiboken6
import torch
from PySide6.QtCore import Qt

from ds4desk.app import engine_devices
from ds4desk.cli import build_parser
from ds4desk.engine import Engine, EngineClient, GenerateRequest, SamplingParams
from ds4desk.engine.devices import visible_devices
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow

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


@pytest.fixture(scope="module")
def client() -> Iterator[EngineClient]:
    engine = Engine()
    yield EngineClient(engine)
    engine.close()


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
