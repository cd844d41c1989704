"""The conversation: one QTextBrowser, one QTextFrame per message.

Frames give each message its own box (background, margins) inside a single document, so selection,
copy and scrolling work across the whole chat. While an answer streams only its frame is rebuilt,
and at most every `render_interval_ms`: re-rendering Markdown is O(length of the answer), the rest
of the chat is never touched.

Per-message actions (copy, copy a code block, edit, regenerate, switch branch, open the thinking
block) are links with the `action:` scheme: `anchorClicked` handles them here and never navigates.
Copying and folding are the view's own business; edit, regenerate and branch switches change the
history, so they go out through `action_requested`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from enum import StrEnum

from PySide6.QtCore import QElapsedTimer, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFontDatabase,
    QGuiApplication,
    QTextCursor,
    QTextFrame,
    QTextFrameFormat,
    QTextLength,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

from ds4desk.ui.markdown_render import DARK, LIGHT, MarkdownRenderer, ThinkingView, split_thinking
from ds4desk.ui.stream_render import StreamSplicer

ACTION_SCHEME = "action"
# Actions the window carries out (they change the history); the rest the view does itself.
EDIT, REGENERATE, PREVIOUS, NEXT = "edit", "regenerate", "previous", "next"


class NoteKind(StrEnum):
    INFO = "info"  # stopped by the user
    WARNING = "warning"  # interrupted: the app closed mid-answer
    ERROR = "error"


@dataclass(slots=True, frozen=True)
class _BubbleStyle:
    background: str
    border: str
    left_margin: int
    right_margin: int


@dataclass(slots=True, frozen=True)
class _Palette:
    bubbles: dict[str, _BubbleStyle]
    notes: dict[NoteKind, str]
    text: str
    link: str
    inline_code: str
    actions: str


_LIGHT = _Palette(
    bubbles={
        "user": _BubbleStyle("#e8f0fe", "#d2e3fc", 96, 0),
        "assistant": _BubbleStyle("#ffffff", "#e5e7eb", 0, 48),
        "system": _BubbleStyle("#f9fafb", "#e5e7eb", 48, 48),
        "error": _BubbleStyle("#fef2f2", "#fecaca", 0, 48),
    },
    notes={NoteKind.INFO: "#6b7280", NoteKind.WARNING: "#b45309", NoteKind.ERROR: "#b91c1c"},
    text="#1f2937",
    link="#2563eb",
    inline_code="#eef0f3",
    actions="#6b7280",
)
_DARK = _Palette(
    bubbles={
        "user": _BubbleStyle("#1e3a5f", "#27496f", 96, 0),
        "assistant": _BubbleStyle("#1f2126", "#30343b", 0, 48),
        "system": _BubbleStyle("#23262c", "#30343b", 48, 48),
        "error": _BubbleStyle("#3b1d1d", "#7f1d1d", 0, 48),
    },
    notes={NoteKind.INFO: "#9ca3af", NoteKind.WARNING: "#f59e0b", NoteKind.ERROR: "#f87171"},
    text="#e5e7eb",
    link="#60a5fa",
    inline_code="#2d3139",
    actions="#9ca3af",
)


@dataclass(slots=True)
class _Entry:
    """One message on screen, kept so its frame can be rebuilt (fold, theme, actions)."""

    key: int  # the history message id, or a negative number for things not in history
    role: str
    content: str
    frame: QTextFrame
    note: str | None = None
    note_kind: NoteKind = NoteKind.INFO
    branch: tuple[int, int] = (0, 1)  # (index among its siblings, how many)
    thinking_tokens: int | None = None
    thinking_expanded: bool = False
    code_blocks: list[str] = field(default_factory=list)

    @property
    def in_history(self) -> bool:
        return self.key > 0


class ChatView(QTextBrowser):
    action_requested = Signal(str, int)  # (EDIT | REGENERATE | PREVIOUS | NEXT, message id)

    def __init__(self, parent: QWidget | None = None, *, render_interval_ms: int = 80) -> None:
        super().__init__(parent)
        self.setObjectName("ChatView")
        self.setAccessibleName("Conversation")
        self.setReadOnly(True)
        self.setOpenLinks(False)  # links go to the system browser, never into the chat
        self.anchorClicked.connect(self._on_anchor)
        self.setPlaceholderText("Ask anything. Answers stream in here.")
        self.document().setDocumentMargin(20)
        self._palette = _LIGHT
        self._renderer = MarkdownRenderer(LIGHT)
        self._apply_document_style()
        self.render_interval_ms = render_interval_ms
        self._entries: dict[int, _Entry] = {}
        self._order: list[int] = []
        self._next_local_key = -1
        self._stream: _Entry | None = None
        self._stream_parts: list[str] = []
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.timeout.connect(self._render_stream)
        self._since_render = QElapsedTimer()
        self._interval_ms = render_interval_ms  # grows when renders get slow (see _render_stream)
        self.renders = 0  # how often the streaming frame was rebuilt (lets tests check throttling)
        self._splicer = StreamSplicer()  # renders only the open block of a long streaming answer
        self.dark = False

    # ---- theme ----------------------------------------------------------------------------

    def set_dark(self, dark: bool) -> None:
        """Switch palettes and re-render every message in it (the document has fixed colours)."""
        if dark == self.dark:
            return
        self.dark = dark
        self._palette = _DARK if dark else _LIGHT
        self._renderer = MarkdownRenderer(DARK if dark else LIGHT)
        self._apply_document_style()
        entries = [self._entries[key] for key in self._order]
        stream_key = self._stream.key if self._stream is not None else None
        stream_text = self.stream_text
        self._render_timer.stop()
        self.clear()
        self._entries, self._order, self._stream = {}, [], None
        for entry in entries:
            if entry.key == stream_key:
                self.begin_stream(
                    stream_text,
                    message_id=entry.key,
                    thinking_tokens=entry.thinking_tokens,
                    branch=entry.branch,
                )
                continue
            new = self._add_entry(entry.key, entry.role, entry.content)
            new.note, new.note_kind, new.branch = entry.note, entry.note_kind, entry.branch
            new.thinking_tokens, new.thinking_expanded = entry.thinking_tokens, entry.thinking_expanded
            self._refill(new)

    def _apply_document_style(self) -> None:
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()
        p = self._palette
        self.document().setDefaultStyleSheet(
            f"pre, code {{ font-family: '{mono}'; }}"
            f"code {{ background-color: {p.inline_code}; }}"
            f"body {{ color: {p.text}; }}"
            "p { margin-top: 0px; margin-bottom: 8px; }"
            "pre { margin: 0px; }"
            "h1 { font-size: x-large; } h2 { font-size: large; } h3 { font-size: medium; }"
            f"a {{ color: {p.link}; }}"
        )

    # ---- whole messages -------------------------------------------------------------------

    def clear_messages(self) -> None:
        self._render_timer.stop()
        self._stream = None
        self._stream_parts = []
        self._entries, self._order = {}, []
        self.clear()

    def add_message(
        self,
        role: str,
        content: str,
        *,
        note: str | None = None,
        note_kind: NoteKind = NoteKind.INFO,
        message_id: int | None = None,
        branch: tuple[int, int] = (0, 1),
        thinking_tokens: int | None = None,
    ) -> None:
        """`message_id`: the history row, which enables the message's actions."""
        entry = self._add_entry(message_id, role, content)
        entry.note, entry.note_kind, entry.branch = note, note_kind, branch
        entry.thinking_tokens = thinking_tokens
        self._refill(entry)
        self._scroll_to_end()

    def add_error(self, text: str) -> None:
        """An error that belongs to no message (a failed model load, say); not kept in history."""
        entry = self._add_entry(None, "error", "")
        entry.note, entry.note_kind = text, NoteKind.ERROR
        self._refill(entry)
        self._scroll_to_end()

    def message_ids(self) -> list[int]:
        """The history messages on screen, in order."""
        return [key for key in self._order if key > 0]

    def message_html(self, message_id: int) -> str:
        """What a message's frame shows, as HTML (tests look at single messages with it)."""
        entry = self._entries[message_id]
        cursor = entry.frame.firstCursorPosition()
        cursor.setPosition(entry.frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        return cursor.selection().toHtml()

    def message_text(self, message_id: int) -> str:
        entry = self._entries[message_id]
        cursor = entry.frame.firstCursorPosition()
        cursor.setPosition(entry.frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        return cursor.selection().toPlainText()

    # ---- the streaming answer -------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    @property
    def stream_text(self) -> str:
        if len(self._stream_parts) > 1:
            self._stream_parts = ["".join(self._stream_parts)]
        return self._stream_parts[0] if self._stream_parts else ""

    @property
    def stream_thinking_tokens(self) -> int:
        return (self._stream.thinking_tokens or 0) if self._stream is not None else 0

    def begin_stream(
        self,
        text: str = "",
        *,
        message_id: int | None = None,
        thinking_tokens: int | None = None,
        branch: tuple[int, int] = (0, 1),
    ) -> None:
        self._stream = self._add_entry(message_id, "assistant", "")
        self._stream.thinking_tokens = thinking_tokens or 0
        self._stream.branch = branch
        self._stream_parts = [text] if text else []
        self._interval_ms = self.render_interval_ms
        self._splicer.reset()
        self._render_stream()
        self._scroll_to_end()

    def append_stream(self, text: str, tokens: int = 0) -> None:
        """`tokens`: how many tokens made `text`; those written while thinking are counted."""
        if self._stream is None or not text:
            return
        before = self.stream_text
        self._stream_parts.append(text)
        if tokens and counts_as_thinking(before, text):
            self._stream.thinking_tokens = (self._stream.thinking_tokens or 0) + tokens
        if self._render_timer.isActive():
            return  # a render is already due; it will pick this text up
        interval = max(self.render_interval_ms, self._interval_ms) if self.render_interval_ms > 0 else 0
        wait = interval - self._since_render.elapsed() if self._since_render.isValid() else 0
        if wait <= 0:
            self._render_stream()
        else:
            self._render_timer.start(wait)

    def end_stream(
        self,
        text: str | None = None,
        *,
        note: str | None = None,
        note_kind: NoteKind = NoteKind.INFO,
        thinking_tokens: int | None = None,
    ) -> None:
        """Final render, right away: `text` replaces what streamed if given."""
        entry = self._stream
        if entry is None:
            return
        self._render_timer.stop()
        if text is not None:
            self._stream_parts = [text]
        at_end = self._at_end()
        entry.content = self.stream_text
        entry.note, entry.note_kind = note, note_kind
        if thinking_tokens is not None:
            entry.thinking_tokens = thinking_tokens
        if split_thinking(entry.content)[0] is None:
            entry.thinking_tokens = None
        self._stream = None
        extra = self._note_html(entry.note, entry.note_kind) + self._actions_html(entry)
        blocks = self._splicer.render(
            self._renderer,
            entry.frame,
            entry.content,
            streaming=False,
            code_href=self._code_href(entry),
            extra_html=extra,
        )
        if blocks is None:
            self._refill(entry)
        else:  # the finished blocks are in place already: only the last one was rendered again
            entry.code_blocks = blocks
        self._splicer.reset()
        if at_end:
            self._scroll_to_end()

    def _render_stream(self) -> None:
        entry = self._stream
        if entry is None:
            return
        at_end = self._at_end()
        cost = QElapsedTimer()
        cost.start()
        text = self.stream_text
        blocks = self._splicer.render(
            self._renderer, entry.frame, text, streaming=True, code_href=self._code_href(entry)
        )
        if blocks is not None:  # only the open block was rendered again
            entry.code_blocks = blocks
        else:
            if text.strip():
                body = self._renderer.render(
                    text,
                    streaming=True,
                    thinking=self._thinking_view(entry),
                    code_href=self._code_href(entry),
                )
                entry.code_blocks = list(self._renderer.code_blocks)
            else:
                body = self._note_html("…", NoteKind.INFO)
            self._fill(entry.frame, body)
        # A whole render costs more the longer the answer: keep it under ~25% of the UI thread's time.
        # A spliced one costs what arrived since the last, so rendering more often keeps each short.
        self._interval_ms = 4 * cost.elapsed() if blocks is None else self.render_interval_ms
        self._since_render.start()
        self.renders += 1
        if at_end:  # follow the answer unless the user scrolled up to read
            self._scroll_to_end()

    # ---- actions --------------------------------------------------------------------------

    def copy_message(self, message_id: int) -> str:
        """Copies the message as written (an answer without its thinking); returns what it copied."""
        entry = self._entries[message_id]
        text = entry.content
        if entry.role == "assistant":
            text = split_thinking(text)[1].strip()
        QGuiApplication.clipboard().setText(text)
        return text

    def copy_code(self, message_id: int, index: int) -> str:
        entry = self._entries[message_id]
        text = entry.code_blocks[index]
        QGuiApplication.clipboard().setText(text)
        return text

    def toggle_thinking(self, message_id: int) -> None:
        entry = self._entries[message_id]
        entry.thinking_expanded = not entry.thinking_expanded
        if entry is self._stream:
            self._render_stream()
        else:
            self._refill(entry)

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() != ACTION_SCHEME:
            _open_link(url)
            return
        parts = url.path().split("/")
        try:
            name, key = parts[0], int(parts[1])
            if key not in self._entries:
                return  # a link from a message that was cleared meanwhile
            if name == "copy":
                self.copy_message(key)
            elif name == "copy-code":
                self.copy_code(key, int(parts[2]))
            elif name == "toggle-think":
                self.toggle_thinking(key)
            elif name in (EDIT, REGENERATE, PREVIOUS, NEXT):
                self.action_requested.emit(name, key)
        except (IndexError, ValueError):
            return  # a malformed link (it can only come from a bug): ignore it rather than crash

    # ---- document plumbing ----------------------------------------------------------------

    def _add_entry(self, message_id: int | None, role: str, content: str) -> _Entry:
        if message_id is None:
            key = self._next_local_key
            self._next_local_key -= 1
        else:
            key = message_id
        previous = self._last_assistant()
        entry = _Entry(key, role, content, self._new_frame(role))
        self._entries[key] = entry
        self._order.append(key)
        if previous is not None and previous is not self._stream:
            self._refill_actions(previous)  # "Regenerate" belongs to the last answer only
        return entry

    def _last_assistant(self) -> _Entry | None:
        if not self._order:
            return None
        last = self._entries[self._order[-1]]
        return last if last.role == "assistant" and last.in_history else None

    def _refill(self, entry: _Entry) -> None:
        self._fill(entry.frame, self._entry_html(entry))

    def _refill_actions(self, entry: _Entry) -> None:
        """Rewrite only the actions line, the frame's last block, when it is there: rendering a long
        answer whole again to drop its Regenerate link would stall the window at every send."""
        cursor = QTextCursor(self.document())
        cursor.setPosition(entry.frame.lastPosition())
        block = cursor.block()
        if "Regenerate" not in block.text():
            self._refill(entry)
            return
        cursor.setPosition(block.position())
        cursor.setPosition(block.position() + block.length() - 1, QTextCursor.MoveMode.KeepAnchor)
        cursor.beginEditBlock()
        cursor.removeSelectedText()
        cursor.insertHtml(self._actions_html(entry))
        cursor.endEditBlock()

    def _entry_html(self, entry: _Entry) -> str:
        if entry.role == "assistant":
            body = ""
            if entry.content.strip():
                body = self._renderer.render(
                    entry.content, thinking=self._thinking_view(entry), code_href=self._code_href(entry)
                )
                entry.code_blocks = list(self._renderer.code_blocks)
        elif entry.role == "error":
            body = ""
        else:
            # What the user typed is shown as typed, not as Markdown.
            body = f'<p style="white-space: pre-wrap;">{html.escape(entry.content)}</p>'
        return body + self._note_html(entry.note, entry.note_kind) + self._actions_html(entry)

    def _thinking_view(self, entry: _Entry) -> ThinkingView | None:
        if not entry.in_history:
            return None
        return ThinkingView(
            f"{ACTION_SCHEME}:toggle-think/{entry.key}", entry.thinking_expanded, entry.thinking_tokens
        )

    def _code_href(self, entry: _Entry) -> str | None:
        return f"{ACTION_SCHEME}:copy-code/{entry.key}" if entry.in_history else None

    def _actions_html(self, entry: _Entry) -> str:
        if not entry.in_history or entry.role not in ("user", "assistant"):
            return ""
        key, color = entry.key, self._palette.actions
        links = [_link(f"copy/{key}", "Copy", color)]
        if entry.role == "user":
            links.append(_link(f"{EDIT}/{key}", "Edit", color))
        elif self._order and self._order[-1] == key:
            links.append(_link(f"{REGENERATE}/{key}", "Regenerate", color))
        index, count = entry.branch
        if count > 1:
            back = _link(f"{PREVIOUS}/{key}", "‹", color) if index > 0 else "‹"
            forward = _link(f"{NEXT}/{key}", "›", color) if index < count - 1 else "›"
            links.append(f"{back} {index + 1}/{count} {forward}")
        return (
            f'<p style="color: {color}; margin-top: 4px; margin-bottom: 0px;">'
            + " &nbsp;·&nbsp; ".join(links)
            + "</p>"
        )

    def _note_html(self, note: str | None, kind: NoteKind) -> str:
        if not note:
            return ""
        body = html.escape(note).replace("\n", "<br>")  # a note may have several lines (reason, then speed)
        return f'<p style="color: {self._palette.notes[kind]}; margin-top: 6px;"><i>{body}</i></p>'

    def _new_frame(self, role: str) -> QTextFrame:
        style = self._palette.bubbles.get(role, self._palette.bubbles["assistant"])
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


def counts_as_thinking(before: str, added: str) -> bool:
    """Whether text `added` after `before` was written inside (or closes) a <think> block."""
    return _thinking_open(before) and split_thinking(before + added)[0] is not None


def _thinking_open(text: str) -> bool:
    """Whether what streamed so far is (or may still become) an open <think> block."""
    stripped = text.lstrip()
    if len(stripped) < len("<think>"):
        return "<think>".startswith(stripped)
    return split_thinking(text)[2]


def _link(path: str, label: str, color: str) -> str:
    return f'<a href="{ACTION_SCHEME}:{path}" style="color: {color}; text-decoration: none;">{label}</a>'


def _open_link(url: QUrl) -> None:
    if url.scheme() in ("http", "https", "mailto"):
        QDesktopServices.openUrl(url)
