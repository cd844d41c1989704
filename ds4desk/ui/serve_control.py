"""Settings > "Serve the loaded model on localhost": the window's model over the OpenAI API.

The server itself (ds4desk.server.background, wired in by app.py) runs on a thread of its own over
the window's engine; this side only starts and stops it as the settings say, shows its URL in the
status bar, and hands each served request's figures to the Live speed dock. A port already taken is
a message, never a crash, and the window goes on without the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QLabel, QWidget

from ds4desk.engine.api import GenerateStats
from ds4desk.settings import Settings

log = logging.getLogger(__name__)

SERVE_HELP = (
    "Other programs on this computer (editors, agents, scripts) can use the loaded model through the "
    "OpenAI API here, with any API key. Requests wait behind the window's own answers."
)


class LocalServer(Protocol):
    """What the window needs of a server (ds4desk.server.background.BackgroundServer fits)."""

    @property
    def url(self) -> str | None: ...

    def start(self, port: int, on_served: Callable[[str, GenerateStats], None] | None = None) -> str:
        """Serve on 127.0.0.1:port (0: any free port) and return the base URL at once. Raises
        OSError with a message for the user (a port already taken). `on_served(model, stats)` is
        called on the server's own thread for every request that ended."""
        ...

    def stop(self) -> None:
        """Blocks until the server's thread has ended (a few seconds at most)."""
        ...


@dataclass(slots=True, frozen=True)
class ServeHooks:
    say: Callable[[str], None]  # the status line
    warn: Callable[[str], None]  # the status line, as an error (a start that failed)
    started: Callable[[], None]  # serving now: an earlier failure's notice can go
    served: Callable[[str, GenerateStats], None]  # a served request ended (on the UI thread)
    closed: Callable[[], bool]  # the window has closed: touch no widget


class ServeControl(QObject):
    # Emitted from the server's thread: Qt queues it to this object's (the UI) thread.
    _served = Signal(str, object)

    def __init__(
        self, server: LocalServer | None, settings: Settings, hooks: ServeHooks, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.server = server
        self._settings = settings
        self._hooks = hooks
        self.task: asyncio.Task[None] | None = None  # the start / stop running
        self._port: int | None = None  # the port asked for while serving
        self.problem: str | None = None  # why the last start failed
        self.label = QLabel(objectName="ServeLabel")
        self.label.setToolTip(SERVE_HELP)
        self.label.setAccessibleName("Local server")
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.hide()
        self._served.connect(self._on_served)

    @property
    def available(self) -> bool:
        """Whether this window can serve at all (a local engine; not the stand-in of a failed start)."""
        return self.server is not None

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def apply(self) -> asyncio.Task[None]:
        """Start, stop or move the server to what the settings say now."""
        previous = self.task
        self.task = asyncio.ensure_future(self._apply(previous))
        return self.task

    def shut_down(self) -> asyncio.Task[None]:
        """The window closes: stop serving (its requests are cut, so cancelled) without a setting change."""
        previous = self.task
        self.task = asyncio.ensure_future(self._stop(previous))
        return self.task

    async def _apply(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])  # one change at a time, in the order asked
        if self.server is None or self._hooks.closed():
            return
        settings = self._settings
        wanted = settings.serve_port if settings.serve_on_localhost else None
        if self.server.url is not None and wanted == self._port:
            return  # serving as asked already
        if self.server.url is not None:
            await self._stop(None)
            if wanted is None:
                self._hooks.say("Stopped serving the model.")
        if wanted is None or self._hooks.closed():
            return
        try:
            url = self.server.start(wanted, self._served.emit)
        except OSError as exc:
            self.problem = str(exc)
            self._show(None)
            self._hooks.warn(f"Could not serve the model on localhost: {exc}")
            return
        self.problem = None
        self._port = wanted
        self._show(url)
        self._hooks.started()
        self._hooks.say(f"Serving the model at {url}")

    async def _stop(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
        server = self.server
        if server is None or server.url is None:
            return
        self._port = None
        # uvicorn's shutdown waits for open streams a few seconds: not on the UI thread.
        await _on_a_thread(server.stop)
        if not self._hooks.closed():
            self._show(None)

    def _show(self, url: str | None) -> None:
        if url is None:
            self.label.hide()
            self.label.setText("")
            return
        self.label.setText(f"Serving {url}")
        self.label.show()

    def _on_served(self, model: str, stats: object) -> None:
        if self._hooks.closed() or not isinstance(stats, GenerateStats):
            return
        self._hooks.served(model, stats)


async def _on_a_thread(work: Callable[[], None]) -> None:
    """`work` on a plain thread of its own. Not the loop's executor: qasync's is made of QThreads,
    which the shutdown of a closing window's loop would leave behind; this one only ever calls back
    into a loop that is still open."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            work()
        except Exception:
            log.exception("stopping the local server failed")
        finally:
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(finished)

    threading.Thread(target=run, name="ds4desk-serve-stop", daemon=True).start()
    await done
