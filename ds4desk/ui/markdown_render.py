"""Model output (Markdown) to the HTML subset QTextDocument understands.

No Qt here, so it is cheap to test. Model output is untrusted: raw HTML is shown as text, never
interpreted. Code is highlighted by pygments with inline styles, because QTextDocument ignores
class selectors from a stylesheet it was not given.
"""

from __future__ import annotations

import re

import markdown

PYGMENTS_STYLE = "friendly"
CODE_BACKGROUND = "#f4f6f8"
CODE_BORDER = "#e1e4e8"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
# A list item or heading straight after a paragraph line: Python-Markdown wants a blank line before
# it, models rarely write one.
_BLOCK_START = re.compile(r"^\s{0,3}([-*+]\s|\d{1,3}[.)]\s|#{1,6}\s)")
_CODEHILITE = re.compile(
    r'<div class="codehilite"[^>]*>\s*<pre[^>]*>(?:<span></span>)?(.*?)</pre>\s*</div>', re.S
)


class MarkdownRenderer:
    """One Markdown instance, reused (building one per render costs more than the render)."""

    def __init__(self) -> None:
        self._md = markdown.Markdown(
            extensions=["fenced_code", "codehilite", "tables", "sane_lists", "nl2br"],
            # nl2br: models write "line\nline" meaning two lines, as chat UIs show it.
            extension_configs={
                "codehilite": {
                    "noclasses": True,
                    "guess_lang": False,  # a wrong guess looks worse than no colour
                    "pygments_style": PYGMENTS_STYLE,
                }
            },
        )
        # Raw HTML in model output becomes visible text.
        self._md.preprocessors.deregister("html_block")
        self._md.inlinePatterns.deregister("html")

    def render(self, text: str, *, streaming: bool = False) -> str:
        """`streaming`: the text may stop mid-way, so close an open code fence (otherwise the
        block flickers between raw backticks and highlighted code as it grows)."""
        thinking, answer, thinking_open = split_thinking(text)
        parts: list[str] = []
        if thinking is not None:
            label = "Thinking…" if thinking_open and streaming else "Thought process"
            body = self._convert(thinking, streaming=streaming) if thinking.strip() else ""
            parts.append(
                '<table width="100%" cellspacing="0" cellpadding="8" style="margin-bottom: 8px;">'
                f'<tr><td style="color: #6b7280; border-left: 3px solid #d1d5db;">'
                f"<p><i>{label}</i></p>{body}</td></tr></table>"
            )
        if answer.strip():
            parts.append(self._convert(answer, streaming=streaming))
        return "".join(parts)

    def _convert(self, text: str, *, streaming: bool) -> str:
        source = _prepare(text, streaming=streaming)
        self._md.reset()
        out = self._md.convert(source)
        out = out.replace(
            "<table>",
            '<table border="1" cellspacing="0" cellpadding="6" style="border-collapse: collapse;'
            ' border-style: solid; border-color: #d0d7de; margin-top: 4px; margin-bottom: 10px;">',
        )
        return _CODEHILITE.sub(_code_block, out)


def _code_block(match: re.Match[str]) -> str:
    # QTextDocument paints a table cell's background reliably, a div's only per line; pre-wrap keeps
    # long lines inside the bubble instead of scrolling the whole chat sideways.
    code = match.group(1).replace("<code>", "").replace("</code>", "").rstrip("\n")
    return (
        f'<table width="100%" cellspacing="0" cellpadding="10" bgcolor="{CODE_BACKGROUND}"'
        f' style="border: 1px solid {CODE_BORDER}; margin-top: 4px; margin-bottom: 10px;">'
        f'<tr><td><pre class="code" style="white-space: pre-wrap;">{code}</pre></td></tr></table>'
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
