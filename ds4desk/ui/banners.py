"""The bars above the chat: notices that stay until dismissed (start-up problems, a device that
failed, a model that could not be loaded), and how to load a model while none is loaded. Also the
status line's label, which elides a long message instead of cutting it."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QEvent, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen, QResizeEvent
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

NO_MODEL_TITLE = "No model is loaded."
NO_MODEL_HELP = (
    "Open one with File > Open model… (Ctrl+O): a .gguf file or a Hugging Face model folder. You can "
    "also drop one on this window, pick one with Choose model… (Ctrl+L), or load the built-in SmolLM2."
)
# Notice keys: a newer notice of the same kind replaces the older one instead of stacking.
LOAD_FAILED, DEVICE_FALLBACK = "load-failed", "device-fallback"


# Translucent tints: they read on the light and the dark theme alike.
NOTICE_TINT = QColor(245, 158, 11)  # amber: something went wrong, the window coped
HELP_TINT = QColor(37, 99, 235)  # blue: what to do next


def _paint_tint(widget: QWidget, tint: QColor) -> None:
    painter = QPainter(widget)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    fill, edge = QColor(tint), QColor(tint)
    fill.setAlpha(38)
    edge.setAlpha(140)
    painter.setPen(QPen(edge, 1))
    painter.setBrush(fill)
    # Inset from the pane's edges, as the chat's own frames are.
    painter.drawRoundedRect(QRectF(widget.rect()).adjusted(8.5, 6.5, -8.5, -0.5), 8, 8)


def _row(bar: QWidget, *widgets: QWidget) -> None:
    """The first widget takes the width, the buttons follow it."""
    row = QHBoxLayout(bar)
    row.setContentsMargins(20, 14, 20, 8)
    row.addWidget(widgets[0], 1)
    for widget in widgets[1:]:
        row.addWidget(widget)


class NoticeBar(QWidget):
    """Problems the user must see (a damaged history or settings file set aside, a device that
    failed, a model that could not be loaded): unlike the status line, which the next step
    overwrites, a notice stays until the user dismisses it. Several notices stack; one with a key
    replaces the earlier one with that key. Never inside the conversation: a failed load is not
    part of any chat."""

    def __init__(self) -> None:
        super().__init__(objectName="NoticeBar")
        self.label = QLabel(objectName="NoticeLabel")
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.dismiss_button = QPushButton("Dismiss", objectName="NoticeDismiss")
        self.dismiss_button.setAccessibleName("Dismiss the notice")
        self.dismiss_button.clicked.connect(self.dismiss)
        _row(self, self.label, self.dismiss_button)
        self._notices: list[tuple[str | None, str]] = []  # (key, text), oldest first
        self.hide()

    @property
    def notices(self) -> list[str]:
        return [text for _key, text in self._notices]

    def add(self, text: str, key: str | None = None) -> None:
        if key is not None:
            self._notices = [(k, t) for k, t in self._notices if k != key]
        self._notices.append((key, text))
        self._show_notices()

    def remove(self, key: str) -> None:
        """The problem `key` named is over (the next load worked): its notice goes."""
        self._notices = [(k, t) for k, t in self._notices if k != key]
        self._show_notices()

    def dismiss(self) -> None:
        self._notices.clear()
        self._show_notices()

    def _show_notices(self) -> None:
        self.label.setText("\n\n".join(self.notices))
        self.setVisible(bool(self._notices))

    def paintEvent(self, event: QPaintEvent) -> None:
        _paint_tint(self, NOTICE_TINT)


class NoModelBar(QWidget):
    """Shown while no model is loaded and none is loading: how to get one, with the buttons."""

    def __init__(
        self,
        open_model: Callable[[], None],
        load_built_in: Callable[[], None],
        choose_model: Callable[[], None] | None = None,
    ) -> None:
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
        buttons: list[QWidget] = [open_button]
        self.choose_button: QPushButton | None = None
        if choose_model is not None:
            self.choose_button = QPushButton("Choose model…", objectName="NoModelChoose")
            self.choose_button.setAccessibleName("Choose a model")
            self.choose_button.setToolTip(
                "The built-in, recent and models-folder models, with their sizes (Ctrl+L)"
            )
            self.choose_button.clicked.connect(lambda: choose_model())
            buttons.append(self.choose_button)
        buttons.append(self.built_in_button)
        # The text on its own line above the buttons: beside three buttons it would be squeezed
        # into a narrow column and cut.
        column = QVBoxLayout(self)
        column.setContentsMargins(20, 14, 20, 8)
        column.addWidget(label)
        row = QHBoxLayout()
        for button in buttons:
            row.addWidget(button)
        row.addStretch(1)
        column.addLayout(row)
        self.hide()

    def paintEvent(self, event: QPaintEvent) -> None:
        _paint_tint(self, HELP_TINT)


class ElidedLabel(QLabel):
    """One line that ends in "…" when it is longer than the room it has; the whole text is in the
    tooltip. A plain QLabel would ask for the whole text's width, pushing the status bar's other
    parts out, and then be cut with no sign that anything is missing."""

    def __init__(self, text: str = "", objectName: str = "") -> None:
        super().__init__(objectName=objectName)
        self._full = ""
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setText(text)

    def text(self) -> str:  # type: ignore[override]
        return self._full

    def setText(self, text: str) -> None:  # type: ignore[override]
        self._full = text
        self.setToolTip(text)
        self._elide()

    def shown_text(self) -> str:
        """What is drawn: the text, or its start and "…"."""
        return super().text()

    def minimumSizeHint(self) -> QSize:
        return QSize(self.fontMetrics().horizontalAdvance("…") * 4, super().minimumSizeHint().height())

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._elide()  # an error line is drawn bold: wider than the text was elided for

    def _elide(self) -> None:
        width = self.contentsRect().width()
        line = " ".join(self._full.split("\n"))
        shown = (
            self.fontMetrics().elidedText(line, Qt.TextElideMode.ElideRight, max(width, 0))
            if width > 0
            else line
        )
        super().setText(shown)
