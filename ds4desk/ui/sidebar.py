"""The chat list: search, rename in place, delete with undo.

A deleted chat is only hidden (History.hide_chat) while the undo bar shows; it is purged when the
undo window ends, when another chat is deleted, or when the history closes. The list is filtered
live as the search box changes, over titles and message text (History.search_chats).
"""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ds4desk.history import Chat, History

UNTITLED = "New chat"
CHAT_ID = Qt.ItemDataRole.UserRole
UNDO_MS = 10_000


class Sidebar(QWidget):
    chat_selected = Signal(int)
    new_chat_requested = Signal()
    delete_requested = Signal(int)  # the window decides (a chat being answered is not deleted)
    chat_renamed = Signal(int)
    chat_restored = Signal(int)

    def __init__(self, history: History, parent: QWidget | None = None, *, undo_ms: int = UNDO_MS) -> None:
        super().__init__(parent)
        self.setObjectName("Sidebar")
        self.history = history
        self.current_id: int | None = None
        self.pending_delete: int | None = None  # hidden, purged when the undo window ends

        self.new_chat_button = QPushButton("+  New chat", objectName="NewChatButton")
        self.new_chat_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_chat_button.setAccessibleName("New chat")
        self.new_chat_button.clicked.connect(self.new_chat_requested)

        self.search = QLineEdit(objectName="ChatSearch")
        self.search.setPlaceholderText("Search chats  (Ctrl+F)")
        self.search.setAccessibleName("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda _text: self.refresh())

        self.chat_list = QListWidget(objectName="ChatList")
        self.chat_list.setAccessibleName("Chats")
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.chat_list.customContextMenuRequested.connect(self._menu)
        self.chat_list.currentItemChanged.connect(self._on_current)
        self.chat_list.itemChanged.connect(self._on_item_edited)
        self.chat_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.chat_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.chat_list.setEditTriggers(
            QAbstractItemView.EditTrigger.DoubleClicked | QAbstractItemView.EditTrigger.EditKeyPressed
        )
        # Del and F2 are the window's Edit > Delete chat and Rename chat: a second shortcut for the
        # same key here would make both ambiguous, and neither would fire.

        self.undo_label = QLabel(objectName="UndoLabel")
        self.undo_label.setWordWrap(True)
        self.undo_button = QPushButton("Undo", objectName="UndoButton")
        self.undo_button.setAccessibleName("Undo delete")
        self.undo_button.setToolTip("Bring the deleted chat back (Ctrl+Z)")
        self.undo_button.clicked.connect(self.undo_delete)
        self.undo_bar = QWidget(objectName="UndoBar")
        undo_row = QHBoxLayout(self.undo_bar)
        undo_row.setContentsMargins(8, 6, 8, 6)
        undo_row.addWidget(self.undo_label, 1)
        undo_row.addWidget(self.undo_button)
        self.undo_bar.hide()
        self._undo_timer = QTimer(self)
        self._undo_timer.setSingleShot(True)
        self._undo_timer.setInterval(undo_ms)
        self._undo_timer.timeout.connect(self.purge_pending)

        column = QVBoxLayout(self)
        column.setContentsMargins(10, 12, 10, 10)
        column.setSpacing(10)
        column.addWidget(self.new_chat_button)
        column.addWidget(self.search)
        column.addWidget(self.chat_list, 1)
        column.addWidget(self.undo_bar)

    # ---- the list ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Rebuild from the history, filtered by the search box; keeps the current chat selected."""
        query = self.search.text()
        chats = self.history.search_chats(query) if query.strip() else self.history.list_chats()
        self.chat_list.blockSignals(True)  # rebuilding must not look like the user picking a chat
        try:
            self.chat_list.clear()
            for chat in chats:
                item = QListWidgetItem(chat.title or UNTITLED)
                item.setData(CHAT_ID, chat.id)
                item.setToolTip(chat_tooltip(chat))
                item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
                self.chat_list.addItem(item)
                if chat.id == self.current_id:
                    self.chat_list.setCurrentItem(item)
        finally:
            self.chat_list.blockSignals(False)

    def select(self, chat_id: int | None) -> None:
        self.current_id = chat_id
        self.chat_list.blockSignals(True)
        try:
            self.chat_list.setCurrentItem(None)  # type: ignore[arg-type]
            self.chat_list.clearSelection()
            item = self.item_for(chat_id)
            if item is not None:
                self.chat_list.setCurrentItem(item)
        finally:
            self.chat_list.blockSignals(False)

    def item_for(self, chat_id: int | None) -> QListWidgetItem | None:
        for row in range(self.chat_list.count()):
            item = self.chat_list.item(row)
            if item.data(CHAT_ID) == chat_id:
                return item
        return None

    def titles(self) -> list[str]:
        return [self.chat_list.item(row).text() for row in range(self.chat_list.count())]

    def focus_search(self) -> None:
        self.search.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.search.selectAll()

    def _on_current(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if item is not None:
            self.current_id = int(item.data(CHAT_ID))
            self.chat_selected.emit(self.current_id)

    # ---- rename -----------------------------------------------------------------------------

    def start_rename(self, chat_id: int | None = None) -> bool:
        """Edit the title in place (F2, double-click, or the context menu)."""
        item = self.item_for(chat_id) if chat_id is not None else self.chat_list.currentItem()
        if item is None:
            return False
        self.chat_list.setCurrentItem(item)
        self.chat_list.editItem(item)
        return True

    def _on_item_edited(self, item: QListWidgetItem) -> None:
        chat_id = int(item.data(CHAT_ID))
        chat = self.history.get_chat(chat_id)
        title = item.text().strip()
        if chat is None or title == (chat.title or UNTITLED):
            return
        if title:
            self.history.rename_chat(chat_id, title)
            self.chat_renamed.emit(chat_id)
        # An empty title is refused: show the stored one again. Later, not inside the editor's commit.
        QTimer.singleShot(0, self.refresh)

    # ---- delete with undo -------------------------------------------------------------------

    def hide_chat(self, chat_id: int) -> None:
        """Delete with undo; an earlier deletion still waiting is made final now."""
        chat = self.history.get_chat(chat_id)
        if chat is None:
            return
        self.purge_pending()
        self.history.hide_chat(chat_id)
        self.pending_delete = chat_id
        self.undo_label.setText(f"Deleted “{chat.title or UNTITLED}”")
        self.undo_bar.show()
        self._undo_timer.start()
        if self.current_id == chat_id:
            self.current_id = None
        self.refresh()

    def undo_delete(self) -> int | None:
        """Brings the last deleted chat back; returns its id (None: nothing to undo)."""
        chat_id = self.pending_delete
        self._end_undo_window()
        if chat_id is None or not self.history.restore_chat(chat_id):
            return None
        self.refresh()
        self.chat_restored.emit(chat_id)
        return chat_id

    def purge_pending(self) -> None:
        chat_id = self.pending_delete
        self._end_undo_window()
        if chat_id is not None:
            self.history.purge_hidden(chat_id)

    def _end_undo_window(self) -> None:
        self._undo_timer.stop()
        self.pending_delete = None
        self.undo_bar.hide()

    # ---- context menu -----------------------------------------------------------------------

    def _menu(self, pos: QPoint) -> None:
        item = self.chat_list.itemAt(pos)
        if item is None:
            return
        chat_id = int(item.data(CHAT_ID))
        menu = QMenu(self)
        rename = menu.addAction("Rename  (F2)")
        delete = menu.addAction("Delete  (Del)")
        chosen = menu.exec(self.chat_list.viewport().mapToGlobal(pos))
        if chosen is rename:
            self.start_rename(chat_id)
        elif chosen is delete:
            self.delete_requested.emit(chat_id)


def chat_tooltip(chat: Chat) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated))
    return f"{chat.title or UNTITLED}\n{when}" + (f"  ·  {chat.model}" if chat.model else "")
