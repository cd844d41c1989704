"""Where the user types: Enter sends, Shift+Enter starts a new line, the box grows with the text."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QWidget

PLACEHOLDER = "Message ds4desk…  (Enter to send, Shift+Enter for a new line)"


class Composer(QPlainTextEdit):
    submitted = Signal()

    def __init__(self, parent: QWidget | None = None, *, min_lines: int = 2, max_lines: int = 10) -> None:
        super().__init__(parent)
        self.setObjectName("Composer")
        self.setPlaceholderText(PLACEHOLDER)
        self.setTabChangesFocus(True)
        self._min_lines = min_lines
        self._max_lines = max_lines
        # Fires on edits and on re-wrapping after a resize.
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self._fit_height()

    def text(self) -> str:
        return self.toPlainText()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = event.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                # A real paragraph break: Qt's own Shift+Enter would insert U+2028 instead.
                self.textCursor().insertText("\n")
                event.accept()
                return
            if not mods & ~Qt.KeyboardModifier.KeypadModifier:
                event.accept()
                self.submitted.emit()
                return
        super().keyPressEvent(event)

    def _fit_height(self, *_: object) -> None:
        # QPlainTextEdit's document height is in lines, wrapped lines included.
        lines = int(self.document().size().height())
        lines = max(self._min_lines, min(self._max_lines, lines))
        margins = self.contentsMargins()
        doc_margin = self.document().documentMargin()
        height = lines * self.fontMetrics().lineSpacing() + 2 * doc_margin + margins.top() + margins.bottom()
        self.setFixedHeight(int(height) + 4)
