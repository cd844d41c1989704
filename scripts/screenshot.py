"""A screenshot of the real window in the middle of an answer, for docs/.

    xvfb-run -s "-screen 0 1600x1000x24" .venv/bin/python scripts/screenshot.py docs/main-window.png

The real engine thread and the embedded model on the qasync loop, with the snapshot-slot and live
speed docks open: a first turn finishes (so the slot panel and charts have something), the second
is captured while it streams.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import qasync
from PySide6.QtWidgets import QApplication

from ds4desk.engine import Engine, EngineClient
from ds4desk.history import History
from ds4desk.paths import resolve_data_dirs
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.theme import apply_theme


async def scenario(window: MainWindow, out: Path) -> None:
    loaded = await window.load_model()
    assert loaded.ok, loaded.error
    await window.send_message("Give me a Python function that reverses a string, with a short explanation.")
    answer = asyncio.ensure_future(window.send_message("Write a short poem about lighthouses."))
    await asyncio.sleep(0.5)
    shown = len(window.chat_view.toPlainText())
    # Until a few lines of the answer are on screen (rendered, not just received).
    while len(window.chat_view.toPlainText()) < shown + 120 and not answer.done():
        await asyncio.sleep(0.05)
    window.grab().save(str(out))
    await answer
    await window.wait_idle()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/main-window.png").resolve()
    app = QApplication(sys.argv)
    apply_theme(app)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    home = Path(tempfile.mkdtemp(prefix="ds4shot-"))
    resolve_data_dirs(home).create()
    engine = Engine()
    history = History(home / "history.sqlite3")
    settings = Settings(temperature=0.0, max_new_tokens=200, context=2048, device="cpu")
    window = MainWindow(EngineClient(engine), history, settings)
    window.resize(1500, 900)
    window.show()
    for dock in (window.slot_dock, window.perf_dock):
        dock.show()
    try:
        loop.run_until_complete(scenario(window, out))
    finally:
        window.close()
        engine.close()
        history.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
