"""Server-sent events read line by line from an untrusted server: bounded lines, events and line
counts, strict UTF-8. Only what OpenAI-style streams use: `data:` (several lines join with "\\n"),
`event:`, comments; `id:` and `retry:` are read and dropped. Lines end in "\n" or "\r\n" (a lone
"\r", which the spec also allows, is not used by any of the servers this talks to)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ds4desk.engine.api import EngineFailure, ErrorCode


@dataclass(slots=True, frozen=True)
class SseEvent:
    event: str  # "" for the default "message"
    data: str


class SseReader:
    """`readline(limit)` returns one line of at most `limit` bytes, b"" at the end of the stream."""

    def __init__(self, readline: Callable[[int], bytes], max_line_bytes: int, max_lines: int) -> None:
        self._readline = readline
        self._max_line = max_line_bytes
        self._max_lines = max_lines
        self.lines = 0

    def events(self) -> Iterator[SseEvent]:
        event, data, has_data = "", [], False
        size = 0
        while True:
            raw = self._readline(self._max_line + 1)
            if not raw:
                # The end. The spec drops an event left without its blank line; servers that omit
                # the last one still meant it.
                if has_data:
                    yield SseEvent(event, "\n".join(data))
                return
            self.lines += 1
            if self.lines > self._max_lines:
                raise EngineFailure(
                    ErrorCode.DECODE_FAILED, f"the server sent more than {self._max_lines} lines; closed"
                )
            if len(raw) > self._max_line:
                raise EngineFailure(
                    ErrorCode.DECODE_FAILED,
                    f"the server sent a line longer than {self._max_line} bytes; closed",
                )
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            if self.lines == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a byte order mark may open the stream
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise EngineFailure(
                    ErrorCode.DECODE_FAILED, "the server sent text that is not UTF-8"
                ) from None
            if not line:
                if has_data:
                    yield SseEvent(event, "\n".join(data))
                event, data, has_data, size = "", [], False, 0
                continue
            if line.startswith(":"):
                continue  # a comment: keep-alives
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                size += len(value)
                if size > self._max_line:
                    raise EngineFailure(
                        ErrorCode.DECODE_FAILED,
                        f"the server sent an event larger than {self._max_line} bytes",
                    )
                data.append(value)
                has_data = True
            elif name == "event":
                event = value
            # id, retry and unknown fields: nothing an answer needs
