"""History schema v2 on real SQLite files: branches, search, hide/restore/purge, v1 upgrade."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from ds4desk import history as history_module
from ds4desk.history import STALE_HIDDEN_S, History, schema_version


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "history.sqlite3"


def make_v1_file(path: Path) -> None:
    """A database exactly as the v1 ds4desk left it: v1 schema, two chats, a linear conversation."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    history_module.MIGRATIONS[0](conn)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("COMMIT")
    now = time.time()
    conn.execute("INSERT INTO chats (id, title, created, updated) VALUES (1, 'Old chat', ?, ?)", (now, now))
    conn.execute("INSERT INTO chats (id, title, created, updated) VALUES (2, 'Other', ?, ?)", (now, now))
    for mid, chat, role, text in [
        (1, 1, "user", "first question"),
        (2, 2, "user", "other chat"),  # interleaved ids: chains must stay per chat
        (3, 1, "assistant", "first answer"),
        (4, 1, "user", "second question"),
        (5, 1, "assistant", "second answer"),
    ]:
        conn.execute(
            "INSERT INTO messages (id, chat_id, role, content, created) VALUES (?, ?, ?, ?, ?)",
            (mid, chat, role, text, now),
        )
    conn.close()


def test_v1_file_is_upgraded_and_keeps_its_conversation(db_path: Path) -> None:
    make_v1_file(db_path)
    with History(db_path) as history:
        assert history.user_version == schema_version() >= 2
        messages = history.messages(1)
        assert [m.content for m in messages] == [
            "first question",
            "first answer",
            "second question",
            "second answer",
        ]
        assert [m.parent_id for m in messages] == [None, 1, 3, 4]
        assert [m.content for m in history.messages(2)] == ["other chat"]
        # Appending continues the straight line.
        added = history.add_message(1, "user", "third")
        assert added.parent_id == 5
        assert history.messages(1)[-1].content == "third"


