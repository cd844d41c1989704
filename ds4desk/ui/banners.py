"""The bars above the chat: start-up notices that stay until dismissed, and how to load a model
while none is loaded."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

NO_MODEL_TITLE = "No model is loaded."
NO_MODEL_HELP = (
    "Open one with File > Open model… (Ctrl+O): a .gguf file or a Hugging Face model folder. You can "
    "also drop one on this window, pick one in File > Open recent, or load the built-in SmolLM2."
)


def _row(bar: QWidget, *widgets: QWidget) -> None:
    """The first widget takes the width, the buttons follow it."""
    row = QHBoxLayout(bar)
    row.setContentsMargins(12, 8, 12, 8)
    row.addWidget(widgets[0], 1)
    for widget in widgets[1:]:
        row.addWidget(widget)


class NoticeBar(QWidget):
    """Problems found at start (a damaged history or settings file set aside): unlike the status
    line, which the next step overwrites, a notice stays until the user dismisses it. Several
    notices stack."""

    def __init__(self) -> None:
        super().__init__(objectName="NoticeBar")
        self.label = QLabel(objectName="NoticeLabel")
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.dismiss_button = QPushButton("Dismiss", objectName="NoticeDismiss")
        self.dismiss_button.setAccessibleName("Dismiss the notice")
        self.dismiss_button.clicked.connect(self.dismiss)
        _row(self, self.label, self.dismiss_button)
        self.notices: list[str] = []
        self.hide()

    def add(self, text: str) -> None:
        self.notices.append(text)
        self.label.setText("\n\n".join(self.notices))
        self.show()

    def dismiss(self) -> None:
        self.notices.clear()
        self.label.clear()
        self.hide()


class NoModelBar(QWidget):
    """Shown while no model is loaded and none is loading: how to get one, with the buttons."""

    def __init__(self, open_model: Callable[[], None], load_built_in: Callable[[], None]) -> None:
        super().__init__(objectName="NoModelBar")
        label = QLabel(f"<b>{NO_MODEL_TITLE}</b> {NO_MODEL_HELP}", objectName="NoModelLabel")
        label.setWordWrap(True)
        open_button = QPushButton("Open model…", objectName="NoModelOpen")
        open_button.setAccessibleName("Open a model")
        open_button.setToolTip("A .gguf file or a Hugging Face model folder (Ctrl+O)")
        open_button.clicked.connect(lambda: open_model())
        self.built_in_button = QPushButton("Load the built-in model", objectName="NoModelBuiltIn")
        self.built_in_button.setAccessibleName("Load the built-in model")
        self.built_in_button.setToolTip("SmolLM2-135M-Instruct, which ships with ds4desk")
        self.built_in_button.clicked.connect(lambda: load_built_in())
        _row(self, label, open_button, self.built_in_button)
        self.hide()
