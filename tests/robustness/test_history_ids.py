"""Chat and message ids are never handed out twice: the engine's snapshot slots are tagged with the
window's chat id, so a reused id would make a deleted chat's slot look like the new chat's. And the
schema upgrade that makes it so (a table rebuild) keeps every row of an existing history."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ds4desk import history as history_module
from ds4desk.history import History, HistoryError, schema_version
from tests.ui.chat_helpers import type_and_enter


def _delete_for_good(history: History, chat_id: int) -> None:
    history.hide_chat(chat_id)
    assert history.purge_hidden(chat_id) == 1


def test_the_newest_chat_deleted_never_lends_its_ids_to_the_next(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    with History(path) as history:
        history.create_chat()
        newest = history.create_chat()
        question = history.add_message(newest.id, "user", "a question")
        answer = history.add_message(newest.id, "assistant", "an answer")
        _delete_for_good(history, newest.id)
        made = history.create_chat()
        message = history.add_message(made.id, "user", "a new question")
        assert made.id > newest.id
        assert message.id > answer.id > question.id
        _delete_for_good(history, made.id)
    with History(path) as history:  # after a restart too: the counter is in the file
        assert history.create_chat().id > made.id


def test_a_deleted_chats_snapshot_slot_is_not_shown_as_the_new_chats(
    qtbot: Any, make_window: Callable[..., Any], run: Callable[..., Any]
) -> None:
    window = make_window()
    type_and_enter(qtbot, window, "the chat that will be deleted")
    run(window.wait_idle())
    old_id = window.current_chat_id
    old_tag = str(old_id)
    assert [info.tag for info in window.backend.slot_infos] == [old_tag]  # the window tagged its slot

    window.sidebar.hide_chat(old_id)
    window.sidebar.purge_pending()  # the undo window ended
    window.new_chat()
    type_and_enter(qtbot, window, "a new chat")
    run(window.wait_idle())
    new_chat = window.history.get_chat(window.current_chat_id)
    assert new_chat is not None and new_chat.id != old_id
    # The slot panel names a slot's chat from its tag: the old slot must not claim the new chat.
    assert window._chat_title_of(old_tag) != new_chat.title
    assert window._chat_title_of(str(new_chat.id)) == new_chat.title


def _v2_file(path: Path) -> dict[str, list[tuple[object, ...]]]:
    """A history exactly as schema 2 left it (branches, a hidden chat, a chat deleted as the newest
    one); returns every row of both tables."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for migrate in history_module.MIGRATIONS[:2]:
        migrate(conn)
    conn.execute("PRAGMA user_version = 2")
    conn.execute("COMMIT")
    now = time.time()
    rows = [
        "INSERT INTO chats (id, title, created, updated, model, leaf_id, deleted) VALUES"
        f" (1, 'Kept', {now}, {now}, 'm', 4, NULL), (2, 'Hidden', {now}, {now}, NULL, 5, {now}),"
        f" (4, 'Gone', {now}, {now}, NULL, NULL, NULL)",
        "INSERT INTO messages (id, chat_id, role, content, created, finished, stats, parent_id) VALUES"
        f" (1, 1, 'user', 'question', {now}, 1, NULL, NULL),"
        f" (2, 1, 'assistant', 'first answer', {now}, 1, '{{\"finish_reason\": \"stop\"}}', 1),"
        f" (3, 2, 'user', 'hidden question', {now}, 1, NULL, NULL),"
        f" (4, 1, 'assistant', 'second answer, cut off', {now}, 0, NULL, 1),"
        f" (5, 2, 'assistant', 'hidden answer', {now}, 1, NULL, 3),"
        f" (6, 4, 'user', 'deleted question', {now}, 1, NULL, NULL)",
        "DELETE FROM chats WHERE id = 4",
        "DELETE FROM messages WHERE chat_id = 4",
    ]
    for sql in rows:
        conn.execute(sql)
    kept = {
        table: conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
        for table in ("chats", "messages")
    }
    conn.close()
    return kept


def test_a_schema_2_history_is_upgraded_keeping_every_row(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    before = _v2_file(path)
    with History(path) as history:
        assert history.user_version == schema_version()
        conn = history._conn
        after = {table: conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() for table in before}
        assert [tuple(row) for row in after["chats"]] == before["chats"]
        assert [tuple(row) for row in after["messages"]] == before["messages"]
        assert conn.execute("PRAGMA integrity_check").fetchall()[0][0] == "ok"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1  # back on after the rebuild
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"messages_by_chat", "chats_by_updated", "messages_by_parent"} <= indexes
        assert [m.content for m in history.messages(1)] == ["question", "second answer, cut off"]
        assert history.get_chat(2) is None and history.restore_chat(2)  # still hidden, still undoable
        assert [m.content for m in history.messages(2)] == ["hidden question", "hidden answer"]
        # The references survived the rebuild: deleting a chat still takes its messages along.
        history.delete_chat(1)
        assert history.get_message(2) is None and history.get_message(4) is None
        newest = history.create_chat()
        assert newest.id > 2  # (a chat deleted before the upgrade is not remembered: 4 may come back)
        _delete_for_good(history, newest.id)
        assert history.create_chat().id > newest.id


def test_an_upgrade_that_fails_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "history.sqlite3"
    before = _v2_file(path)
    upgrade = history_module.MIGRATIONS[2]

    def fails_at_the_end(conn: sqlite3.Connection) -> None:
        upgrade(conn)  # tables dropped and rebuilt, then something goes wrong
        raise HistoryError("disk trouble")

    monkeypatch.setattr(history_module, "MIGRATIONS", [*history_module.MIGRATIONS[:2], fails_at_the_end])
    with pytest.raises(HistoryError, match="disk trouble"):
        History(path)
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 2
        for table, rows in before.items():
            assert raw.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() == rows
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        raw.close()
