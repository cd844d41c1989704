"""The style sheet: a disabled button's text must look disabled under both schemes."""

from __future__ import annotations

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QPushButton

from ds4desk.ui.theme import apply_theme


def _text_colour(qtbot, enabled: bool) -> QColor:
    """The colour of a button's label: the pixel that differs most from the same button without it."""
    with_text, without = QPushButton("Unpark"), QPushButton("")
    for button in (with_text, without):
        qtbot.addWidget(button)
        button.setEnabled(enabled)
        button.resize(120, 32)
    a, b = with_text.grab().toImage(), without.grab().toImage()
    best, colour = -1, QColor()
    for x in range(a.width()):
        for y in range(a.height()):
            here, there = a.pixelColor(x, y), b.pixelColor(x, y)
            gap = abs(here.lightness() - there.lightness())
            if gap > best:
                best, colour = gap, here
    return colour


def test_a_disabled_button_s_text_is_drawn_fainter(qtbot, qapp) -> None:
    try:
        for dark in (False, True):
            apply_theme(qapp, dark)
            enabled, disabled = _text_colour(qtbot, True), _text_colour(qtbot, False)
            assert abs(enabled.lightness() - disabled.lightness()) > 30, f"dark={dark}"
    finally:
        qapp.setStyleSheet("")
