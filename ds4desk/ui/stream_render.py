"""Render a streaming answer into its frame block by block, so a render costs O(the open block), not
O(the whole answer).

Markdown is block-structured: once a blank line outside a code fence is followed by a line that
starts a new block, everything before that line renders the same whatever comes after. Those
finished blocks are converted and inserted once; each render replaces only the tail after them. A
full render of a 80 kB answer (Markdown, pygments, QTextDocument HTML import and layout) takes about
a second on a small CPU; the tail takes a few milliseconds.

Not handled here (the caller renders those whole, as before): answers with a <think> block, and a
final text that does not start with what was already inserted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from PySide6.QtGui import QTextBlockFormat, QTextCharFormat, QTextCursor, QTextFrame

from ds4desk.ui.markdown_render import MarkdownRenderer, split_thinking

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
# A line that may continue the block before a blank line: indented, a list item, a quote.
_CONTINUES = re.compile(r"^(\s|[-*+](\s|$)|\d{1,9}[.)](\s|$)|>)")


def stable_end(text: str, start: int = 0) -> int:
    """The end of the finished blocks of `text`, at or after `start` (itself such an end): the start
    of a complete line that follows a blank line outside any code fence and starts a new block."""
    end = start
    fence: str | None = None
    blank_before = False
    pos = start
    while True:
        newline = text.find("\n", pos)
        if newline < 0:
            return end  # the last line may still grow: it decides nothing
        line = text[pos:newline]
        match = _FENCE.match(line)
        if fence is None and blank_before and line.strip() and not _CONTINUES.match(line):
            end = pos
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker) :]:
                fence = None
        blank_before = not line.strip()
        pos = newline + 1


@dataclass(slots=True)
class StreamSplicer:
    """The rendering state of one streaming answer (reset for each new one)."""

    stable_text: str = ""  # the finished blocks, already in the document
    stable_offset: int = 0  # where they end, counted from the frame's first position
    code_blocks: list[str] = field(default_factory=list)  # theirs, for "copy"
    renders: int = 0

    def reset(self) -> None:
        self.stable_text = ""
        self.stable_offset = 0
        self.code_blocks = []

    def render(
        self,
        renderer: MarkdownRenderer,
        frame: QTextFrame,
        text: str,
        *,
        streaming: bool,
        code_href: str | None,
        extra_html: str = "",
    ) -> list[str] | None:
        """Bring `frame` up to `text`; returns every code block of the answer, or None (nothing
        changed) when `text` must be rendered whole by the caller."""
        if not text.strip() or split_thinking(text)[0] is not None or not text.startswith(self.stable_text):
            self.reset()  # the caller's whole render replaces everything in the frame
            return None
        start = len(self.stable_text)
        end = stable_end(text, start)
        new_html = ""
        if end > start:
            new_html = _with_offset(
                renderer.render(text[start:end], code_href=code_href), code_href, len(self.code_blocks)
            )
            self.code_blocks.extend(renderer.code_blocks)
        tail = text[end:]
        tail_html = ""
        tail_blocks: list[str] = []
        if tail.strip():
            offset = len(self.code_blocks)
            tail_html = _with_offset(
                renderer.render(tail, streaming=streaming, code_href=code_href), code_href, offset
            )
            tail_blocks = list(renderer.code_blocks)
        self._splice(frame, new_html, tail_html + extra_html)
        self.stable_text = text[:end]
        self.renders += 1
        return [*self.code_blocks, *tail_blocks]

    def _splice(self, frame: QTextFrame, new_html: str, tail_html: str) -> None:
        first = frame.firstPosition()
        cursor = QTextCursor(frame.document())
        cursor.setPosition(first + self.stable_offset)
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.beginEditBlock()  # one layout pass for the whole change
        cursor.removeSelectedText()
        if cursor.block().length() == 1:
            # An emptied block keeps the format of what was there (a list item, a heading): reset it,
            # so the new HTML lands as it would in a fresh frame.
            # (Asked only when there is one: PySide6 6.12 under-counts the None currentList returns.)
            if cursor.blockFormat().objectIndex() != -1 and (listed := cursor.currentList()) is not None:
                listed.remove(cursor.block())
            cursor.setBlockFormat(QTextBlockFormat())
            cursor.setBlockCharFormat(QTextCharFormat())
        if new_html:
            _insert(cursor, new_html, first)
            self.stable_offset = cursor.position() - first
        if tail_html:
            _insert(cursor, tail_html, first)
        cursor.endEditBlock()


_OWN_BLOCK = ("<table", "<ul", "<ol", "<hr")


def _insert(cursor: QTextCursor, html: str, first: int) -> None:
    """Insert like one insertHtml of everything would have: a paragraph, heading or quote after
    other content needs a block of its own (else it joins the block before it); tables, lists and
    rules make their own."""
    if cursor.position() > first and not html.lstrip().startswith(_OWN_BLOCK):
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
    cursor.insertHtml(html)


def _with_offset(html: str, code_href: str | None, offset: int) -> str:
    """The renderer numbers code blocks from 0 in each render: number them within the answer."""
    if code_href is None or offset == 0:
        return html
    pattern = re.compile(re.escape(f'href="{code_href}/') + r'(\d+)"')
    return pattern.sub(lambda m: f'href="{code_href}/{int(m.group(1)) + offset}"', html)