def test_edit_makes_a_sibling_branch_and_both_stay_reachable(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        q1 = history.add_message(chat.id, "user", "q1")
        a1 = history.add_message(chat.id, "assistant", "a1")
        q2 = history.add_message(chat.id, "user", "q2")
        a2 = history.add_message(chat.id, "assistant", "a2")

        # Edit q2: a sibling under a1, answered in its own branch.
        q2b = history.add_message(chat.id, "user", "q2 edited", parent_id=a1.id)
        a2b = history.add_message(chat.id, "assistant", "a2 edited")
        assert [m.id for m in history.messages(chat.id)] == [q1.id, a1.id, q2b.id, a2b.id]
        thread = history.thread(chat.id)
        assert thread[2].sibling_ids == [q2.id, q2b.id] and thread[2].index == 1
        assert thread[0].sibling_ids == [q1.id]

        history.switch_branch(q2.id)
        assert [m.content for m in history.messages(chat.id)] == ["q1", "a1", "q2", "a2"]
        history.switch_branch(q2b.id)
        assert [m.content for m in history.messages(chat.id)] == ["q1", "a1", "q2 edited", "a2 edited"]
        # Every message is still stored.
        assert {m.id for m in history.all_messages(chat.id)} == {q1.id, a1.id, q2.id, a2.id, q2b.id, a2b.id}


def test_regenerate_makes_a_sibling_answer(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        q = history.add_message(chat.id, "user", "q")
        a = history.add_message(chat.id, "assistant", "a")
        b = history.add_message(chat.id, "assistant", "b", parent_id=q.id)
        thread = history.thread(chat.id)
        assert [i.message.content for i in thread] == ["q", "b"]
        assert thread[1].sibling_ids == [a.id, b.id]
        history.switch_branch(a.id)
        assert [m.content for m in history.messages(chat.id)] == ["q", "a"]


def test_editing_the_first_message_makes_a_second_root(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        first = history.add_message(chat.id, "user", "original")
        history.add_message(chat.id, "assistant", "answer")
        root2 = history.add_message(chat.id, "user", "rewritten", parent_id=None)
        assert root2.parent_id is None
        thread = history.thread(chat.id)
        assert [i.message.content for i in thread] == ["rewritten"]
        assert thread[0].sibling_ids == [first.id, root2.id]
        assert history.get_chat(chat.id).title == "original"  # the title stays what it was


def test_parent_from_another_chat_is_refused(db_path: Path) -> None:
    with History(db_path) as history:
        one, two = history.create_chat(), history.create_chat()
        foreign = history.add_message(one.id, "user", "x")
        with pytest.raises(ValueError):
            history.add_message(two.id, "user", "y", parent_id=foreign.id)
        assert history.all_messages(two.id) == []


def test_branches_survive_reopening(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        q = history.add_message(chat.id, "user", "q")
        history.add_message(chat.id, "assistant", "a")
        history.add_message(chat.id, "assistant", "b", parent_id=q.id)
    with History(db_path) as history:
        thread = history.thread(chat.id)
        assert [i.message.content for i in thread] == ["q", "b"]
        assert len(thread[1].sibling_ids) == 2


def test_search_titles_and_text_with_literal_wildcards(db_path: Path) -> None:
    with History(db_path) as history:
        percent = history.create_chat()
        history.add_message(percent.id, "user", "What is 50% of 10?")
        underscore = history.create_chat()
        history.add_message(underscore.id, "user", "rename my_var please")
        deep = history.create_chat()
        history.add_message(deep.id, "user", "Hello")
        history.add_message(deep.id, "assistant", "The answer mentions Kubernetes.")
        titled = history.create_chat(title="Kubernetes notes")

        assert [c.id for c in history.search_chats("50%")] == [percent.id]
        assert history.search_chats("5%0") == []  # % is literal, not "anything"
        assert [c.id for c in history.search_chats("my_var")] == [underscore.id]
        assert history.search_chats("my_ar") == []
        assert history.search_chats("myXvar") == []  # _ is literal too
        assert {c.id for c in history.search_chats("kubernetes")} == {deep.id, titled.id}
        assert history.search_chats("back\\slash") == []
        assert len(history.search_chats("  ")) == 4  # empty query: every chat


def test_hide_restore_and_purge(db_path: Path) -> None:
    with History(db_path) as history:
        keep = history.create_chat()
        gone = history.create_chat()
        history.add_message(gone.id, "user", "findable text")
        history.hide_chat(gone.id)
        assert [c.id for c in history.list_chats()] == [keep.id]
        assert history.get_chat(gone.id) is None
        assert history.messages(gone.id) == []
        assert history.search_chats("findable") == []

        assert history.restore_chat(gone.id)
        assert [m.content for m in history.messages(gone.id)] == ["findable text"]

        history.hide_chat(gone.id)
        assert history.purge_hidden(gone.id) == 1
        assert not history.restore_chat(gone.id)
        count = history._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        assert count == 0


def test_hidden_chat_is_purged_when_the_history_closes(db_path: Path) -> None:
    with History(db_path) as history:
        chat = history.create_chat()
        history.add_message(chat.id, "user", "bye")
        history.hide_chat(chat.id)
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("SELECT COUNT(*) FROM chats").fetchone()[0] == 0
        assert raw.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    finally:
        raw.close()


def test_hidden_chat_left_by_a_crash_is_purged_on_open(db_path: Path) -> None:
    history = History(db_path)
    chat = history.create_chat()
    history.hide_chat(chat.id)
    history._conn.close()  # as if the process died: close() never ran
    # ... a while ago: a chat hidden moments ago may still be in another window's undo.
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute("UPDATE chats SET deleted = deleted - ?", (STALE_HIDDEN_S + 1,))
    raw.close()
    with History(db_path) as reopened:
        assert reopened._conn.execute("SELECT COUNT(*) FROM chats").fetchone()[0] == 0
