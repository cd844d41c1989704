"""The application look: the style sheet shipped in ds4desk/assets, in light or dark colours
following the system (QStyleHints.colorScheme, Qt 6.5+), and a readable base font.

The sheet names colours as `@token`s; each scheme maps the tokens to colours. `ThemeWatcher`
re-applies the sheet when the system switches and tells the window, which re-renders the chat
(a QTextDocument's colours are fixed when its HTML is built).
"""

from __future__ import annotations

import re
from importlib import resources

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QApplication

STYLE_SHEET = "style.qss"

LIGHT_COLORS: dict[str, str] = {
    "window": "#ffffff",
    "text": "#1f2937",
    "strong_text": "#111827",
    "muted_text": "#4b5563",
    "faint_text": "#9ca3af",
    "bar": "#f8f9fb",
    "sidebar": "#f3f4f6",
    "line": "#e5e7eb",
    "control_border": "#d1d5db",
    "control_border_hover": "#9ca3af",
    "control": "#ffffff",
    "control_hover": "#f9fafb",
    "hover": "#e5e7eb",
    "selected": "#dbe4f5",
    "selection": "#bfdbfe",
    "accent": "#2563eb",
    "accent_hover": "#1d4ed8",
    "accent_disabled": "#93c5fd",
    "accent_text": "#ffffff",
    "focus": "#3b82f6",
    "danger": "#b91c1c",
    "danger_border": "#fca5a5",
    "danger_hover": "#fef2f2",
    "editing": "#f59e0b",
    "scroll": "#d1d5db",
}

DARK_COLORS: dict[str, str] = {
    "window": "#18191c",
    "text": "#e5e7eb",
    "strong_text": "#f9fafb",
    "muted_text": "#9ca3af",
    "faint_text": "#6b7280",
    "bar": "#1f2024",
    "sidebar": "#202226",
    "line": "#30333a",
    "control_border": "#3f434b",
    "control_border_hover": "#6b7280",
    "control": "#25272c",
    "control_hover": "#2c2f35",
    "hover": "#2c2f35",
    "selected": "#27364f",
    "selection": "#1e40af",
    "accent": "#3b82f6",
    "accent_hover": "#2563eb",
    "accent_disabled": "#1e3a8a",
    "accent_text": "#ffffff",
    "focus": "#60a5fa",
    "danger": "#f87171",
    "danger_border": "#7f1d1d",
    "danger_hover": "#3b1d1d",
    "editing": "#f59e0b",
    "scroll": "#3f434b",
}

_TOKEN = re.compile(r"@([a-z_]+)")


def style_sheet(dark: bool = False) -> str:
    """Empty when the asset is missing (a broken install looks plain rather than not starting)."""
    try:
        template = (resources.files("ds4desk") / "assets" / STYLE_SHEET).read_text(encoding="utf-8")
    except OSError:
        return ""
    colors = DARK_COLORS if dark else LIGHT_COLORS
    # An unknown token stays as written: Qt ignores that one rule, the rest of the sheet still works.
    return _TOKEN.sub(lambda m: colors.get(m.group(1), m.group(0)), template)


def system_is_dark(app: QApplication) -> bool:
    return app.styleHints().colorScheme() == Qt.ColorScheme.Dark


def apply_theme(app: QApplication, dark: bool | None = None) -> bool:
    """`dark`: None follows the system. Returns whether the dark scheme was applied."""
    app.setStyle("Fusion")  # the same widgets on every platform, so the style sheet fits everywhere
    font = app.font()
    if font.pointSizeF() < 10.5:
        font.setPointSizeF(10.5)
        app.setFont(font)
    dark = system_is_dark(app) if dark is None else dark
    app.setStyleSheet(style_sheet(dark))
    app.setProperty("ds4desk_dark", dark)
    return dark


class ThemeWatcher(QObject):
    """Follows the system's light/dark setting while the app runs."""

    changed = Signal(bool)  # dark

    def __init__(self, app: QApplication, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._app = app
        self.dark = system_is_dark(app)
        app.styleHints().colorSchemeChanged.connect(self.apply)

    def apply(self, scheme: Qt.ColorScheme) -> None:
        dark = scheme == Qt.ColorScheme.Dark
        apply_theme(self._app, dark)
        if dark != self.dark:
            self.dark = dark
            self.changed.emit(dark)
