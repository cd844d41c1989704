"""HTTP/1.1 to one server with the standard library: timeouts on connect and on every read, redirects
followed only within the same origin (the API key never travels to another host), bounded bodies,
and every failure as an EngineFailure whose detail a user can act on.

`http.client` rather than urllib: urllib follows redirects to any host on its own and hides the
socket, which Stop needs to close from another thread.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.remote.config import RemoteConfig

USER_AGENT = "ds4desk-remote"
# An error body is read for its message only: a server cannot make us read more than this.
ERROR_BODY_BYTES = 64 << 10


@dataclass(slots=True, frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @staticmethod
    def of(url: str) -> Origin:
        parts = urlsplit(url)
        default = 443 if parts.scheme == "https" else 80
        return Origin(parts.scheme, (parts.hostname or "").lower(), parts.port or default)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


class Abort:
    """Closes the connection of the request it is given, from any thread: Stop. A server sees the
    connection close and cancels the answer (vLLM, SGLang, llama.cpp and ds4desk serve all do)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The socket itself: http.client drops its own reference once a response that ends with
        # the connection has begun, and the response reads on through a file over it.
        self._sock: socket.socket | None = None
        self.reason: str | None = None  # "cancel" (Stop) or "deadline" (the answer took too long)

    @property
    def aborted(self) -> bool:
        return self.reason is not None

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            aborted = self.reason is not None
        if aborted:
            self._shutdown(sock)

    def abort(self, reason: str = "cancel") -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            sock = self._sock
        if sock is not None:
            self._shutdown(sock)

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        # shutdown wakes a read blocked in another thread at once; close alone may not.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@dataclass(slots=True)
class Opened:
    """A response whose status is 2xx; the caller reads it and closes `connection`."""

    connection: http.client.HTTPConnection
    response: http.client.HTTPResponse
    url: str

    @property
    def content_type(self) -> str:
        return (self.response.getheader("Content-Type") or "").split(";")[0].strip().lower()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.response.close()  # the response may hold the socket alone (see Abort)
        with contextlib.suppress(Exception):
            self.connection.close()


def open_request(
    config: RemoteConfig,
    base: str,
    method: str,
    path: str,
    payload: dict[str, Any] | None = None,
    *,
    accept: str = "application/json",
    abort: Abort | None = None,
) -> Opened:
    """Send `method path` (relative to the API base) and return the 2xx response, headers read.
    Raises EngineFailure for a refused connection, a timeout, a redirect off the origin or an
    error status (with the server's own message)."""
    url = base.rstrip("/") + path
    origin = Origin.of(base)
    body = json.dumps(payload, ensure_ascii=False).encode() if payload is not None else None
    for _hop in range(config.max_redirects + 1):
        connection = _connect(config, url, abort)
        try:
            response = _send(connection, method, url, body, accept, config.api_key)
        except BaseException:
            connection.close()
            raise
        status = response.status
        if 200 <= status < 300:
            return Opened(connection, response, url)
        try:
            if status in (301, 302, 303, 307, 308):
                url = _redirect_target(response, url, origin, method, status)
                continue
            raise EngineFailure(*_error_of_status(status, _read_bounded(response, ERROR_BODY_BYTES), url))
        finally:
            connection.close()
    raise EngineFailure(ErrorCode.BAD_REQUEST, f"{url}: more than {config.max_redirects} redirects")


def get_json(config: RemoteConfig, base: str, path: str, *, abort: Abort | None = None) -> Any:
    """GET a JSON document of at most config.max_body_bytes."""
    opened = open_request(config, base, "GET", path, abort=abort)
    try:
        raw = _read_bounded(opened.response, config.max_body_bytes + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise EngineFailure(ErrorCode.DECODE_FAILED, f"{opened.url}: the answer broke off ({exc})") from None
    finally:
        opened.close()
    if len(raw) > config.max_body_bytes:
        raise EngineFailure(
            ErrorCode.BAD_REQUEST, f"{opened.url}: answer larger than {config.max_body_bytes} bytes"
        )
    return parse_json_bytes(raw, opened.url)


def parse_json_bytes(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, f"{where}: the server sent text that is not UTF-8"
        ) from None
    except (ValueError, RecursionError):
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, f"{where}: the server sent something that is not JSON"
        ) from None


