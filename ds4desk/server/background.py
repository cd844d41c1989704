"""The server of `ds4desk serve` inside another program: the window's Settings > "Serve the loaded
model on localhost".

It serves an Engine that something else already drives (the window's): uvicorn runs on a thread of
its own with its own asyncio loop, over an EngineClient of its own on the SAME engine. EngineClient
holds no state but the engine and takes the running loop at each call, so two clients on two loops
share the one engine thread: its command queue orders the window's answers and the served ones, and
neither side waits on the other's loop. uvicorn installs no signal handlers off the main thread, so
Ctrl+C stays the host's.

Only loopback addresses are served without an API key (run.bind_problem decides, as for `serve`).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ds4desk.engine.api import GenerateStats
from ds4desk.server.metrics import Metrics, ServedAnswer
from ds4desk.server.run import ServeOptions, bind_problem, listening_socket, uvicorn_server

if TYPE_CHECKING:
    import uvicorn

    from ds4desk.engine.engine import Engine

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

# Told of every served request that ended: (model, the engine's stats). Called on the server's thread.
ServedCallback = Callable[[str, GenerateStats], None]


class ServeError(OSError):
    """The server could not start; the message is written for the user (a port already taken, say)."""


class BackgroundServer:
    """start() binds and returns at once (a client that connects before uvicorn's loop runs is
    queued by the listening socket, not refused); stop() asks uvicorn to exit and joins its thread."""

    def __init__(self, engine: Engine, *, join_timeout_s: float = 30.0) -> None:
        self._engine = engine
        self._join_timeout_s = join_timeout_s
        self._lock = threading.Lock()  # start and stop may come from different threads
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._url: str | None = None
        self._stopping: threading.Thread | None = None  # the thread a stop() is waiting for

    @property
    def url(self) -> str | None:
        """http://127.0.0.1:PORT/v1 while serving, else None."""
        return self._url

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(
        self,
        port: int,
        on_served: ServedCallback | None = None,
        *,
        host: str = LOOPBACK,
        api_key: str | None = None,
    ) -> str:
        """Serve on host:port (0: any free port) and return the base URL. Raises ServeError with a
        message for the user when the address is refused or the port cannot be had."""
        with self._lock:
            if self.running:
                raise ServeError(f"already serving at {self._url}")
            if problem := bind_problem(host, api_key):
                raise ServeError(problem)
            try:
                sock = listening_socket(host, port)
            except OSError as exc:
                raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            try:
                # Imported here: the client reaches the engine module, which a host may not need yet.
                from ds4desk.engine.client import EngineClient

                server = uvicorn_server(EngineClient(self._engine), ServeOptions(host, port, api_key))
                if on_served is not None:
                    metrics: Metrics = server.config.app.state.metrics
                    metrics.listeners.append(_forward(on_served))
                thread = threading.Thread(
                    target=_serve, args=(server, sock), name="ds4desk-serve", daemon=True
                )
                thread.start()
            except BaseException:
                sock.close()
                raise
            bound_host, bound_port = sock.getsockname()[:2]
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            self._server, self._thread, self._socket = server, thread, sock
            self._url = f"http://{shown}:{bound_port}/v1"
            return self._url

    def stop(self) -> None:
        """Blocks until uvicorn has closed its connections (a stream still open is cut, which cancels
        its answer at the engine's next step) and its thread has ended. Safe to call when stopped."""
        with self._lock:
            server, thread, sock = self._server, self._thread, self._socket
            self._server = self._thread = self._socket = None
            self._url = None
            if thread is None:
                thread = self._stopping  # a stop already under way: wait for it too
            self._stopping = thread
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(self._join_timeout_s)
            if thread.is_alive():
                log.error("the background server did not stop within %.0f s", self._join_timeout_s)
        if sock is not None:
            sock.close()


def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        server.run(sockets=[sock])
    except Exception:  # its own thread: say why it ended, nobody else will
        log.exception("the background server failed")


def _forward(on_served: ServedCallback) -> Callable[[ServedAnswer], None]:
    def listener(answer: ServedAnswer) -> None:
        on_served(answer.model, answer.stats)

    return listener
