"""The conversation: one QTextBrowser, one QTextFrame per message.

Frames give each message its own box (background, margins) inside a single document, so selection,
copy and scrolling work across the whole chat. While an answer streams only its frame is rebuilt,
and at most every `render_interval_ms`: re-rendering Markdown is O(length of the answer), the rest
of the chat is never touched.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from enum import StrEnum

from PySide6.QtCore import QElapsedTimer, QTimer, QUrl
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFontDatabase,
    QTextCursor,
    QTextFrame,
    QTextFrameFormat,
    QTextLength,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

from ds4desk.ui.markdown_render import MarkdownRenderer


class NoteKind(StrEnum):
    INFO = "info"  # stopped by the user
    WARNING = "warning"  # interrupted: the app closed mid-answer
    ERROR = "error"


_NOTE_COLORS = {NoteKind.INFO: "#6b7280", NoteKind.WARNING: "#b45309", NoteKind.ERROR: "#b91c1c"}


@dataclass(slots=True, frozen=True)
class _BubbleStyle:
    background: str
    border: str
    left_margin: int
    right_margin: int


_STYLES = {
    "user": _BubbleStyle("#e8f0fe", "#d2e3fc", 96, 0),
    "assistant": _BubbleStyle("#ffffff", "#e5e7eb", 0, 48),
    "system": _BubbleStyle("#f9fafb", "#e5e7eb", 48, 48),
    "error": _BubbleStyle("#fef2f2", "#fecaca", 0, 48),
}


class ChatView(QTextBrowser):
    def __init__(self, parent: QWidget | None = None, *, render_interval_ms: int = 80) -> None:
        super().__init__(parent)
        self.setObjectName("ChatView")
        self.setReadOnly(True)
        self.setOpenLinks(False)  # links go to the system browser, never into the chat
        self.anchorClicked.connect(_open_link)
        self.setPlaceholderText("Ask anything. Answers stream in here.")
        self.document().setDocumentMargin(20)
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()
        self.document().setDefaultStyleSheet(
            f"pre, code {{ font-family: '{mono}'; }}"
            "code { background-color: #eef0f3; }"
            "p { margin-top: 0px; margin-bottom: 8px; }"
            "pre { margin: 0px; }"
            "h1 { font-size: x-large; } h2 { font-size: large; } h3 { font-size: medium; }"
            "a { color: #2563eb; }"
        )
        self._renderer = MarkdownRenderer()
        self.render_interval_ms = render_interval_ms
        self._stream_frame: QTextFrame | None = None
        self._stream_parts: list[str] = []
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.timeout.connect(self._render_stream)
        self._since_render = QElapsedTimer()
        self._interval_ms = render_interval_ms  # grows when renders get slow (see _render_stream)
        self.renders = 0  # how often the streaming frame was rebuilt (lets tests check throttling)

    # ---- whole messages -------------------------------------------------------------------

    def clear_messages(self) -> None:
        self._render_timer.stop()
        self._stream_frame = None
        self._stream_parts = []
        self.clear()

    def add_message(
        self, role: str, content: str, *, note: str | None = None, note_kind: NoteKind = NoteKind.INFO
    ) -> None:
        frame = self._new_frame(role)
        self._fill(frame, self._body_html(role, content) + _note_html(note, note_kind))
        self._scroll_to_end()

    def add_error(self, text: str) -> None:
        """An error that belongs to no message (a failed model load, say); not kept in history."""
        frame = self._new_frame("error")
        self._fill(frame, _note_html(text, NoteKind.ERROR))
        self._scroll_to_end()

    # ---- the streaming answer -------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        return self._stream_frame is not None

    @property
    def stream_text(self) -> str:
        if len(self._stream_parts) > 1:
            self._stream_parts = ["".join(self._stream_parts)]
        return self._stream_parts[0] if self._stream_parts else ""

    def begin_stream(self, text: str = "") -> None:
        self._stream_frame = self._new_frame("assistant")
        self._stream_parts = [text] if text else []
        self._interval_ms = self.render_interval_ms
        self._render_stream()
        self._scroll_to_end()

    def append_stream(self, text: str) -> None:
        if self._stream_frame is None or not text:
            return
        self._stream_parts.append(text)
        if self._render_timer.isActive():
            return  # a render is already due; it will pick this text up
        interval = max(self.render_interval_ms, self._interval_ms) if self.render_interval_ms > 0 else 0
        wait = interval - self._since_render.elapsed() if self._since_render.isValid() else 0
        if wait <= 0:
            self._render_stream()
        else:
            self._render_timer.start(wait)

    def end_stream(
        self, text: str | None = None, *, note: str | None = None, note_kind: NoteKind = NoteKind.INFO
    ) -> None:
        """Final render, right away: `text` replaces what streamed if given."""
        if self._stream_frame is None:
            return
        self._render_timer.stop()
        if text is not None:
            self._stream_parts = [text]
        at_end = self._at_end()
        self._fill(
            self._stream_frame, self._body_html("assistant", self.stream_text) + _note_html(note, note_kind)
        )
        self._stream_frame = None
        if at_end:
            self._scroll_to_end()

    def _render_stream(self) -> None:
        if self._stream_frame is None:
            return
        at_end = self._at_end()
        cost = QElapsedTimer()
        cost.start()
        text = self.stream_text
        body = self._renderer.render(text, streaming=True) if text.strip() else _note_html("…", NoteKind.INFO)
        self._fill(self._stream_frame, body)
        # A long answer costs more per render: keep rendering under ~25% of the UI thread's time.
        self._interval_ms = 4 * cost.elapsed()
        self._since_render.start()
        self.renders += 1
        if at_end:  # follow the answer unless the user scrolled up to read
            self._scroll_to_end()

    # ---- document plumbing ----------------------------------------------------------------

    def _body_html(self, role: str, content: str) -> str:
        if role == "assistant":
            return self._renderer.render(content) if content.strip() else ""
        # What the user typed is shown as typed, not as Markdown.
        return f'<p style="white-space: pre-wrap;">{html.escape(content)}</p>'

    def _new_frame(self, role: str) -> QTextFrame:
        style = _STYLES.get(role, _STYLES["assistant"])
        fmt = QTextFrameFormat()
        fmt.setBackground(QColor(style.background))
        fmt.setBorder(1)
        fmt.setBorderBrush(QColor(style.border))
        fmt.setBorderStyle(QTextFrameFormat.BorderStyle.BorderStyle_Solid)
        fmt.setPadding(12)
        fmt.setLeftMargin(style.left_margin)
        fmt.setRightMargin(style.right_margin)
        fmt.setBottomMargin(4)
        fmt.setWidth(QTextLength(QTextLength.Type.PercentageLength, 100))
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor.insertFrame(fmt)

    def _fill(self, frame: QTextFrame, body: str) -> None:
        cursor = frame.firstCursorPosition()
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.beginEditBlock()  # one layout pass for the remove and the insert
        cursor.removeSelectedText()
        cursor.insertHtml(body)
        cursor.endEditBlock()

    def _at_end(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 8

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())


def _note_html(note: str | None, kind: NoteKind) -> str:
    if not note:
        return ""
    body = html.escape(note).replace("\n", "<br>")  # a note may have several lines (reason, then speed)
    return f'<p style="color: {_NOTE_COLORS[kind]}; margin-top: 6px;"><i>{body}</i></p>'


def _open_link(url: QUrl) -> None:
    if url.scheme() in ("http", "https", "mailto"):
        QDesktopServices.openUrl(url)
