"""Model output (Markdown) to the HTML subset QTextDocument understands.

No Qt here, so it is cheap to test. Model output is untrusted: raw HTML is shown as text, never
interpreted. Code is highlighted by pygments with inline styles, because QTextDocument ignores
class selectors from a stylesheet it was not given.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

import markdown

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(slots=True, frozen=True)
class CodeColors:
    pygments_style: str
    background: str
    border: str
    muted: str  # thinking text, the "copy" links
    rule: str  # the thinking block's left rule
    table_border: str


LIGHT = CodeColors("friendly", "#f4f6f8", "#e1e4e8", "#6b7280", "#d1d5db", "#d0d7de")
DARK = CodeColors("monokai", "#1e1f24", "#3a3d45", "#9ca3af", "#4b5563", "#4b5563")
PYGMENTS_STYLE = LIGHT.pygments_style
CODE_BACKGROUND = LIGHT.background
CODE_BORDER = LIGHT.border
_TAG = re.compile(r"<[^>]+>")


@dataclass(slots=True)
class ThinkingView:
    """How to show an answer's <think> block: collapsed to one line unless `expanded`."""

    href: str  # the anchor that toggles it
    expanded: bool = False
    tokens: int | None = None  # None: not counted (an answer from before counting existed)


_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
# A list item or heading straight after a paragraph line: Python-Markdown wants a blank line before
# it, models rarely write one.
_BLOCK_START = re.compile(r"^\s{0,3}([-*+]\s|\d{1,3}[.)]\s|#{1,6}\s)")
_CODEHILITE = re.compile(
    r'<div class="codehilite"[^>]*>\s*<pre[^>]*>(?:<span></span>)?(.*?)</pre>\s*</div>', re.S
)


class MarkdownRenderer:
    """One Markdown instance, reused (building one per render costs more than the render)."""

    def __init__(self, colors: CodeColors = LIGHT) -> None:
        self.colors = colors
        # The plain text of each code block of the last render, in order (for "copy").
        self.code_blocks: list[str] = []
        self._code_href: str | None = None
        self._md = markdown.Markdown(
            extensions=["fenced_code", "codehilite", "tables", "sane_lists", "nl2br"],
            # nl2br: models write "line\nline" meaning two lines, as chat UIs show it.
            extension_configs={
                "codehilite": {
                    "noclasses": True,
                    "guess_lang": False,  # a wrong guess looks worse than no colour
                    "pygments_style": colors.pygments_style,
                }
            },
        )
        # Raw HTML in model output becomes visible text.
        self._md.preprocessors.deregister("html_block")
        self._md.inlinePatterns.deregister("html")

    def render(
        self,
        text: str,
        *,
        streaming: bool = False,
        thinking: ThinkingView | None = None,
        code_href: str | None = None,
    ) -> str:
        """`streaming`: the text may stop mid-way, so close an open code fence (otherwise the
        block flickers between raw backticks and highlighted code as it grows).
        `thinking`: show a <think> block collapsible (else always open, as a quote).
        `code_href`: each code block gets a "copy" link to `{code_href}/{n}`."""
        self.code_blocks = []
        self._code_href = code_href
        thought, answer, thinking_open = split_thinking(text)
        parts: list[str] = []
        if thought is not None:
            parts.append(self._thinking_html(thought, thinking_open and streaming, thinking, streaming))
        if answer.strip():
            parts.append(self._convert(answer, streaming=streaming))
        return "".join(parts)

    def _thinking_html(
        self, thought: str, still_open: bool, view: ThinkingView | None, streaming: bool
    ) -> str:
        muted = self.colors.muted
        if view is None:
            label = "Thinking…" if still_open else "Thought process"
            header = f"<p><i>{label}</i></p>"
            expanded = True
        else:
            words = f"{len(thought.split()):,} words"
            count = f"{view.tokens:,} tokens" if view.tokens is not None else words
            label = f"Thinking… ({count})" if still_open else f"Thought for {count}"
            arrow = "▾" if view.expanded else "▸"
            header = (
                f'<p><a href="{view.href}" style="color: {muted}; text-decoration: none;">'
                f"{arrow} <i>{label}</i></a></p>"
            )
            expanded = view.expanded
        body = self._convert(thought, streaming=streaming) if expanded and thought.strip() else ""
        return (
            '<table width="100%" cellspacing="0" cellpadding="8" style="margin-bottom: 8px;">'
            f'<tr><td style="color: {muted}; border-left: 3px solid {self.colors.rule};">'
            f"{header}{body}</td></tr></table>"
        )

    def _convert(self, text: str, *, streaming: bool) -> str:
        source = _prepare(text, streaming=streaming)
        self._md.reset()
        out = self._md.convert(source)
        out = out.replace(
            "<table>",
            '<table border="1" cellspacing="0" cellpadding="6" style="border-collapse: collapse;'
            f" border-style: solid; border-color: {self.colors.table_border};"
            ' margin-top: 4px; margin-bottom: 10px;">',
        )
        return _CODEHILITE.sub(self._code_block, out)

    def _code_block(self, match: re.Match[str]) -> str:
        # QTextDocument paints a table cell's background reliably, a div's only per line; pre-wrap
        # keeps long lines inside the bubble instead of scrolling the whole chat sideways.
        code = match.group(1).replace("<code>", "").replace("</code>", "").rstrip("\n")
        index = len(self.code_blocks)
        self.code_blocks.append(html.unescape(_TAG.sub("", code)))
        link = ""
        if self._code_href is not None:
            link = (
                f'<p align="right" style="margin: 0px;"><a href="{self._code_href}/{index}"'
                f' style="color: {self.colors.muted}; text-decoration: none;">copy</a></p>'
            )
        colors = self.colors
        return (
            f'<table width="100%" cellspacing="0" cellpadding="10" bgcolor="{colors.background}"'
            f' style="border: 1px solid {colors.border}; margin-top: 4px; margin-bottom: 10px;">'
            f'<tr><td>{link}<pre class="code" style="white-space: pre-wrap;">{code}</pre></td></tr></table>'
        )


def split_thinking(text: str) -> tuple[str | None, str, bool]:
    """(thinking or None, answer, thinking still open) for output that starts with a <think> block."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return None, text, False
    body = stripped[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body, "", True
    return body[:end], body[end + len(THINK_CLOSE) :], False


def with_think_tag(text: str) -> str:
    """In thinking mode the prompt opens the <think> block, so the answer starts inside it: put
    the tag in front, so the text says what it is (and split_thinking finds it) later too."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN) or (stripped and THINK_OPEN.startswith(stripped)):
        return text
    return THINK_OPEN + text


def _prepare(text: str, *, streaming: bool) -> str:
    lines = text.split("\n")
    out: list[str] = []
    fence: str | None = None
    for line in lines:
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
                if out and out[-1].strip():
                    out.append("")  # fenced_code needs a blank line before the fence too
            elif marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker) :]:
                fence = None
        elif (
            fence is None
            and _BLOCK_START.match(line)
            and out
            and out[-1].strip()
            and not _BLOCK_START.match(out[-1])
            and not out[-1].startswith((" ", "\t"))
        ):
            out.append("")
        out.append(line)
    if fence is not None and streaming:
        out.append(fence)
    return "\n".join(out)
