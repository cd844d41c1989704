"""Chat history in SQLite: one file, WAL, a schema version in `PRAGMA user_version`.

Every write is its own transaction, so whatever was committed survives a crash. An assistant answer
gets its row when generation starts and `StreamingWriter` updates its content as text streams in;
`finished` is set only when the answer completed, so an answer cut off by a crash, a Stop or an
error is still there after a restart and the UI can say it is incomplete.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

ROLES = ("system", "user", "assistant")
TITLE_CHARS = 48
# A chat hidden (deleted, undo pending) by another window may still be brought back there: opening
# the history purges only chats hidden longer ago than this, far past any undo window.
STALE_HIDDEN_S = 120.0


class HistoryError(Exception):
    pass


@dataclass(slots=True)
class Chat:
    id: int
    title: str  # "" until the first user message names it
    created: float  # unix seconds
    updated: float
    model: str | None


@dataclass(slots=True)
class Message:
    id: int
    chat_id: int
    role: str
    content: str
    created: float
    finished: bool
    stats: dict[str, Any] | None
    parent_id: int | None = None  # None: a first message; siblings share a parent (branches)


@dataclass(slots=True)
class ThreadItem:
    """A message of the active branch and where it sits among its siblings."""

    message: Message
    sibling_ids: list[int]  # oldest first, the message itself included

    @property
    def index(self) -> int:
        return self.sibling_ids.index(self.message.id)


def _schema_v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE chats (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL,
            updated REAL NOT NULL,
            model TEXT
        )"""
    )
    conn.execute(
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL,
            finished INTEGER NOT NULL DEFAULT 1,
            stats TEXT
        )"""
    )
    conn.execute("CREATE INDEX messages_by_chat ON messages(chat_id, id)")
    conn.execute("CREATE INDEX chats_by_updated ON chats(updated DESC)")


def _schema_v2(conn: sqlite3.Connection) -> None:
    """Chats become trees: a message has a parent, the chat remembers the leaf of its active branch,
    and a deleted chat stays hidden (undo) until it is purged. A v1 chat is one straight branch."""
    conn.execute(
        "ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE"
    )
    conn.execute("ALTER TABLE chats ADD COLUMN leaf_id INTEGER")
    conn.execute("ALTER TABLE chats ADD COLUMN deleted REAL")  # when it was hidden; NULL: visible
    conn.execute(
        """UPDATE messages SET parent_id = (
            SELECT MAX(m.id) FROM messages AS m WHERE m.chat_id = messages.chat_id AND m.id < messages.id
        )"""
    )
    conn.execute(
        "UPDATE chats SET leaf_id = (SELECT MAX(m.id) FROM messages AS m WHERE m.chat_id = chats.id)"
    )
    conn.execute("CREATE INDEX messages_by_parent ON messages(parent_id)")


def _schema_v3(conn: sqlite3.Connection) -> None:
    """Ids are never handed out twice (AUTOINCREMENT). Without it SQLite gives a new row max(id) + 1,
    so the chat made after the newest one was deleted got the deleted chat's id, and whatever still
    named that id (the engine's snapshot slots are tagged with the window's chat id, a saved slot
    file keeps its tag, a view holds message ids) silently meant the new chat instead.

    SQLite cannot add AUTOINCREMENT to a table, so both are rebuilt (its documented recipe, run with
    foreign keys off by `_migrate`: dropping `chats` must not cascade into `messages`). Ids keep their
    values; the counters start at the highest id kept, so only a chat deleted before this upgrade,
    as the newest one, can still see its id again, once."""
    dangling_before = len(conn.execute("PRAGMA foreign_key_check").fetchall())
    conn.execute(
        """CREATE TABLE chats_v3 (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL,
            updated REAL NOT NULL,
            model TEXT,
            leaf_id INTEGER,
            deleted REAL
        )"""
    )
    conn.execute(
        """CREATE TABLE messages_v3 (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL,
            finished INTEGER NOT NULL DEFAULT 1,
            stats TEXT,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE
        )"""
    )
    chat_columns = "id, title, created, updated, model, leaf_id, deleted"
    message_columns = "id, chat_id, role, content, created, finished, stats, parent_id"
    conn.execute(f"INSERT INTO chats_v3 ({chat_columns}) SELECT {chat_columns} FROM chats")
    conn.execute(f"INSERT INTO messages_v3 ({message_columns}) SELECT {message_columns} FROM messages")
    conn.execute("DROP TABLE messages")
    conn.execute("DROP TABLE chats")
    conn.execute("ALTER TABLE chats_v3 RENAME TO chats")
    conn.execute("ALTER TABLE messages_v3 RENAME TO messages")
    conn.execute("CREATE INDEX messages_by_chat ON messages(chat_id, id)")
    conn.execute("CREATE INDEX chats_by_updated ON chats(updated DESC)")
    conn.execute("CREATE INDEX messages_by_parent ON messages(parent_id)")
    # The rows were copied verbatim, so the rebuild cannot have broken a reference that was whole;
    # if it did, the rollback keeps the file exactly as it was.
    if len(conn.execute("PRAGMA foreign_key_check").fetchall()) > dangling_before:
        raise HistoryError("upgrading the history to schema 3 broke references between its rows")


# MIGRATIONS[n] takes a database at schema version n to n + 1. Append here; never edit a shipped one.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_schema_v1, _schema_v2, _schema_v3]

# add_message(parent_id=LEAF): append to the chat's active branch.
LEAF = "leaf"


def schema_version() -> int:
    return len(MIGRATIONS)


def derive_title(text: str) -> str:
    """The first line of the first user message, whitespace collapsed, cut at a word."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"\s+", " ", line).strip()
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[:TITLE_CHARS].rsplit(" ", 1)[0] if " " in line[:TITLE_CHARS] else line[:TITLE_CHARS]
    return cut.rstrip(" ,.;:") + "…"