def _connect(config: RemoteConfig, url: str, abort: Abort | None) -> http.client.HTTPConnection:
    origin = Origin.of(url)
    connection: http.client.HTTPConnection
    if origin.scheme == "https":
        context = ssl.create_default_context()
        connection = http.client.HTTPSConnection(
            origin.host, origin.port, timeout=config.connect_timeout_s, context=context
        )
    else:
        connection = http.client.HTTPConnection(origin.host, origin.port, timeout=config.connect_timeout_s)
    try:
        connection.connect()
    except TimeoutError:
        connection.close()
        raise EngineFailure(
            ErrorCode.DECODE_FAILED,
            f"could not connect to {origin}: no answer within {config.connect_timeout_s:g} s",
        ) from None
    except ConnectionRefusedError:
        connection.close()
        raise EngineFailure(
            ErrorCode.DECODE_FAILED,
            f"could not connect to {origin}: connection refused (is the server running?)",
        ) from None
    except socket.gaierror as exc:
        connection.close()
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, f"could not find the host {origin.host}: {exc.strerror}"
        ) from None
    except ssl.SSLError as exc:
        connection.close()
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, f"TLS with {origin} failed: {exc.reason or exc}"
        ) from None
    except OSError as exc:
        connection.close()
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, f"could not connect to {origin}: {exc.strerror or exc}"
        ) from None
    assert connection.sock is not None
    connection.sock.settimeout(config.read_timeout_s)
    if abort is not None:
        abort.attach(connection.sock)  # a Stop from here on closes it (one before: at once)
    return connection


def _send(
    connection: http.client.HTTPConnection,
    method: str,
    url: str,
    body: bytes | None,
    accept: str,
    api_key: str | None,
) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {"Accept": accept, "User-Agent": USER_AGENT}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        connection.request(method, target, body=body, headers=headers)
        return connection.getresponse()
    except TimeoutError:
        raise EngineFailure(ErrorCode.DECODE_FAILED, f"{url}: the server did not answer in time") from None
    except (OSError, http.client.HTTPException) as exc:
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, f"{url}: the connection failed ({type(exc).__name__}: {exc})"
        ) from None


def _redirect_target(
    response: http.client.HTTPResponse, url: str, origin: Origin, method: str, status: int
) -> str:
    location = response.getheader("Location")
    if not location:
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"{url}: redirect {status} without a Location")
    target = urljoin(url, location)
    if Origin.of(target) != origin:
        # The request carries the API key and the conversation: neither goes to a host not chosen.
        raise EngineFailure(
            ErrorCode.BAD_REQUEST,
            f"{url}: the server redirects to {Origin.of(target)}, another host; not followed "
            "(connect to that URL yourself if you trust it)",
        )
    if method != "GET" and status not in (307, 308):
        raise EngineFailure(
            ErrorCode.BAD_REQUEST, f"{url}: redirect {status} would turn the {method} into a GET"
        )
    return target


def _read_bounded(response: http.client.HTTPResponse, limit: int) -> bytes:
    with contextlib.suppress(OSError, http.client.HTTPException):
        return response.read(limit)
    return b""


def _error_of_status(status: int, raw: bytes, url: str) -> tuple[ErrorCode, str]:
    message, code = error_message(raw)
    said = f": {message}" if message else ""
    lowered = f"{message} {code}".lower()
    if status in (401, 403):
        return ErrorCode.BAD_REQUEST, f"the server refused the API key ({status}){said}"
    if status == 404:
        return ErrorCode.BAD_REQUEST, f"{url} not found (404){said}; is the URL the API's base (…/v1)?"
    if status == 429:
        return ErrorCode.BAD_REQUEST, f"the server is busy (429){said}"
    if "context" in lowered and any(w in lowered for w in ("length", "long", "exceed", "overflow")):
        return ErrorCode.CONTEXT_OVERFLOW, f"the prompt is too long for the server's model ({status}){said}"
    if status == 503 and ("model" in lowered and "load" in lowered):
        return ErrorCode.MODEL_NOT_LOADED, f"the server has no model loaded (503){said}"
    if 400 <= status < 500:
        return ErrorCode.BAD_REQUEST, f"the server refused the request ({status}){said}"
    return ErrorCode.DECODE_FAILED, f"the server failed ({status}){said}"


def error_message(raw: bytes | Any) -> tuple[str, str]:
    """(message, code) from the error bodies servers send: OpenAI's {"error": {...}}, vLLM's
    {"message", "code"}, Ollama's {"error": "..."}, FastAPI's {"detail": ...}; else the text."""
    data: Any = raw
    if isinstance(raw, bytes):
        text = raw.decode("utf-8", errors="replace")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return short(text), ""
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, str):
            return short(inner), ""
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("detail") or ""
            code = inner.get("code") or inner.get("type") or ""
            return short(str(message)), short(str(code))
    return short(str(data)), ""


def short(text: str, limit: int = 300) -> str:
    """A server's words, made safe to show: one line, no control characters, bounded."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"
