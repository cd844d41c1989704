"""The application look: the style sheet shipped in ds4desk/assets and a readable base font."""

from __future__ import annotations

from importlib import resources

from PySide6.QtWidgets import QApplication

STYLE_SHEET = "style.qss"


def style_sheet() -> str:
    """Empty when the asset is missing (a broken install looks plain rather than not starting)."""
    try:
        return (resources.files("ds4desk") / "assets" / STYLE_SHEET).read_text(encoding="utf-8")
    except OSError:
        return ""


def apply_theme(app: QApplication) -> None:
    app.setStyle("Fusion")  # the same widgets on every platform, so the style sheet fits everywhere
    font = app.font()
    if font.pointSizeF() < 10.5:
        font.setPointSizeF(10.5)
        app.setFont(font)
    app.setStyleSheet(style_sheet())
