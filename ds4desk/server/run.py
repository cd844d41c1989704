"""Start-up of `ds4desk serve`: the address check, the model load, then uvicorn until Ctrl+C."""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ds4desk.engine.api import LoadRequest
from ds4desk.server.app import ServerLimits

if TYPE_CHECKING:
    import uvicorn

    from ds4desk.engine.client import EngineClient
    from ds4desk.engine.engine import Engine

DEFAULT_PORT = 8000
API_KEY_ENV = "DS4DESK_API_KEY"


@dataclass(slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: any free port (the ready line says which)
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    # The one folder slot files are saved to and restored from (`--slot-dir`; the CLI's default is the
    # data directory's snapshots folder, shared with `ds4desk session`). None: slot files are off.
    slot_dir: Path | None = None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind_problem(host: str, api_key: str | None) -> str | None:
    """Why the server must not start on `host`, or None. Anywhere but this machine's loopback, any
    program on the network could use the model: only with a key."""
    if api_key is not None and not api_key.strip():
        return "the API key is empty"
    if not is_loopback(host) and not api_key:
        return f"serving on {host} (not this machine's loopback) needs --api-key (or ${API_KEY_ENV})"
    return None


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before uvicorn starts, so the ready line can name the real port (for
    port 0) and a client that connects right after reading it is queued, not refused."""
    family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_server(client: EngineClient, options: ServeOptions) -> uvicorn.Server:
    """The app on uvicorn, configured but not started (`run(sockets=[sock])` serves until a signal,
    or until `should_exit` is set)."""
    import uvicorn

    from ds4desk.server.app import build_app

    slot_dir = options.slot_dir.expanduser().resolve() if options.slot_dir is not None else None
    app = build_app(client, options.api_key, options.limits, slot_dir)
    config = uvicorn.Config(
        app,
        loop="asyncio",
        http="h11",
        ws="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=3,  # streams still open after Ctrl+C are cut (and so cancelled)
    )
    return uvicorn.Server(config)


def ready_line(client: EngineClient, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    model = client.model_info.name if client.model_info else "no model"
    return f"serving {model} at http://{shown}:{port}/v1 (Ctrl+C stops)"


def run_server(
    engine: Engine, options: ServeOptions, sock: socket.socket, on_ready: Callable[[str], None]
) -> int:
    """Serve `engine`'s loaded model on `sock` until a signal: uvicorn closes its connections (which
    cancels their answers), then raises the signal again (KeyboardInterrupt for Ctrl+C)."""
    from ds4desk.engine.client import EngineClient

    client = EngineClient(engine)
    server = uvicorn_server(client, options)
    on_ready(ready_line(client, sock))
    server.run(sockets=[sock])
    return 0


def serve(load: LoadRequest, options: ServeOptions) -> int:
    """`ds4desk serve`: 2 for a refused address, 1 when the model does not load, 130 after Ctrl+C
    (uvicorn shuts down cleanly, then hands the signal on)."""
    from ds4desk.engine import Engine

    if problem := bind_problem(options.host, options.api_key):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:  # before the load: a taken port is said at once, not after minutes of loading
        sock = listening_socket(options.host, options.port)
    except OSError as exc:
        print(
            f"error: cannot listen on {options.host}:{options.port}: {exc.strerror or exc}", file=sys.stderr
        )
        return 2
    engine = Engine()
    try:
        loaded = engine.load(load)
        if not loaded.ok:
            assert loaded.error is not None
            print(f"error: {loaded.error}", file=sys.stderr)
            return 1
        return run_server(engine, options, sock, lambda line: print(f"ds4desk: {line}", flush=True))
    except KeyboardInterrupt:
        engine.cancel_load()
        return 130
    finally:
        sock.close()
        engine.close()