class History:
    def __init__(self, path: str | Path) -> None:
        """`path` may be ":memory:". Raises HistoryError for a database from a newer ds4desk and
        sqlite3.DatabaseError for a file that is not a database."""
        self.path = str(path)
        self._hidden_here: set[int] = set()  # chats this instance hid: close() purges only those
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are explicit (see _tx) so no DDL or DML slips outside one.
        self._conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._conn.execute("PRAGMA journal_mode = WAL")
            # In WAL mode NORMAL loses nothing when the app crashes, only (maybe) on power loss.
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            # Left hidden by a session that ended before it could purge; not one still in its undo.
            self.purge_hidden(older_than_s=STALE_HIDDEN_S)
        except BaseException:
            self._conn.close()
            raise

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Chats this history hid and that are still hidden (an undo that never came) are deleted
        now; another window's pending deletions are its own."""
        with contextlib.suppress(sqlite3.Error):
            for chat_id in sorted(self._hidden_here):
                self.purge_hidden(chat_id)
        self._conn.close()

    def close_without_purging(self) -> None:
        """For a file about to be set aside: nothing more is written to it."""
        self._conn.close()

    def damage(self) -> str | None:
        """None when SQLite's own page check passes, else what it found (a damaged page would
        otherwise surface later, in whichever read or write first touches it)."""
        try:
            rows = self._conn.execute("PRAGMA quick_check(5)").fetchall()
        except sqlite3.DatabaseError as exc:
            return str(exc)
        found = [str(row[0]) for row in rows]
        return None if found == ["ok"] else "; ".join(found)

    def __enter__(self) -> History:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _migrate(self) -> None:
        version = self.user_version
        target = schema_version()
        if version > target:
            raise HistoryError(
                f"{self.path} has history schema {version}; this ds4desk understands up to {target}"
            )
        if version == target:
            return
        # A table rebuild (v3) drops a table that others reference: with foreign keys on, that drop
        # would delete every message. The pragma is a no-op inside a transaction, so it is set here.
        self._conn.execute("PRAGMA foreign_keys = OFF")
        try:
            for step in range(version, target):
                with self._tx() as conn:
                    MIGRATIONS[step](conn)
                    conn.execute(f"PRAGMA user_version = {step + 1}")  # pragmas take no parameters
        finally:
            self._conn.execute("PRAGMA foreign_keys = ON")

    @property
    def user_version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    # ---- chats ----------------------------------------------------------------------------

    def create_chat(self, title: str = "", model: str | None = None) -> Chat:
        now = time.time()
        with self._tx() as conn:
            cur = conn.execute(
                "INSERT INTO chats (title, created, updated, model) VALUES (?, ?, ?, ?)",
                (title, now, now, model),
            )
        return Chat(int(cur.lastrowid or 0), title, now, now, model)

    def get_chat(self, chat_id: int) -> Chat | None:
        """None for a missing or hidden (deleted, undo pending) chat."""
        row = self._conn.execute(
            "SELECT * FROM chats WHERE id = ? AND deleted IS NULL", (chat_id,)
        ).fetchone()
        return _chat(row) if row else None

    def list_chats(self) -> list[Chat]:
        """Most recently used first."""
        rows = self._conn.execute(
            "SELECT * FROM chats WHERE deleted IS NULL ORDER BY updated DESC, id DESC"
        ).fetchall()
        return [_chat(row) for row in rows]

    def search_chats(self, query: str) -> list[Chat]:
        """Chats whose title or any message (on any branch) contains `query`, case-insensitively for
        ASCII; most recently used first. `%` and `_` in the query are matched literally."""
        if not query.strip():
            return self.list_chats()
        pattern = "%" + re.sub(r"([\\%_])", r"\\\1", query.strip()) + "%"
        rows = self._conn.execute(
            r"""SELECT * FROM chats WHERE deleted IS NULL AND (
                    title LIKE :p ESCAPE '\'
                    OR EXISTS (SELECT 1 FROM messages AS m
                               WHERE m.chat_id = chats.id AND m.content LIKE :p ESCAPE '\'))
                ORDER BY updated DESC, id DESC""",
            {"p": pattern},
        ).fetchall()
        return [_chat(row) for row in rows]

    def rename_chat(self, chat_id: int, title: str) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE chats SET title = ? WHERE id = ?", (title.strip(), chat_id))

    def set_chat_model(self, chat_id: int, model: str | None) -> None:
        with self._tx() as conn:
            conn.execute("UPDATE chats SET model = ? WHERE id = ?", (model, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        """Now and for good; its messages go with it (ON DELETE CASCADE)."""
        with self._tx() as conn:
            conn.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def hide_chat(self, chat_id: int) -> None:
        """A delete that can be undone: the chat disappears from every read until `restore_chat`,
        or until `purge_hidden` (the undo window ended, or the history was closed) deletes it."""
        with self._tx() as conn:
            conn.execute("UPDATE chats SET deleted = ? WHERE id = ?", (time.time(), chat_id))
        self._hidden_here.add(chat_id)

    def restore_chat(self, chat_id: int) -> bool:
        """False when it is gone already (purged)."""
        with self._tx() as conn:
            cur = conn.execute(
                "UPDATE chats SET deleted = NULL WHERE id = ? AND deleted IS NOT NULL", (chat_id,)
            )
        self._hidden_here.discard(chat_id)
        return cur.rowcount > 0

    def purge_hidden(self, chat_id: int | None = None, *, older_than_s: float = 0.0) -> int:
        """Delete hidden chats for good (one, or all hidden more than `older_than_s` ago); returns
        how many."""
        with self._tx() as conn:
            if chat_id is None:
                cutoff = time.time() - older_than_s
                cur = conn.execute("DELETE FROM chats WHERE deleted IS NOT NULL AND deleted <= ?", (cutoff,))
            else:
                cur = conn.execute("DELETE FROM chats WHERE id = ? AND deleted IS NOT NULL", (chat_id,))
                self._hidden_here.discard(chat_id)
        return cur.rowcount

    # ---- messages -------------------------------------------------------------------------

    def messages(self, chat_id: int) -> list[Message]:
        """The active branch, first message first ([] for a hidden chat)."""
        return [item.message for item in self.thread(chat_id)]

    def all_messages(self, chat_id: int) -> list[Message]:
        """Every branch, in the order they were written."""
        rows = self._conn.execute(
            "SELECT m.* FROM messages AS m JOIN chats AS c ON c.id = m.chat_id"
            " WHERE m.chat_id = ? AND c.deleted IS NULL ORDER BY m.id",
            (chat_id,),
        ).fetchall()
        return [_message(row) for row in rows]

    def thread(self, chat_id: int) -> list[ThreadItem]:
        """The active branch, each message with its siblings (the other branches at that point)."""
        chat = self._conn.execute(
            "SELECT leaf_id FROM chats WHERE id = ? AND deleted IS NULL", (chat_id,)
        ).fetchone()
        if chat is None:
            return []
        everything = self.all_messages(chat_id)
        by_id = {m.id: m for m in everything}
        children: dict[int | None, list[int]] = {}
        for m in everything:
            children.setdefault(m.parent_id, []).append(m.id)
        leaf = chat["leaf_id"] if chat["leaf_id"] in by_id else (everything[-1].id if everything else None)
        path: list[Message] = []
        seen: set[int] = set()
        while leaf is not None and leaf in by_id and leaf not in seen:  # `seen`: a damaged file can loop
            seen.add(leaf)
            path.append(by_id[leaf])
            leaf = by_id[leaf].parent_id
        path.reverse()
        return [ThreadItem(m, children.get(m.parent_id, [m.id])) for m in path]

    def get_message(self, message_id: int) -> Message | None:
        row = self._conn.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        return _message(row) if row else None

    def add_message(
        self,
        chat_id: int,
        role: str,
        content: str = "",
        *,
        parent_id: int | str | None = LEAF,
        finished: bool = True,
        stats: dict[str, Any] | None = None,
    ) -> Message:
        """Appends to the active branch (`parent_id=LEAF`), or starts a new branch under `parent_id`
        (None: a new first message); either way the new message becomes the active branch's end.
        The chat's first user message also becomes its title, unless it already has one."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        now = time.time()
        with self._tx() as conn:
            if parent_id == LEAF:
                thread = self.thread(chat_id)
                parent = thread[-1].message.id if thread else None
            else:
                parent = parent_id if isinstance(parent_id, int) else None
                if parent is not None:
                    owner = conn.execute("SELECT chat_id FROM messages WHERE id = ?", (parent,)).fetchone()
                    if owner is None or owner[0] != chat_id:
                        raise ValueError(f"message {parent} is not in chat {chat_id}")
            cur = conn.execute(
                "INSERT INTO messages (chat_id, role, content, created, finished, stats, parent_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, now, int(finished), _dump(stats), parent),
            )
            message_id = int(cur.lastrowid or 0)
            conn.execute("UPDATE chats SET updated = ?, leaf_id = ? WHERE id = ?", (now, message_id, chat_id))
            if role == "user" and content.strip():
                conn.execute(
                    "UPDATE chats SET title = ? WHERE id = ? AND title = ''", (derive_title(content), chat_id)
                )
        return Message(message_id, chat_id, role, content, now, finished, stats, parent)

    def switch_branch(self, message_id: int) -> None:
        """Make the branch through `message_id` the active one, down to its newest descendants."""
        message = self.get_message(message_id)
        if message is None:
            raise ValueError(f"no message {message_id}")
        leaf = message_id
        while True:
            row = self._conn.execute("SELECT MAX(id) FROM messages WHERE parent_id = ?", (leaf,)).fetchone()
            if row[0] is None:
                break
            leaf = int(row[0])
        with self._tx() as conn:
            conn.execute("UPDATE chats SET leaf_id = ? WHERE id = ?", (leaf, message.chat_id))

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        finished: bool | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Changes only what is given."""
        sets: list[str] = []
        values: list[object] = []
        if content is not None:
            sets.append("content = ?")
            values.append(content)
        if finished is not None:
            sets.append("finished = ?")
            values.append(int(finished))
        if stats is not None:
            sets.append("stats = ?")
            values.append(_dump(stats))
        if not sets:
            return
        with self._tx() as conn:
            conn.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, message_id))

    def streaming_writer(self, message_id: int, **kwargs: Any) -> StreamingWriter:
        return StreamingWriter(self, message_id, **kwargs)


