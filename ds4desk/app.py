"""The GUI entry point: crash log, QApplication + qasync loop, backend, window.

The window is shown before the model starts loading, and loading runs on the engine thread, so the
app is on screen and usable (history, typing) while the model is still coming in.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import qasync
from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtGui import QIcon, QWindow
from PySide6.QtWidgets import QApplication

from ds4desk.engine.api import (
    DeviceChoice,
    EngineError,
    ErrorCode,
    GenerateRequest,
    GenerateResult,
    GenerateStats,
    LoadRequest,
    LoadResult,
    MemoryStats,
    ModelInfo,
    ModelPreview,
    ParkResult,
    SlotResult,
    TextDelta,
)
from ds4desk.history import History, HistoryError
from ds4desk.paths import DataDirs
from ds4desk.settings import Settings
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.device_choice import DeviceLister
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.serve_control import LocalServer
from ds4desk.ui.theme import apply_theme

log = logging.getLogger(__name__)

APP_NAME = "ds4desk"
# Set it (to anything) and the app writes VISIBLE_MARKER and the Unix time to stderr once the window
# is on screen: the bundle's smoke test (packaging/smoke.sh) waits for it and measures start-up time.
REPORT_VISIBLE_ENV = "DS4DESK_REPORT_VISIBLE"
VISIBLE_MARKER = "ds4desk: window visible at"


def app_icon() -> QIcon:
    """The PNG render of assets/ds4desk.svg: no SVG plugin needed (the bundle leaves QtSvg out)."""
    return QIcon(str(resources.files("ds4desk") / "assets" / "ds4desk.png"))


class VisibleReporter(QObject):
    """Writes the REPORT_VISIBLE_ENV line once `window` is exposed and that expose is painted."""

    def __init__(self, window: QWindow) -> None:
        super().__init__(window)
        self._window = window
        if window.isExposed():
            QTimer.singleShot(0, self._report)
        else:
            window.installEventFilter(self)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Expose and self._window.isExposed():
            self._window.removeEventFilter(self)
            QTimer.singleShot(0, self._report)  # queued behind the paint this expose triggers
        return False

    def _report(self) -> None:
        print(f"{VISIBLE_MARKER} {time.time():.3f}", file=sys.stderr, flush=True)


class CrashLog:
    """Unhandled exceptions go to the crash log and the status bar instead of ending the app;
    faulthandler writes hard crashes (segfaults in native code) to the same file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.notify: Callable[[str], None] | None = None  # the window's report_exception, once it exists
        self.loop: asyncio.AbstractEventLoop | None = None  # to reach notify from other threads
        self._file: IO[str] | None = None
        self._saved: tuple[Any, Any, bool] | None = None
        self._log_handler: logging.Handler | None = None

    def install(self) -> CrashLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: the log of an earlier crash is what the user will want to send us.
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole session
        self._saved = (sys.excepthook, threading.excepthook, faulthandler.is_enabled())
        faulthandler.enable(self._file, all_threads=True)
        sys.excepthook = self._excepthook
        threading.excepthook = self._thread_excepthook
        # Errors logged by any module (the engine logs its failures) land in the same file.
        self._log_handler = logging.StreamHandler(self._file)
        self._log_handler.setLevel(logging.ERROR)
        self._log_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logging.getLogger().addHandler(self._log_handler)
        return self

    def uninstall(self) -> None:
        if self._saved is not None:
            sys.excepthook, threading.excepthook, was_enabled = self._saved
            faulthandler.disable()
            if was_enabled:
                faulthandler.enable()
            self._saved = None
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, header: str, exc: BaseException | None, tb: TracebackType | None = None) -> None:
        if self._file is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        lines = (
            traceback.format_exception(type(exc), exc, tb or (exc.__traceback__ if exc else None))
            if exc
            else []
        )
        self._file.write(f"\n=== {stamp} {header}\n{''.join(lines)}")
        self._file.flush()

    def _tell(self, summary: str) -> None:
        if self.notify is None:
            return
        with contextlib.suppress(Exception):  # reporting must never raise from an excepthook
            self.notify(summary)

    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, exc, tb)
            return
        self.write("unhandled exception", exc, tb)
        sys.__excepthook__(kind, exc, tb)  # and on stderr, for whoever started us from a terminal
        self._tell(_summary(exc))

    def _thread_excepthook(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread else "?"
        exc = args.exc_value
        self.write(f"unhandled exception in thread {name}", exc, args.exc_traceback)
        summary = f"{args.exc_type.__name__} in thread {name}: {exc}"
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._tell, summary)

    def asyncio_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Exceptions nobody awaited (a task that failed and was dropped)."""
        exc = context.get("exception")
        message = str(context.get("message", "asyncio error"))
        self.write(f"asyncio: {message}", exc if isinstance(exc, BaseException) else None)
        self._tell(_summary(exc) if isinstance(exc, BaseException) else message)


def _summary(exc: BaseException) -> str:
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return (
            f"the chat history file is damaged ({exc}); restart ds4desk to set it aside and start a fresh one"
        )
    return f"{type(exc).__name__}: {exc}"


class UnavailableBackend:
    """Stands in when the engine cannot even start, so the window still opens and says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @property
    def model_info(self) -> ModelInfo | None:
        return None

    async def load(
        self, request: LoadRequest, on_progress: Callable[[int, int, str], None] | None = None
    ) -> LoadResult:
        return LoadResult(error=EngineError(ErrorCode.LOAD_FAILED, self.reason))

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        return GenerateResult(request.request_id, error=EngineError(ErrorCode.MODEL_NOT_LOADED, self.reason))

    def cancel(self, request_id: int) -> None:
        pass

    @property
    def parked(self) -> bool:
        return False

    async def park(self, selector: str) -> ParkResult:
        return ParkResult(selector, False, error=EngineError(ErrorCode.MODEL_NOT_LOADED, self.reason))

    async def unpark(self, selector: str) -> ParkResult:
        return ParkResult(selector, False, error=EngineError(ErrorCode.MODEL_NOT_LOADED, self.reason))

    async def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        return SlotResult(error=EngineError(ErrorCode.MODEL_NOT_LOADED, self.reason))

    async def memory(self) -> MemoryStats:
        return MemoryStats(device="none", name="no engine")

    async def preview(self, request: LoadRequest) -> ModelPreview:
        error = EngineError(ErrorCode.LOAD_FAILED, self.reason)
        return ModelPreview(str(request.path), error=error, message=self.reason)

    def cancel_load(self) -> None:
        pass


