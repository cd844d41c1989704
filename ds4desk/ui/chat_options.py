"""The row above the composer: sampling preset, thinking on/off, and the system prompt.

They change `Settings` in place and emit `changed`; the window saves. Custom sampling values are
edited in the settings dialog (`custom_requested`), the row only shows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ds4desk.settings import Settings


@dataclass(slots=True, frozen=True)
class Preset:
    name: str
    temperature: float
    top_p: float

    def matches(self, settings: Settings) -> bool:
        if self.temperature == 0:
            return settings.temperature == 0  # greedy: top_p plays no part
        return abs(settings.temperature - self.temperature) < 1e-6 and abs(settings.top_p - self.top_p) < 1e-6


PRESETS = (
    Preset("Precise", 0.0, 1.0),
    Preset("Balanced", 0.7, 0.95),
    Preset("Creative", 1.0, 0.98),
)
CUSTOM = "Custom"
THINK_HELP = "Let the model reason first (shown folded above the answer)"
NO_THINK_HELP = "This model's chat format has no thinking mode"


def preset_of(settings: Settings) -> Preset | None:
    return next((p for p in PRESETS if p.matches(settings)), None)


class ChatOptions(QWidget):
    changed = Signal()
    custom_requested = Signal()

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ChatOptions")
        self.settings = settings
        self.prompt_dialog: SystemPromptDialog | None = None

        self.preset = QComboBox(objectName="PresetSelector")
        self.preset.setAccessibleName("Sampling preset")
        self.preset.setToolTip("Precise: greedy. Balanced: 0.7 / top-p 0.95. Creative: 1.0 / top-p 0.98")
        for preset in PRESETS:
            self.preset.addItem(preset.name, preset.name)
        self.preset.addItem(CUSTOM, CUSTOM)
        self.preset.activated.connect(self._on_preset)

        self.thinking = QCheckBox("Think", objectName="ThinkingToggle")
        self.thinking.setAccessibleName("Thinking mode")
        self.thinking.toggled.connect(self._on_thinking)
        # Whether the loaded model's chat format has a thinking mode; until one is known, Think is
        # offered (the setting is the user's wish, kept for the next model that has one).
        self.thinking_offered = True

        self.system_button = QPushButton("System prompt…", objectName="SystemPromptButton")
        self.system_button.setAccessibleName("Edit system prompt")
        self.system_button.clicked.connect(self.edit_system_prompt)
        for widget in (self.preset, self.thinking, self.system_button):
            widget.setFocusPolicy(Qt.FocusPolicy.TabFocus)  # clicks keep the focus in the composer

        row = QHBoxLayout(self)
        row.setContentsMargins(16, 0, 16, 0)
        row.setSpacing(8)
        row.addWidget(QLabel("Sampling:"))
        row.addWidget(self.preset)
        row.addWidget(self.thinking)
        row.addWidget(self.system_button)
        row.addStretch(1)
        self.sync()

    def sync(self) -> None:
        """Show what the settings say (after the settings dialog changed them, say)."""
        preset = preset_of(self.settings)
        custom_index = self.preset.count() - 1
        s = self.settings
        # "Custom (0.7 / top-p 0.95)" beside "Balanced" would show one setting twice: Custom shows
        # values only when they are no preset's, else it is the way to the settings dialog.
        custom = f"{CUSTOM} ({s.temperature:g} / top-p {s.top_p:g})" if preset is None else f"{CUSTOM}…"
        self.preset.setItemText(custom_index, custom)
        self.preset.setCurrentIndex(PRESETS.index(preset) if preset else custom_index)
        self.thinking.blockSignals(True)
        self.thinking.setChecked(s.thinking and self.thinking_offered)
        self.thinking.blockSignals(False)
        self.thinking.setEnabled(self.thinking_offered)
        self.thinking.setToolTip(THINK_HELP if self.thinking_offered else NO_THINK_HELP)
        prompt = s.system_prompt.strip()
        self.system_button.setText("System prompt ✓" if prompt else "System prompt…")
        self.system_button.setToolTip(prompt[:300] if prompt else "No system prompt")

    def offer_thinking(self, offered: bool) -> None:
        """Think only for a model whose chat format has a thinking mode: on any other the switch
        would change nothing, and the answer must not be shown as thinking."""
        self.thinking_offered = offered
        self.sync()

    def apply_preset(self, name: str) -> None:
        preset = next((p for p in PRESETS if p.name == name), None)
        if preset is None:
            self.custom_requested.emit()
            return
        self.settings.temperature, self.settings.top_p = preset.temperature, preset.top_p
        self.sync()
        self.changed.emit()

    def _on_preset(self, index: int) -> None:
        self.apply_preset(str(self.preset.itemData(index)))

    def _on_thinking(self, on: bool) -> None:
        self.settings.thinking = on
        self.sync()
        self.changed.emit()

    def edit_system_prompt(self) -> SystemPromptDialog:
        """Opens the editor (window-modal, not blocking); OK stores the prompt."""
        dialog = SystemPromptDialog(self.settings.system_prompt, self)
        dialog.accepted.connect(lambda: self._set_system_prompt(dialog.text()))
        dialog.finished.connect(dialog.deleteLater)
        self.prompt_dialog = dialog
        dialog.open()
        return dialog

    def _set_system_prompt(self, text: str) -> None:
        self.settings.system_prompt = text.strip()
        self.sync()
        self.changed.emit()


class SystemPromptDialog(QDialog):
    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("System prompt")
        self.setObjectName("SystemPromptDialog")
        self.resize(520, 320)
        self.editor = QPlainTextEdit(objectName="SystemPromptEditor")
        self.editor.setAccessibleName("System prompt")
        self.editor.setPlaceholderText("Instructions sent before every conversation, e.g. “Answer briefly.”")
        self.editor.setPlainText(text)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        for button in buttons.buttons():
            button.setAccessibleName(button.text().replace("&", ""))
        self.ok_button = buttons.button(QDialogButtonBox.StandardButton.Ok)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        column = QVBoxLayout(self)
        column.addWidget(QLabel("Sent as the first message of every conversation (empty: none)."))
        column.addWidget(self.editor, 1)
        column.addWidget(buttons)

    def text(self) -> str:
        return self.editor.toPlainText()
