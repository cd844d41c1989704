"""A small real HTTP server (the standard library's) that answers as a test scripts it: the hostile
and broken servers a remote engine must survive."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Respond = Callable[["Handler"], None]


@dataclass(slots=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Stub:
    respond: Respond
    models: list[str] = field(default_factory=lambda: ["stub-model"])
    seen: list[Seen] = field(default_factory=list)
    # The client closed the connection while the script was still writing (Stop, a bound hit).
    client_left: threading.Event = field(default_factory=threading.Event)
    url: str = ""


class Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle(None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        self._handle(json.loads(raw) if raw else None)

    def _handle(self, body: Any) -> None:
        stub = self.server.stub
        stub.seen.append(Seen(self.command, self.path, dict(self.headers), body))
        try:
            if self.command == "GET" and self.path.endswith("/models"):
                self.send_json(
                    200, {"object": "list", "data": [{"id": m, "object": "model"} for m in stub.models]}
                )
                return
            stub.respond(self)
        except (BrokenPipeError, ConnectionResetError):
            stub.client_left.set()

    # ---- what scripts write ----------------------------------------------------------------------

    def send_json(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body runs to the close

    def event(self, payload: Any) -> None:
        self.raw(
            b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
        )

    def raw(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    stub: Stub


@contextlib.contextmanager
def stub_server(respond: Respond, models: list[str] | None = None) -> Iterator[Stub]:
    stub = Stub(respond, models if models is not None else ["stub-model"])
    server = _Server(("127.0.0.1", 0), Handler)
    server.stub = stub
    stub.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def content(text: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }


def reasoning(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"reasoning_content": text}, "finish_reason": None}]}


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
