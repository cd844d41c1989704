"""History on real SQLite files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ds4desk import history as history_module
from ds4desk.history import History, HistoryError, derive_title, schema_version


def test_wal_schema_version_and_foreign_keys(db_path: Path) -> None:
    with History(db_path) as history:
        assert history.user_version == schema_version() >= 1
        assert history._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
        assert raw.execute("PRAGMA user_version").fetchone()[0] == schema_version()
    finally:
        raw.close()


def test_chats_and_messages_round_trip(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat(model="tiny")
        assert chat.title == ""
        history.add_message(
            chat.id, "user", "  How do I\n reverse a list in Python? It is long enough to cut  "
        )
        history.add_message(chat.id, "assistant", "Use `reversed`.", stats={"decode_tok_s": 12.5})
        history.add_message(chat.id, "user", "Thanks")  # only the first user message names the chat
        later = history.create_chat()
    with History(db_path) as history:
        chats = history.list_chats()
        assert [c.id for c in chats] == [later.id, chat.id]  # newest first
        assert chats[1].title == "How do I"
        assert chats[1].model == "tiny"
        messages = history.messages(chat.id)
        assert [m.role for m in messages] == ["user", "assistant", "user"]
        assert messages[1].stats == {"decode_tok_s": 12.5}
        assert all(m.finished for m in messages)


def test_unfinished_message_survives_reopen(db_path: Path) -> None:
    history = History(db_path)
    chat = history.create_chat()
    message = history.add_message(chat.id, "assistant", "", finished=False)
    history.update_message(message.id, content="half an ans")
    del history  # no close(): as if the process died here

    with History(db_path) as reopened:
        (survivor,) = reopened.messages(chat.id)
        assert survivor.content == "half an ans"
        assert not survivor.finished
        assert survivor.stats is None


def test_streaming_writer_throttles_and_finishes(db_path: Path) -> None:
    now = [0.0]
    with History(db_path) as history:
        chat = history.create_chat()
        row = history.add_message(chat.id, "assistant", "", finished=False)
        writer = history.streaming_writer(row.id, interval_s=0.5, chars=100, clock=lambda: now[0])

        writer.append("abc")
        writer.append("def")
        assert history.get_message(row.id).content == ""  # neither time nor size is due yet
        now[0] = 0.6
        writer.append("g")
        assert history.get_message(row.id).content == "abcdefg"
        writer.append("x" * 100)  # size is due even within the interval
        assert history.get_message(row.id).content == "abcdefg" + "x" * 100
        assert writer.writes == 2

        writer.append("tail")
        writer.finish(finished=True, stats={"finish_reason": "stop"})
        final = history.get_message(row.id)
        assert final.content == "abcdefg" + "x" * 100 + "tail"
        assert final.finished and final.stats == {"finish_reason": "stop"}


def test_delete_chat_removes_its_messages(db_path: Path) -> None:
    with History(db_path) as history:
        keep = history.create_chat()
        drop = history.create_chat()
        history.add_message(keep.id, "user", "keep me")
        history.add_message(drop.id, "user", "drop me")
        history.delete_chat(drop.id)
        assert [c.id for c in history.list_chats()] == [keep.id]
        assert history.messages(drop.id) == []
        count = history._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        assert count == 1


def test_rename_chat(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        history.rename_chat(chat.id, "  My chat ")
        history.add_message(chat.id, "user", "does not rename it")
        assert history.get_chat(chat.id).title == "My chat"


def test_migration_hook_runs_new_steps(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = schema_version()
    History(db_path).close()

    def add_pinned(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE chats ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")

    monkeypatch.setattr(history_module, "MIGRATIONS", [*history_module.MIGRATIONS, add_pinned])
    with History(db_path) as history:
        assert history.user_version == len(history_module.MIGRATIONS) == shipped + 1
        columns = [row[1] for row in history._conn.execute("PRAGMA table_info(chats)")]
        assert "pinned" in columns


def test_newer_schema_is_refused(db_path: Path) -> None:
    History(db_path).close()
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version = {schema_version() + 1}")
    raw.close()
    with pytest.raises(HistoryError):
        History(db_path)


def test_bad_role_is_rejected(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        with pytest.raises(ValueError):
            history.add_message(chat.id, "tool", "x")


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("Hello", "Hello"),
        ("\n\n  first   line \nsecond", "first line"),
        ("word " * 30, "word word word word word word word word word…"),
        ("x" * 60, "x" * 48 + "…"),
    ],
)
def test_derive_title(text: str, title: str) -> None:
    assert derive_title(text) == title
