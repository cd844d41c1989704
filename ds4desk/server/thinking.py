"""An answer's thinking part apart from its reply, as DeepSeek's API returns them: `reasoning_content`
then `content`.

The split is on the text the model writes, `<think>` … `</think>` at the start of the answer, as the
window shows it (ui/markdown_render.split_thinking): when the chat format's prompt already opened the
thinking part (DeepSeek-V4 in thinking mode), the answer starts inside it without writing the tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ds4desk.engine.api import ThinkingFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class _Part(Enum):
    UNDECIDED = 0  # nothing but white space yet: a <think> may still open
    THINKING = 1
    ANSWER = 2


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkSplitter:
    """Text goes in piece by piece; out come the reasoning and the reply. A tail that could still be
    the start of a tag is held back until the next piece decides it, so no tag leaks half-written."""

    def __init__(self, fmt: ThinkingFormat, thinking: bool) -> None:
        # A model whose chat format knows no thinking: its text is all reply, tags or not.
        has_thinking = fmt.switch or fmt.opened_when_on or fmt.opened_when_off
        if not has_thinking:
            self._part = _Part.ANSWER
        elif fmt.opened(thinking):
            self._part = _Part.THINKING
        else:
            self._part = _Part.UNDECIDED
        self._held = ""

    def feed(self, text: str) -> Split:
        self._held += text
        return self._settle(final=False)

    def flush(self) -> Split:
        """The end of the answer: what was held back goes where it stands."""
        return self._settle(final=True)

    def _settle(self, final: bool) -> Split:
        out = Split()
        while self._held:
            held = self._held
            if self._part is _Part.ANSWER:
                out.content += held
                self._held = ""
            elif self._part is _Part.UNDECIDED:
                stripped = held.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._part = _Part.THINKING
                    self._held = stripped[len(THINK_OPEN) :]
                elif THINK_OPEN.startswith(stripped) and not final:
                    break  # white space or a half-written <think>: wait for more
                else:
                    self._part = _Part.ANSWER
            else:
                end = held.find(THINK_CLOSE)
                if end >= 0:
                    out.reasoning += held[:end]
                    self._held = held[end + len(THINK_CLOSE) :]
                    self._part = _Part.ANSWER
                    continue
                keep = 0 if final else _open_tail(held, THINK_CLOSE)
                out.reasoning += held[: len(held) - keep]
                self._held = held[len(held) - keep :]
                break
        return out


def split_text(text: str, fmt: ThinkingFormat, thinking: bool) -> Split:
    """A whole answer split at once: the same rules as the streamed split."""
    splitter = ThinkSplitter(fmt, thinking)
    first, rest = splitter.feed(text), splitter.flush()
    return Split(first.reasoning + rest.reasoning, first.content + rest.content)


def _open_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
