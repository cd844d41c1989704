"""Helpers for the chat feature tests: type into the composer, click a link in the conversation."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QTextBrowser


def type_and_enter(qtbot: Any, window: Any, text: str) -> None:
    for index, line in enumerate(text.split("\n")):
        if index:
            qtbot.keyClick(window.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
        qtbot.keyClicks(window.composer, line)
    qtbot.keyClick(window.composer, Qt.Key.Key_Return)


def link_hrefs(view: QTextBrowser) -> list[str]:
    """Every link in the document, in order."""
    hrefs: list[str] = []
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            href = fragment.charFormat().anchorHref() if fragment.isValid() else ""
            if href and (not hrefs or hrefs[-1] != href):
                hrefs.append(href)
            it += 1
        block = block.next()
    return hrefs


def _link_point(view: QTextBrowser, href: str) -> QPoint:
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.isValid() and fragment.charFormat().anchorHref() == href:
                start = QTextCursor(view.document())
                start.setPosition(fragment.position())
                end = QTextCursor(view.document())
                end.setPosition(fragment.position() + fragment.length())
                view.setTextCursor(end)
                view.ensureCursorVisible()
                left, right = view.cursorRect(start), view.cursorRect(end)
                return QPoint((left.left() + right.left()) // 2, left.center().y())
            it += 1
        block = block.next()
    raise AssertionError(f"no link {href!r} in the chat; links: {link_hrefs(view)}")


def click_link(qtbot: Any, view: QTextBrowser, href: str) -> None:
    """A real mouse click on the link's text (QTextBrowser emits anchorClicked on release)."""
    point = _link_point(view, href)
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=point)
