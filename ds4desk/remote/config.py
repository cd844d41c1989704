"""Where a remote engine connects and how long it waits: plain data, no Qt, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from ds4desk.engine.api import EngineFailure, ErrorCode, ModelInfo

# What ModelInfo.device says for a model behind a server (until ModelInfo has its own flag).
REMOTE_DEVICE = "remote"

# What a remote model cannot do: the window greys these out rather than offering a broken action.
NOT_AVAILABLE = "not available for a remote model"


@dataclass(slots=True)
class RemoteConfig:
    """One OpenAI-compatible server. `url` is its base (http://host:8000/v1, or http://host:8000 to
    which /v1 is added); `model` None takes the first one GET /v1/models lists."""

    url: str
    api_key: str | None = None
    model: str | None = None
    connect_timeout_s: float = 10.0
    # Between two reads of the answer: a server queueing a long prompt may say nothing for a while,
    # but never forever.
    read_timeout_s: float = 300.0
    # The whole answer, however it trickles in (None: only the per-read timeout and the size bounds).
    answer_timeout_s: float | None = 3600.0
    # Stop strings sent with every request (GenerateRequest has token ids only).
    stop: tuple[str, ...] = ()
    # Bounds on what a server may send: one SSE line, a JSON body, redirects followed (same origin).
    max_line_bytes: int = 1 << 20
    max_body_bytes: int = 8 << 20
    max_redirects: int = 3


def base_url(url: str) -> str:
    """The API base a user's URL means: http(s) only, a host required, /v1 added to a bare host."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text  # "localhost:8000" is what people type
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise EngineFailure(
            ErrorCode.BAD_REQUEST, f"a server URL starts with http:// or https://, not {url!r}"
        )
    if not parts.hostname:
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"no host in the server URL {url!r}")
    if parts.username or parts.password:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "put the API key in its own field, not in the URL")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"the port in {url!r} is not valid") from None
    path = parts.path.rstrip("/")
    if not path:
        path = "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def is_remote(info: ModelInfo | None) -> bool:
    """Whether the model is served by another program: park, unpark, snapshot slots and the memory
    readout do not apply to it."""
    if info is None:
        return False
    flag = getattr(info, "remote", None)  # ModelInfo.remote, once api.py has it
    return bool(flag) if flag is not None else info.device == REMOTE_DEVICE
