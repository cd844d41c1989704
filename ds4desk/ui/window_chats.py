"""The window's chats: open, create, rename, delete with undo, and the branches of a conversation
(edit, regenerate, switch). MainWindow inherits it."""

from __future__ import annotations

import asyncio
import logging

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtGui import QKeyEvent, QKeySequence

from ds4desk.engine.api import (
    GenerateResult,
)
from ds4desk.ui import chat_view
from ds4desk.ui.banners import (
    NO_MODEL_HELP,
    NO_MODEL_TITLE,
)
from ds4desk.ui.conversation import message_note
from ds4desk.ui.sidebar import UNTITLED

log = logging.getLogger(__name__)


class ChatNavigation:
    """MainWindow's chat and branch actions; the widgets and state they read are MainWindow's."""

    # ---- chats ----------------------------------------------------------------------------

    def _refresh_sidebar(self) -> None:
        self.sidebar.current_id = self.current_chat_id
        self.sidebar.refresh()

    def open_chat(self, chat_id: int, *, focus_composer: bool = True) -> None:
        """Show the chat's active branch; a chat still being answered keeps streaming into view."""
        if self.history.get_chat(chat_id) is None:
            return
        if chat_id != self.current_chat_id:
            self.composer.cancel_edit()
        self.current_chat_id = chat_id
        self.chat_view.clear_messages()
        generation = self._generation if self._generation and self._generation.chat_id == chat_id else None
        for item in self.history.thread(chat_id):
            message = item.message
            if generation and message.id == generation.writer.message_id:
                # Still streaming: keep following it.
                self.chat_view.begin_stream(
                    generation.writer.text,
                    message_id=message.id,
                    thinking_tokens=generation.thinking_tokens,
                    branch=(item.index, len(item.sibling_ids)),
                )
                continue
            note, kind = message_note(message)
            self.chat_view.add_message(
                message.role,
                message.content,
                note=note,
                note_kind=kind,
                message_id=message.id,
                branch=(item.index, len(item.sibling_ids)),
                thinking_tokens=(message.stats or {}).get("thinking_tokens"),
            )
        self.sidebar.select(chat_id)
        if focus_composer:
            self.composer.setFocus()

    def new_chat(self) -> None:
        """The chat row is created with the first message, so empty chats never pile up."""
        self.current_chat_id = None
        self.composer.cancel_edit()
        self.chat_view.clear_messages()
        self.sidebar.select(None)
        self.composer.setFocus()

    def rename_chat(self, chat_id: int, title: str) -> None:
        if title.strip():
            self.history.rename_chat(chat_id, title)
            self._refresh_sidebar()

    def delete_chat(self, chat_id: int) -> bool:
        """Hides the chat; Undo (the sidebar's button, Ctrl+Z) brings it back for a few seconds."""
        if self._generation and self._generation.chat_id == chat_id:
            self.set_status("Stop the answer before deleting its chat.", error=True)
            return False
        chat = self.history.get_chat(chat_id)
        title = (chat.title if chat else "") or UNTITLED
        self.sidebar.hide_chat(chat_id)
        if chat_id == self.current_chat_id:
            self.new_chat()
        # Ctrl+Z in the composer undoes this delete until something is typed there.
        self._undo_steps_at_delete = self.composer.document().availableUndoSteps()
        self.set_status(f"Deleted “{title}”. Undo with Ctrl+Z or the Undo button.")
        return True

    def delete_current_chat(self) -> bool:
        """Edit > Delete chat (Del): the chat selected in the list, else the one shown."""
        item = self.chat_list.currentItem()
        chat_id = int(item.data(Qt.ItemDataRole.UserRole)) if item is not None else self.current_chat_id
        return chat_id is not None and self.delete_chat(chat_id)

    def rename_current_chat(self) -> bool:
        """Edit > Rename chat (F2)."""
        item = self.chat_list.currentItem()
        chat_id = int(item.data(Qt.ItemDataRole.UserRole)) if item is not None else self.current_chat_id
        return self.sidebar.start_rename(chat_id)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        kind = event.type()
        if kind == QEvent.Type.ShortcutOverride and isinstance(event, QKeyEvent):
            if (
                watched is self.composer
                and event.matches(QKeySequence.StandardKey.Undo)
                and self._undo_deletes_chat()
            ):
                event.ignore()  # not the composer's: the window's Undo delete chat takes it
                return True
        elif kind == QEvent.Type.KeyPress and watched is self.chat_list and isinstance(event, QKeyEvent):
            typed = event.text()
            plain = not event.modifiers() & ~Qt.KeyboardModifier.ShiftModifier
            if typed and typed.isprintable() and not typed.isspace() and plain:
                self.composer.setFocus(Qt.FocusReason.OtherFocusReason)
                self.composer.insertPlainText(typed)
                return True
        return super().eventFilter(watched, event)

    def _undo_deletes_chat(self) -> bool:
        """A chat delete is waiting for its undo, and nothing was typed since."""
        return (
            self.sidebar.pending_delete is not None
            and self._undo_steps_at_delete == self.composer.document().availableUndoSteps()
        )

    def _on_chat_restored(self, chat_id: int) -> None:
        self.open_chat(chat_id)
        self.set_status("Chat restored.")

    # ---- branches: edit, regenerate, switch -------------------------------------------------

    def _on_message_action(self, action: str, message_id: int) -> None:
        if action == chat_view.EDIT:
            self.edit_message(message_id)
        elif action == chat_view.REGENERATE:
            self.regenerate(message_id)
        elif action in (chat_view.PREVIOUS, chat_view.NEXT):
            self.switch_branch(message_id, -1 if action == chat_view.PREVIOUS else 1)

    def edit_message(self, message_id: int) -> None:
        """Loads a sent message into the composer; sending it makes a new branch from there."""
        message = self.history.get_message(message_id)
        if message is None or message.role != "user":
            return
        self.composer.start_edit(message_id, message.content)
        self.set_status("Editing: Enter sends it as a new branch (the old one stays), Esc cancels.")

    def regenerate(self, message_id: int | None = None) -> asyncio.Task[GenerateResult | None] | None:
        """A new answer to the same question, as a sibling of `message_id` (default: the last one)."""
        if not self.can_send:
            self.set_status(f"{NO_MODEL_TITLE} {NO_MODEL_HELP}", error=True)
            return None
        if self.busy:
            self.set_status("Still answering: press Stop (Esc) to interrupt it first.")
            return None
        thread = self.history.messages(self.current_chat_id) if self.current_chat_id else []
        if message_id is None:
            message_id = next((m.id for m in reversed(thread) if m.role == "assistant"), None)
        message = self.history.get_message(message_id) if message_id is not None else None
        if message is None or message.role != "assistant" or message.parent_id is None:
            return None
        self._set_busy(True)
        self._send_task = asyncio.ensure_future(self.send_message(None, parent_id=message.parent_id))
        return self._send_task

    def switch_branch(self, message_id: int, step: int) -> None:
        """Show the previous (step -1) or next (+1) sibling of `message_id` and its branch."""
        chat_id = self.current_chat_id
        thread = self.history.thread(chat_id) if chat_id is not None else []
        item = next((i for i in thread if i.message.id == message_id), None)
        if item is None:
            return
        index = item.index + step
        if not 0 <= index < len(item.sibling_ids):
            return
        if self._generation is not None and self._generation.chat_id == chat_id:
            self.set_status("Wait for the answer (or Stop it) before switching branches.")
            return
        self.history.switch_branch(item.sibling_ids[index])
        self.open_chat(chat_id)
