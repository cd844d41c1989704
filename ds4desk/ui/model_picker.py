"""The model picker (File > Choose model…): how a user switches models, and gets back to the
built-in one.

It lists the built-in SmolLM2, the recent models (however they were opened: File > Open, a drop,
the command line, this picker) and what a models folder the user chose holds. Each row shows the
model's family, its size on disk, its weight types and whether it fits on the device a load would
use. The facts come from the engine's preflight (`ChatBackend.preview`, headers only, on a worker
thread) and the folder walk runs on a worker thread too (`model_scan`), so the window never waits on
a slow disk. Choosing a row opens it the same way File > Open does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import shiboken6
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ds4desk.engine.api import LoadRequest, ModelPreview
from ds4desk.settings import BUILT_IN_LABEL, BUILT_IN_MODEL, Settings
from ds4desk.ui.backend import ChatBackend
from ds4desk.ui.model_scan import ScanResult, model_size, scan_models_folder
from ds4desk.ui.stats_format import format_bytes

log = logging.getLogger(__name__)

BUILT_IN, RECENT, FOLDER = "Built-in", "Recent", "Models folder"
COLUMNS = ("Model", "From", "Family", "Size", "Weights", "Fits")
NAME, SOURCE, FAMILY, SIZE, TYPES, FITS = range(len(COLUMNS))
PATH_ROLE = Qt.ItemDataRole.UserRole
MAX_PREVIEWS = 200  # header reads per refresh; a folder of thousands of files is not read whole
NO_FOLDER = "No models folder chosen: choose the folder where you keep .gguf files and model folders."


@dataclass(slots=True)
class PickerRow:
    path: str  # BUILT_IN_MODEL for the model that ships with ds4desk
    name: str
    source: str  # BUILT_IN | RECENT | FOLDER
    size_bytes: int | None = None  # None: not known yet
    preview: ModelPreview | None = None
    missing: bool = False  # a recent model whose file or folder is gone


@dataclass(slots=True, frozen=True)
class PickerHooks:
    """What the picker asks of the window."""

    open_model: Callable[[str], object]  # the same path as File > Open (preflight, then load)
    load_request: Callable[[str], LoadRequest]  # what loading a path would ask for (device included)
    current_path: Callable[[], str | None]  # the loaded model's path (BUILT_IN_MODEL for the built-in)
    save_settings: Callable[[], None]


def weight_types(preview: ModelPreview) -> str:
    """ "Q4_K, Q6_K" from the stored types, largest share first."""
    return ", ".join(name for name, _bytes in preview.stored_types)


def fits_text(preview: ModelPreview | None, missing: bool = False) -> str:
    if missing:
        return "missing"
    if preview is None:
        return "…"
    if preview.error is not None:
        return "not a model"
    return "yes" if preview.fits else "no"


class ModelPicker(QDialog):
    def __init__(
        self,
        settings: Settings,
        backend: ChatBackend,
        hooks: PickerHooks,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Choose a model")
        self.setObjectName("ModelPicker")
        self.resize(900, 460)
        self.settings = settings
        self._backend = backend
        self._hooks = hooks
        self.rows: list[PickerRow] = []
        self.scan: ScanResult | None = None
        self.task: asyncio.Task[None] | None = None  # the folder walk and header reads

        self.folder_label = QLabel(objectName="ModelsFolderLabel")
        self.folder_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.folder_label.setWordWrap(True)
        self.folder_button = QPushButton("Choose folder…", objectName="ModelsFolderButton")
        self.folder_button.setAccessibleName("Choose the models folder")
        self.folder_button.setToolTip("The folder where you keep .gguf files and Hugging Face model folders")
        self.folder_button.clicked.connect(self.choose_folder)
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.folder_label, 1)
        folder_row.addWidget(self.folder_button)

        self.table = QTreeWidget(objectName="ModelTable")
        self.table.setAccessibleName("Models")
        self.table.setColumnCount(len(COLUMNS))
        self.table.setHeaderLabels(list(COLUMNS))
        self.table.setRootIsDecorated(False)
        self.table.setUniformRowHeights(True)
        self.table.setAllColumnsShowFocus(True)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        header = self.table.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(NAME, QHeaderView.ResizeMode.Stretch)
        for column in (SOURCE, FAMILY, SIZE, TYPES, FITS):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemActivated.connect(lambda item, _column: self.open_item(item))
        self.table.currentItemChanged.connect(lambda *_: self._update_buttons())

        self.status_label = QLabel(objectName="ModelPickerStatus")
        self.status_label.setWordWrap(True)
        buttons = QDialogButtonBox()
        self.load_button = buttons.addButton("Load", QDialogButtonBox.ButtonRole.AcceptRole)
        self.load_button.setObjectName("ModelPickerLoad")
        self.load_button.setAccessibleName("Load the chosen model")
        self.close_button = buttons.addButton(QDialogButtonBox.StandardButton.Close)
        self.load_button.clicked.connect(self.open_selected)
        self.close_button.clicked.connect(self.reject)

        column = QVBoxLayout(self)
        column.addLayout(folder_row)
        column.addWidget(self.table, 1)
        column.addWidget(self.status_label)
        column.addWidget(buttons)
        self.finished.connect(lambda _code: self.stop())
        self.refresh()

    # ---- the rows -----------------------------------------------------------------------------

    def refresh(self) -> None:
        """The built-in and recent models at once; the folder's and every row's facts as they come."""
        self.stop()
        folder = self.settings.models_folder
        self.folder_label.setText(f"Models folder: {folder}" if folder else NO_FOLDER)
        self.rows = [PickerRow(BUILT_IN_MODEL, BUILT_IN_LABEL, BUILT_IN)]
        self.rows += [PickerRow(p, Path(p).name or p, RECENT) for p in self.settings.recent_models]
        self._show_rows()
        self.status_label.setText(f"Looking in {folder}…" if folder else "Reading the models' headers…")
        self.task = asyncio.ensure_future(self._fill(folder))

    def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def _fill(self, folder: str | None) -> None:
        loop = asyncio.get_running_loop()
        recent = [row for row in self.rows if row.source == RECENT]
        found = await loop.run_in_executor(
            None, lambda: [(Path(row.path).exists(), model_size(row.path)) for row in recent]
        )
        for row, (exists, size) in zip(recent, found, strict=True):
            row.size_bytes, row.missing = size, not exists
        self.scan = None
        if folder:
            self.scan = await loop.run_in_executor(None, scan_models_folder, folder)
            listed = {row.path for row in self.rows}
            self.rows += [
                PickerRow(found.path, found.name, FOLDER, found.size_bytes)
                for found in self.scan.models
                if found.path not in listed
            ]
        if not self._alive():
            return
        self._show_rows()
        self.status_label.setText(self._summary("Reading the models' headers…"))
        for index, row in enumerate(self.rows[:MAX_PREVIEWS]):
            try:
                row.preview = preview = await self._backend.preview(self._hooks.load_request(row.path))
                if row.size_bytes is None and preview.ok and preview.path:  # the built-in: its file
                    row.size_bytes = await loop.run_in_executor(None, model_size, preview.path)
            except Exception as exc:  # the backend promises not to raise; one row must not stop the rest
                log.warning("preview of %s raised: %s", row.path, exc)
                continue
            if not self._alive():
                return
            if preview.device:
                self.table.headerItem().setText(FITS, f"Fits on {preview.device}")
            self._fill_item(self.table.topLevelItem(index), row)
        self.status_label.setText(self._summary(""))

    def _alive(self) -> bool:
        return shiboken6.isValid(self) and self.isVisible()

    def _summary(self, doing: str) -> str:
        scan = self.scan
        parts = [doing] if doing else []
        if scan is not None:
            if scan.error:
                parts.append(f"The models folder could not be read: {scan.error}.")
            else:
                found = len(scan.models)
                parts.append(f"{found} model{'s' * (found != 1)} in the models folder.")
                if scan.truncated:
                    parts.append("The folder is large: only part of it was searched.")
        if len(self.rows) > MAX_PREVIEWS:
            parts.append(f"Details are shown for the first {MAX_PREVIEWS} models.")
        parts.append("Double-click a model, or select it and press Load, to load it.")
        return " ".join(parts)

    def _show_rows(self) -> None:
        chosen = self.selected_path()
        current = self._hooks.current_path()
        self.table.clear()
        for row in self.rows:
            item = QTreeWidgetItem()
            item.setData(NAME, PATH_ROLE, row.path)
            self._fill_item(item, row, current=current)
            self.table.addTopLevelItem(item)
            if row.path == (chosen or current):
                self.table.setCurrentItem(item)
        self._update_buttons()

    def _fill_item(self, item: QTreeWidgetItem | None, row: PickerRow, *, current: str | None = None) -> None:
        if item is None:
            return
        current = current if current is not None else self._hooks.current_path()
        loaded = row.path == current
        item.setText(NAME, row.name + ("  (loaded)" if loaded else ""))
        item.setToolTip(
            NAME, "The small model that ships with ds4desk" if row.path == BUILT_IN_MODEL else row.path
        )
        if loaded:
            font = QFont(item.font(NAME))
            font.setBold(True)
            item.setFont(NAME, font)
        item.setText(SOURCE, row.source)
        preview = row.preview
        size = row.size_bytes
        if size is None and preview is not None and preview.stored_types:
            size = sum(count for _name, count in preview.stored_types)
        item.setText(SIZE, format_bytes(size) if size else "")
        item.setToolTip(SIZE, "On disk" if size else "")
        item.setTextAlignment(SIZE, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        item.setText(FITS, fits_text(preview, row.missing))
        if preview is None:
            return
        item.setText(FAMILY, preview.family or preview.architecture)
        item.setText(TYPES, weight_types(preview))
        where = f" on {preview.device}" if preview.device else ""
        item.setToolTip(FITS, (preview.message or "") + ("" if preview.error else where))
        item.setToolTip(FAMILY, preview.architecture)

    # ---- choosing -------------------------------------------------------------------------------

    def selected_path(self) -> str | None:
        item = self.table.currentItem() if self.table.topLevelItemCount() else None
        return str(item.data(NAME, PATH_ROLE)) if item is not None else None

    def paths(self) -> list[str]:
        """The rows' paths, in order (BUILT_IN_MODEL first)."""
        return [row.path for row in self.rows]

    def row_texts(self, path: str) -> list[str]:
        """What the row of `path` shows, column by column (tests and accessibility checks)."""
        index = self.paths().index(path)
        item = self.table.topLevelItem(index)
        return [item.text(column) for column in range(len(COLUMNS))]

    def _update_buttons(self) -> None:
        self.load_button.setEnabled(self.selected_path() is not None)

    def select_path(self, path: str) -> bool:
        for index in range(self.table.topLevelItemCount()):
            item = self.table.topLevelItem(index)
            if item.data(NAME, PATH_ROLE) == path:
                self.table.setCurrentItem(item)
                return True
        return False

    def open_selected(self) -> None:
        path = self.selected_path()
        if path is not None:
            self.open_path(path)

    def open_item(self, item: QTreeWidgetItem) -> None:
        self.open_path(str(item.data(NAME, PATH_ROLE)))

    def open_path(self, path: str) -> None:
        """Load `path` as File > Open would; the picker closes."""
        self.accept()
        self._hooks.open_model(path)

    def choose_folder(self) -> None:
        start = self.settings.models_folder or str(Path.home())
        folder = QFileDialog.getExistingDirectory(self, "Choose the models folder", start)
        if folder:
            self.set_models_folder(folder)

    def set_models_folder(self, folder: str) -> None:
        self.settings.models_folder = folder
        self._hooks.save_settings()
        self.refresh()
