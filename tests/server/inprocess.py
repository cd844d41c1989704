"""A real uvicorn server in this process, on a real Engine: for options the command line does not
give (a slot folder of the test's own) and for tests that compare against the same engine directly."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from ds4desk.engine.api import LoadRequest
from ds4desk.engine.client import EngineClient
from ds4desk.engine.engine import Engine
from ds4desk.server.run import ServeOptions, listening_socket, uvicorn_server
from tests.server.conftest import Served


@contextlib.contextmanager
def serving_in_process(load: LoadRequest, options: ServeOptions) -> Iterator[tuple[Served, Engine]]:
    engine = Engine()
    try:
        loaded = engine.load(load)
        assert loaded.ok, loaded.error
        assert loaded.info is not None
        sock = listening_socket("127.0.0.1", 0)
        server = uvicorn_server(EngineClient(engine), options)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        for _ in range(600):  # the socket already listens: this only waits for uvicorn's loop
            if server.started or not thread.is_alive():
                break
            time.sleep(0.05)
        assert server.started, "uvicorn did not start"
        host, port = sock.getsockname()[:2]
        root = f"http://{host}:{port}"
        try:
            yield Served(f"{root}/v1", root, host, port, loaded.info.name), engine
        finally:
            server.should_exit = True
            thread.join(60)
            sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"
    finally:
        engine.close()