def engine_backend_factory(dirs: DataDirs, settings: Settings | None = None) -> Callable[[], ChatBackend]:
    """`settings`: as the window read them (None: read the file again)."""

    def make() -> ChatBackend:
        # Imported here: the engine's public face is torch-free, but nothing UI-side needs it earlier.
        from ds4desk.engine.client import EngineClient
        from ds4desk.engine.engine import Engine
        from ds4desk.remote.switch import SwitchingBackend

        options = (settings or Settings.load(dirs.settings_file)).engine_options()
        # One backend for the window: the local engine, or a server (File > Connect to a server…).
        return SwitchingBackend(EngineClient(Engine(**options)), EngineClient)

    return make


class WindowServer:
    """Settings > "Serve the loaded model on localhost": ds4desk.server.background.BackgroundServer
    over the window's own engine, imported at the first start (Starlette and uvicorn cost start-up
    time a window that never serves should not pay)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._server: Any = None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server is not None else None

    def start(self, port: int, on_served: Callable[[str, GenerateStats], None] | None = None) -> str:
        if self._server is None:
            from ds4desk.server.background import BackgroundServer

            self._server = BackgroundServer(self._engine)
        return str(self._server.start(port, on_served))

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


def local_server_for(backend: object) -> LocalServer | None:
    """A server over the backend's local engine (a SwitchingBackend's local side); None for a
    backend with no engine of ours (the stand-in of an engine that did not start, the tests' fakes)."""
    from ds4desk.engine.engine import Engine  # torch-free; the backend factory imported it already

    local = getattr(backend, "local", backend)
    engine = getattr(local, "engine", None)
    return WindowServer(engine) if isinstance(engine, Engine) else None


async def engine_devices() -> list[DeviceChoice]:
    """Settings > Device's list, from the engine side: it imports torch, so it runs on a worker
    thread (while the first load imports it on the engine thread, this costs no extra time)."""

    def read() -> list[DeviceChoice]:
        from ds4desk.engine.devices import visible_devices

        return visible_devices()

    return await asyncio.get_running_loop().run_in_executor(None, read)


def open_history(path: Path) -> tuple[History, str | None]:
    """The history, and a problem to show the user if it could not be opened as it was. A file
    that is not a database, or whose pages fail SQLite's own check, is moved aside whole (with its
    journal files) and a fresh history starts: the damaged one stays for the user to recover."""
    try:
        history = History(path)
    except HistoryError as exc:
        # A newer ds4desk wrote it: leave it alone, keep this session in memory.
        return History(":memory:"), f"{exc}. Chats of this session will not be saved."
    except sqlite3.DatabaseError as exc:
        damage = str(exc)
    else:
        damage = history.damage()
        if damage is None:
            return history, None
        history.close_without_purging()
    broken = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{path}{suffix}").replace(f"{broken}{suffix}")
    log.error("history %s is damaged (%s); moved to %s", path, damage, broken.name)
    try:
        fresh = History(path)
    except (sqlite3.Error, OSError) as exc:  # the folder itself is the problem: keep this session
        return History(
            ":memory:"
        ), f"The chat history could not be opened ({exc}); chats of this session will not be saved."
    return fresh, f"The chat history was damaged ({damage}); it was moved to {broken.name}."


def run_app(
    dirs: DataDirs,
    model_path: str | None = None,
    device: str | None = None,
    *,
    backend_factory: Callable[[], ChatBackend] | None = None,
    argv: list[str] | None = None,
    list_devices: DeviceLister | None = None,
) -> int:
    """Runs the GUI until the window closes; returns the exit code.

    `model_path`/`device` override the settings for this session (the CLI's flags).
    `list_devices`: which devices exist (default: the engine's list with the engine's backend,
    none with another backend)."""
    dirs.create()
    crash = CrashLog(dirs.crash_log).install()
    if list_devices is None and backend_factory is None:
        list_devices = engine_devices
    try:
        return _run(dirs, model_path, device, backend_factory, argv, crash, list_devices)
    finally:
        crash.uninstall()


def _run(
    dirs: DataDirs,
    model_path: str | None,
    device: str | None,
    backend_factory: Callable[[], ChatBackend] | None,
    argv: list[str] | None,
    crash: CrashLog,
    list_devices: DeviceLister | None,
) -> int:
    existing = QApplication.instance()
    app = (
        existing
        if isinstance(existing, QApplication)
        else QApplication(argv if argv is not None else sys.argv)
    )
    app.setApplicationName(APP_NAME)
    app.setQuitOnLastWindowClosed(True)  # closing the window ends run_forever; tests turn it off
    app.setWindowIcon(app_icon())
    apply_theme(app)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    loop.set_exception_handler(crash.asyncio_handler)
    crash.loop = loop

    opened = Settings.load_checked(dirs.settings_file)
    settings = opened.settings
    history, history_problem = open_history(dirs.history_db)
    try:
        backend: ChatBackend = (backend_factory or engine_backend_factory(dirs, settings))()
    except Exception as exc:
        crash.write("the engine did not start", exc)
        backend = UnavailableBackend(f"the engine did not start: {type(exc).__name__}: {exc}")

    settings_path = dirs.settings_file if opened.writable else None  # never overwrite what was not read
    server = local_server_for(backend)
    window = MainWindow(
        backend,
        history,
        settings,
        settings_path=settings_path,
        device_override=device,
        list_devices=list_devices,
        local_server=server,
    )
    window.setWindowTitle(APP_NAME)
    crash.notify = window.report_exception
    window.show()
    if os.environ.get(REPORT_VISIBLE_ENV) and (handle := window.windowHandle()) is not None:
        VisibleReporter(handle)
    for problem in (history_problem, opened.problem):
        if problem:
            window.show_notice(problem)  # stays until dismissed: the load's status comes next
    # Scheduled, not awaited here: the window paints first, then the load starts.
    # A model named on the command line is for this session, but File > Open recent lists it.
    loop.call_soon(lambda: window.start_load(model_path, recent=model_path is not None))

    restore_sigint = _quit_on_sigint(window.close)
    try:
        code = loop.run_forever()  # qasync returns QApplication.exec()'s code
        _shut_down(loop, backend, server)
    finally:
        restore_sigint()
        crash.notify = None
        crash.loop = None
        history.close()
        loop.close()
        asyncio.set_event_loop(None)
    return int(code or 0)


def _shut_down(loop: qasync.QEventLoop, backend: ChatBackend, server: LocalServer | None = None) -> None:
    """Stop serving (its open requests are cut and so cancelled), cancel what still runs
    (closeEvent already saved a streaming answer), then stop the engine."""
    if server is not None:
        try:
            server.stop()  # waits for a stop closeEvent began: no served request outlives the engine
        except Exception:
            log.exception("stopping the local server failed")
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    close = getattr(backend, "close", None)  # EngineClient has one; the protocol does not need it
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("closing the engine failed")


def _quit_on_sigint(quit_: Callable[[], object]) -> Callable[[], None]:
    """Ctrl+C in the terminal closes the window like Ctrl+Q would. Python only runs signal
    handlers between bytecodes, so a timer gives the interpreter a moment now and then."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGINT, lambda *_: quit_())
    timer = QTimer()
    timer.timeout.connect(lambda: None)
    timer.start(250)

    def restore() -> None:
        timer.stop()
        signal.signal(signal.SIGINT, previous)

    return restore