class StreamingWriter:
    """Keeps a growing answer's row current without a write per token batch.

    Writes when `interval_s` has passed or `chars` characters arrived since the last write; `finish`
    writes the final state. So a crash loses at most half a second of text.
    """

    def __init__(
        self,
        history: History,
        message_id: int,
        *,
        interval_s: float = 0.5,
        chars: int = 2000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._history = history
        self.message_id = message_id
        self._interval_s = interval_s
        self._chars = chars
        self._clock = clock
        self._parts: list[str] = []
        self._length = 0
        self._written_length = 0
        self._written_at = clock()
        self.writes = 0

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def append(self, text: str) -> None:
        if not text:
            return
        self._parts.append(text)
        self._length += len(text)
        due = self._clock() - self._written_at >= self._interval_s
        if due or self._length - self._written_length >= self._chars:
            self.flush()

    def flush(self) -> None:
        if self._length == self._written_length:
            return
        self._write(content=self.text)

    def finish(
        self, *, finished: bool, stats: dict[str, Any] | None = None, content: str | None = None
    ) -> None:
        """`content` replaces what streamed (the engine's final text, say); stats are stored as given."""
        if content is not None:
            self._parts, self._length = [content], len(content)
        self._write(content=self.text, finished=finished, stats=stats)

    def _write(self, **changes: Any) -> None:
        self._history.update_message(self.message_id, **changes)
        self._written_length = self._length
        self._written_at = self._clock()
        self.writes += 1


def _dump(stats: dict[str, Any] | None) -> str | None:
    return json.dumps(stats) if stats is not None else None


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(row["id"], row["title"], row["created"], row["updated"], row["model"])


def _message(row: sqlite3.Row) -> Message:
    stats: dict[str, Any] | None = None
    if row["stats"]:
        try:
            loaded = json.loads(row["stats"])
        except ValueError:
            loaded = None  # a damaged stats blob must not hide the message itself
        stats = loaded if isinstance(loaded, dict) else None
    return Message(
        row["id"],
        row["chat_id"],
        row["role"],
        row["content"],
        row["created"],
        bool(row["finished"]),
        stats,
        row["parent_id"] if "parent_id" in row.keys() else None,  # noqa: SIM118 (sqlite3.Row)
    )
