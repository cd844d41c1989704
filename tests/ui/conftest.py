"""UI tests run on the real Qt event loop through qasync, against FakeBackend and real SQLite."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before anything imports Qt

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import qasync
import shiboken6
from PySide6.QtWidgets import QApplication

from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from tests.ui.fake_backend import FakeBackend

T = TypeVar("T")


class PiecewiseLoop(qasync.QEventLoop):
    """qasync's loop that stays the running asyncio loop between run_until_complete calls.

    In the app, Qt's exec() runs for the whole session, so every task step finds a running loop.
    A test drives the loop in pieces, and between them Qt still delivers events: qasync's own last
    processEvents() after run_until_complete, and whatever qtbot's clicks dispatch. A task stepped
    there (an answer still streaming) would call asyncio.sleep() with no running loop and fail.
    """

    def run_forever(self) -> int:
        try:
            return super().run_forever()
        finally:
            asyncio.events._set_running_loop(self)  # qasync cleared it on the way out


@pytest.fixture
def loop(qapp: QApplication) -> Iterator[qasync.QEventLoop]:
    """A qasync loop over pytest-qt's QApplication, the current asyncio loop for the test."""
    # qasync runs the loop inside QApplication.exec(). A test that closes its last window leaves a
    # quit behind, and with quit-on-last-window-closed it would end the next test's exec() at once.
    qapp.setQuitOnLastWindowClosed(False)
    event_loop = PiecewiseLoop(qapp)
    asyncio.set_event_loop(event_loop)
    asyncio.events._set_running_loop(event_loop)
    yield event_loop
    pending = [task for task in asyncio.all_tasks(event_loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        event_loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    asyncio.events._set_running_loop(None)
    event_loop.close()
    asyncio.set_event_loop(None)


@pytest.fixture
def run(loop: qasync.QEventLoop) -> Callable[[Coroutine[Any, Any, T]], T]:
    """run(coro): drive the Qt + asyncio loop until the coroutine is done."""
    return loop.run_until_complete


WindowFactory = Callable[..., MainWindow]


@pytest.fixture
def make_window(qtbot: Any, loop: qasync.QEventLoop, db_path: Path) -> Iterator[WindowFactory]:
    """make_window(backend=None, load=True): a shown MainWindow on `db_path`, model loaded."""
    histories: list[History] = []
    windows: list[MainWindow] = []

    def make(
        backend: FakeBackend | None = None, *, load: bool = True, settings: Settings | None = None
    ) -> MainWindow:
        history = History(db_path)
        histories.append(history)
        window = MainWindow(backend or FakeBackend(), history, settings or Settings())
        window.chat_view.render_interval_ms = 0  # render every batch, so tests can see each step
        windows.append(window)  # closed here, not by qtbot.addWidget: that runs before fixture teardown
        window.show()
        qtbot.waitExposed(window)
        if load:
            loop.run_until_complete(window.load_model())
        return window

    yield make
    for window in windows:  # close first: closeEvent saves a still-streaming answer
        window.close()
        loop.run_until_complete(window.wait_idle())
        # Now, on this thread: left to the garbage collector, the C++ window could be destroyed on
        # whichever thread collects (the engine thread), while Qt is painting here.
        shiboken6.delete(window)
    for history in histories:
        history.close()
