"""Where the user types: Enter (or Ctrl+Enter) sends, Shift+Enter starts a new line, the box grows
with the text. In edit mode it holds a sent message's text; sending it makes a new branch."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent, QResizeEvent
from PySide6.QtWidgets import QPlainTextEdit, QWidget

PLACEHOLDER = "Message ds4desk…  (Enter sends, Shift+Enter: new line)"
EDIT_PLACEHOLDER = "Edit the message…  (Enter sends it as a new branch, Esc cancels)"


class Composer(QPlainTextEdit):
    submitted = Signal()
    editing_changed = Signal(bool)

    def __init__(self, parent: QWidget | None = None, *, min_lines: int = 2, max_lines: int = 10) -> None:
        super().__init__(parent)
        self.setObjectName("Composer")
        self.setPlaceholderText(PLACEHOLDER)
        self.setAccessibleName("Message")
        self.setAccessibleDescription("Enter sends, Shift+Enter starts a new line")
        self.setTabChangesFocus(True)
        self.editing: int | None = None  # the history message being edited
        self._min_lines = min_lines
        self._max_lines = max_lines
        # Fires on edits and on re-wrapping after a resize.
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self._fit_height()

    def text(self) -> str:
        return self.toPlainText()

    def start_edit(self, message_id: int, text: str) -> None:
        self.editing = message_id
        self.setPlainText(text)
        self.moveCursor(self.textCursor().MoveOperation.End)
        self._set_edit_look(True)
        self.setFocus()

    def cancel_edit(self) -> None:
        """Leaves edit mode; the text goes (it was the old message's, not something typed)."""
        if self.editing is None:
            return
        self.editing = None
        self.clear()
        self._set_edit_look(False)

    def finish_edit(self) -> int | None:
        """Leaves edit mode after sending; returns the message that was edited."""
        edited, self.editing = self.editing, None
        if edited is not None:
            self._set_edit_look(False)
        return edited

    def _set_edit_look(self, editing: bool) -> None:
        self.setPlaceholderText(EDIT_PLACEHOLDER if editing else PLACEHOLDER)
        self.setProperty("editing", editing)
        self.style().unpolish(self)  # a dynamic property only restyles after a re-polish
        self.style().polish(self)
        self.editing_changed.emit(editing)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = event.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                # A real paragraph break: Qt's own Shift+Enter would insert U+2028 instead.
                self.textCursor().insertText("\n")
                event.accept()
                return
            if not mods & ~(Qt.KeyboardModifier.KeypadModifier | Qt.KeyboardModifier.ControlModifier):
                event.accept()
                self.submitted.emit()
                return
        super().keyPressEvent(event)

    def _fit_height(self, *_: object) -> None:
        # QPlainTextEdit's document height is in lines, wrapped lines included.
        lines = int(self.document().size().height())
        if not self.toPlainText():
            lines = max(lines, self._placeholder_lines())  # the hint is read whole, never cut
        lines = max(self._min_lines, min(self._max_lines, lines))
        doc_margin = self.document().documentMargin()
        # Frame, border and the style sheet's padding: what the box is taller than its viewport.
        chrome = max(self.height() - self.viewport().height(), self.frameWidth() * 2)
        height = lines * self.fontMetrics().lineSpacing() + 2 * doc_margin + chrome
        if int(height) + 2 != self.height():
            self.setFixedHeight(int(height) + 2)

    def _placeholder_lines(self) -> int:
        width = int(self.viewport().width() - 2 * self.document().documentMargin())
        if width <= 0:
            return 1
        rect = self.fontMetrics().boundingRect(
            0, 0, width, 10_000, Qt.TextFlag.TextWordWrap, self.placeholderText()
        )
        return max(1, round(rect.height() / self.fontMetrics().lineSpacing()))

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        if not self.toPlainText():
            self._fit_height()  # a narrower box may wrap the hint onto another line
