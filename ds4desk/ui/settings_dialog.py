"""Settings (Ctrl+,): model loading, speculative decoding, snapshots, thinking, parking, sampling,
and serving the loaded model on localhost.

OK checks the values the way a settings file is checked (Settings.from_json), writes them into the
window's Settings and emits `accepted`; the window saves them. Nothing here touches the engine:
load options apply at the next model load, engine options when ds4desk starts next, and the
dialog says so. Serving starts or stops as soon as OK is pressed (the window does it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import DeviceChoice
from ds4desk.settings import DTYPES, Settings
from ds4desk.ui.device_choice import canonical, choices_with

GRAPHS = (("Auto (on for CUDA, off for ROCm)", "auto"), ("On", "on"), ("Off", "off"))
WEIGHTS = (("As stored", "as-stored"), ("8-bit (Q8_0)", "q8"), ("4-bit (Q4_K)", "q4"))
WEIGHTS_HELP = (
    "Quantizes a 16-bit model's weights while it loads (8-bit Q8_0 or 4-bit Q4_K), so it fits a smaller GPU"
)
CPU_PREFILL = (("Exact (float32)", "float32"), ("Fast (bfloat16)", "bfloat16"))
CPU_PREFILL_HELP = (
    "How the CPU multiplies a prompt with a GGUF model's weights: bfloat16 reads prompts about 1.4-2x "
    "faster on CPUs with AVX-512 BF16 (recent AMD and Intel server and desktop chips), and the answer's "
    "probabilities move by its rounding; on other CPUs the exact float32 products are kept"
)
SPECULATIVE = (
    ("Auto (the draft model if loaded, else prompt lookup)", "auto"),
    ("Off", "off"),
    ("Draft model (File > Load draft model…)", "draft"),
    ("Prompt lookup", "lookup"),
)
SPECULATIVE_HELP = (
    "Speculative decoding: a draft model or n-grams of the conversation propose tokens that the model "
    "checks in one step; the answer is the same, only faster when they agree"
)
SERVE_HELP = (
    "Other programs on this computer can use the loaded model through the OpenAI API at "
    "http://127.0.0.1:PORT/v1 (no API key needed)"
)
APPLY_NOTE = (
    "Device, data type, weights, context, chunk, CUDA graphs and CPU prompt math apply at the next model "
    "load (File > Open model, or the next start). Snapshot and park options apply when ds4desk starts next. "
    "Speculative decoding, thinking and sampling apply to the next answer; serving, at once."
)


def _spin(name: str, low: int, high: int, value: int, *, step: int = 1, suffix: str = "") -> QSpinBox:
    box = QSpinBox(objectName=name)
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setValue(min(max(value, low), high))
    box.setSuffix(suffix)
    return box


def _double(
    name: str, low: float, high: float, value: float, step: float, decimals: int = 2
) -> QDoubleSpinBox:
    box = QDoubleSpinBox(objectName=name)
    box.setDecimals(decimals)
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setValue(min(max(value, low), high))
    return box


class SettingsDialog(QDialog):
    def __init__(
        self,
        settings: Settings,
        parent: QWidget | None = None,
        *,
        devices: Sequence[DeviceChoice] | None = None,
        can_serve: bool = True,
        can_speculate: bool = True,
        serving_url: str | None = None,
    ) -> None:
        """`devices`: what the engine side lists (None: not known yet; set_devices fills them in).
        `can_serve`/`can_speculate`: False greys the option out (no local engine to serve, a remote
        model). `serving_url`: where the model is served now, shown under the option."""
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setObjectName("SettingsDialog")
        self.settings = settings
        s = settings

        # Only the devices this torch sees (the engine side lists them): a device typed in that
        # does not exist would break every later start.
        self.device = QComboBox(objectName="DeviceSetting")
        self.set_devices(devices)
        self.dtype = QComboBox(objectName="DtypeSetting")
        self.dtype.addItems(list(DTYPES))
        self.dtype.setCurrentText(s.dtype)
        self.context = _spin("ContextSetting", 128, 1_048_576, s.context, step=1024, suffix=" tokens")
        self.chunk = _spin("ChunkSetting", 0, 65_536, s.chunk, step=128, suffix=" tokens")
        self.chunk.setSpecialValueText("automatic")  # 0: 4096 on a GPU, 512 on the CPU
        self.cuda_graphs = QComboBox(objectName="CudaGraphsSetting")
        for label, value in GRAPHS:
            self.cuda_graphs.addItem(label, value)
        self.cuda_graphs.setCurrentIndex([v for _, v in GRAPHS].index(s.cuda_graphs))
        self.weights = QComboBox(objectName="WeightsSetting")
        for label, value in WEIGHTS:
            self.weights.addItem(label, value)
        self.weights.setCurrentIndex(max(0, self.weights.findData(s.weights)))
        self.cpu_prefill = QComboBox(objectName="CpuPrefillSetting")
        for label, value in CPU_PREFILL:
            self.cpu_prefill.addItem(label, value)
        self.cpu_prefill.setCurrentIndex(max(0, self.cpu_prefill.findData(s.cpu_prefill)))
        self.speculative = QComboBox(objectName="SpeculativeSetting")
        for label, value in SPECULATIVE:
            self.speculative.addItem(label, value)
        self.speculative.setCurrentIndex(max(0, self.speculative.findData(s.speculative)))
        self.speculative.setEnabled(can_speculate)

        self.serve = QCheckBox("Serve the loaded model on localhost", objectName="ServeSetting")
        self.serve.setChecked(s.serve_on_localhost)
        self.serve_port = _spin("ServePortSetting", 0, 65_535, s.serve_port)
        self.serve_port.setSpecialValueText("any free port")  # shown for 0
        self.serve_port.setEnabled(s.serve_on_localhost)
        self.serve.toggled.connect(self.serve_port.setEnabled)
        self.serve_status = QLabel(objectName="ServeStatus")
        self.serve_status.setWordWrap(True)
        if not can_serve:
            self.serve.setEnabled(False)
            self.serve_port.setEnabled(False)
            self.serve_status.setText("Not available: no local engine is running.")
        elif serving_url:
            self.serve_status.setText(f"Serving at {serving_url}")
        self.serve_status.setVisible(bool(self.serve_status.text()))

        self.snapshot_slots = _spin("SnapshotSlotsSetting", 1, 1024, s.snapshot_slots)
        self.snapshot_memory = _spin(
            "SnapshotMemorySetting", 1, 1_048_576, s.snapshot_memory_mb, step=256, suffix=" MiB"
        )
        self.thinking_budget = _spin(
            "ThinkingBudgetSetting", 0, 1_048_576, s.thinking_budget_tokens, step=256, suffix=" tokens"
        )
        self.thinking_budget.setSpecialValueText("No budget")  # shown for 0

        self.unpark_on_generate = QCheckBox(
            "A message to a parked model loads it back", objectName="UnparkSetting"
        )
        self.unpark_on_generate.setChecked(s.unpark_on_generate)
        self.park_cancels_running = QCheckBox(
            "Park stops an answer being written", objectName="ParkCancelsSetting"
        )
        self.park_cancels_running.setChecked(s.park_cancels_running)
        self.idle_park = _double("IdleParkSetting", 0.0, 10_000.0, s.idle_park_minutes, 5.0, decimals=1)
        self.idle_park.setSuffix(" min")
        self.idle_park.setSpecialValueText("Never")

        self.temperature = _double("TemperatureSetting", 0.0, 5.0, s.temperature, 0.05)
        self.top_p = _double("TopPSetting", 0.01, 1.0, s.top_p, 0.01)
        self.top_k = _spin("TopKSetting", 0, 100_000, s.top_k)
        self.top_k.setSpecialValueText("Off")
        self.max_new_tokens = _spin("MaxNewTokensSetting", 1, 1_048_576, s.max_new_tokens, step=256)

        model = QFormLayout()
        self._row(model, "Device", self.device, "Where the model runs: auto is the first GPU, else the CPU")
        self._row(model, "Data type", self.dtype, "auto: float32 on the CPU, bfloat16 on a GPU")
        self._row(model, "Weights", self.weights, WEIGHTS_HELP)
        self._row(model, "Context", self.context, "The longest conversation the model keeps, in tokens")
        self._row(model, "Prefill chunk", self.chunk, "Prompt tokens computed per step")
        self._row(model, "CUDA graphs", self.cuda_graphs, "Replay decode steps from a captured graph")
        self._row(model, "CPU prompt math", self.cpu_prefill, CPU_PREFILL_HELP)
        self._row(model, "Speculative decoding", self.speculative, SPECULATIVE_HELP)
        self._model_form = model
        self._show_gpu_options(devices)
        memory = QFormLayout()
        self._row(memory, "Snapshot slots", self.snapshot_slots, "Saved conversation states to continue from")
        self._row(memory, "Snapshot memory", self.snapshot_memory, "Host memory the snapshots may use")
        self._row(memory, "Thinking budget", self.thinking_budget, "At most this many thinking tokens")
        self._row(memory, "", self.unpark_on_generate, "Else the answer fails with “model parked”")
        self._row(memory, "", self.park_cancels_running, "Else Park waits for the answer to finish")
        self._row(memory, "Park when idle after", self.idle_park, "Free the GPU when unused for this long")
        sampling = QFormLayout()
        self._row(sampling, "Temperature", self.temperature, "0: always the most likely token")
        self._row(sampling, "Top-p", self.top_p, "Sample from the smallest set with this probability")
        self._row(sampling, "Top-k", self.top_k, "Sample from the k most likely tokens (Off: all)")
        self._row(sampling, "Max new tokens", self.max_new_tokens, "The longest answer, in tokens")
        serving = QFormLayout()
        self._row(serving, "", self.serve, SERVE_HELP)
        self._row(serving, "Port", self.serve_port, "The port on 127.0.0.1 (a taken port is reported)")
        serving.addRow(self.serve_status)

        self.note = QLabel(APPLY_NOTE, objectName="SettingsNote")
        self.note.setWordWrap(True)
        self.error_label = QLabel(objectName="SettingsError")
        self.error_label.setStyleSheet("color: #b91c1c;")
        self.error_label.hide()
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        for button in buttons.buttons():
            button.setAccessibleName(button.text().replace("&", ""))
        self.ok_button = buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.cancel_button = buttons.button(QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)

        column = QVBoxLayout(self)
        for title, form in (
            ("Model", model),
            ("Memory, thinking and parking", memory),
            ("Sampling", sampling),
            ("Local server", serving),
        ):
            group = QGroupBox(title)
            group.setLayout(form)
            column.addWidget(group)
        column.addWidget(self.note)
        column.addWidget(self.error_label)
        column.addWidget(buttons)

    def _show_gpu_options(self, devices: Sequence[DeviceChoice] | None) -> None:
        """CUDA graphs mean nothing on a machine without a GPU: hidden once the list says so."""
        if not hasattr(self, "_model_form"):
            return  # set_devices during construction: the form comes later
        no_gpu = devices is not None and not any(d.name.startswith("cuda") for d in devices)
        self._model_form.setRowVisible(self.cuda_graphs, not no_gpu)

    def set_devices(self, devices: Sequence[DeviceChoice] | None) -> None:
        """List `devices` in Settings > Device, keeping the choice shown (the saved one at first)."""
        self._show_gpu_options(devices)
        shown = self.device.currentData() if self.device.count() else self.settings.device
        self.device.clear()
        for choice in choices_with(self.settings.device, devices):
            self.device.addItem(choice.label, choice.name)
        index = self.device.findData(shown)
        if index < 0:
            index = next(
                (
                    i
                    for i in range(self.device.count())
                    if canonical(self.device.itemData(i)) == canonical(shown)
                ),
                0,
            )
        self.device.setCurrentIndex(index)

    def _row(self, form: QFormLayout, label: str, widget: QWidget, help_text: str) -> None:
        widget.setAccessibleName(label or widget.property("text") or widget.objectName())
        widget.setToolTip(help_text)
        widget.setAccessibleDescription(help_text)
        if label:
            form.addRow(label, widget)
        else:
            form.addRow(widget)

    def values(self) -> dict[str, Any]:
        return {
            "device": str(self.device.currentData()),
            "dtype": self.dtype.currentText(),
            "weights": self.weights.currentData(),
            "cpu_prefill": self.cpu_prefill.currentData(),
            "context": self.context.value(),
            "chunk": self.chunk.value(),
            "cuda_graphs": self.cuda_graphs.currentData(),
            "speculative": self.speculative.currentData(),
            "snapshot_slots": self.snapshot_slots.value(),
            "snapshot_memory_mb": self.snapshot_memory.value(),
            "thinking_budget_tokens": self.thinking_budget.value(),
            "unpark_on_generate": self.unpark_on_generate.isChecked(),
            "park_cancels_running": self.park_cancels_running.isChecked(),
            "idle_park_minutes": self.idle_park.value(),
            "temperature": self.temperature.value(),
            "top_p": self.top_p.value(),
            "top_k": self.top_k.value(),
            "max_new_tokens": self.max_new_tokens.value(),
            "serve_on_localhost": self.serve.isChecked(),
            "serve_port": self.serve_port.value(),
        }

    def accept(self) -> None:
        """Refuses (and says why) when a value would not survive a save and load."""
        values = self.values()
        checked = Settings.from_json(values)
        bad = [name for name, value in values.items() if getattr(checked, name) != value]
        if values["chunk"] > values["context"]:  # 0 (automatic) always passes
            bad.append("chunk (larger than the context)")
        if bad:
            self.error_label.setText("Not valid: " + ", ".join(bad))
            self.error_label.show()
            return
        for name, value in values.items():
            setattr(self.settings, name, value)
        super().accept()
