"""SIGKILL at random points while answers stream into the history and chats are renamed, deleted
and branched: after every restart the database passes PRAGMA integrity_check, every answer that
was reported complete is there with its text and marked finished, every rename reported is kept
and every deletion reported stays deleted.

KILLS restarts are enough to land kills inside streaming writes, commits and purges many times over
(each run does hundreds of transactions); more would only cost CI time."""

from __future__ import annotations

import hashlib
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from ds4desk.history import History

KILLS = 20
WORKER = [sys.executable, "-m", "tests.robustness.history_worker"]


def _run_until_killed(db: Path, seed: int, after_lines: int) -> list[list[str]]:
    """Start the worker, SIGKILL it once it has reported `after_lines` steps (plus a random few
    milliseconds, so the kill lands anywhere in the step after), return what it reported."""
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen([*WORKER, str(db), str(seed)], stdout=subprocess.PIPE, text=True, cwd=root)
    assert process.stdout is not None
    reported: list[list[str]] = []
    for line in process.stdout:
        reported.append(line.split())
        if len(reported) >= after_lines:
            break
    time.sleep(random.Random(seed).random() * 0.02)
    process.send_signal(signal.SIGKILL)
    # Lines already written before the kill count as shown too; a line the kill cut short (no
    # newline) was never reported whole.
    rest = threading.Thread(
        target=lambda: reported.extend(line.split() for line in process.stdout or [] if line.endswith("\n"))
    )
    rest.start()
    process.wait(timeout=30)
    rest.join(30)
    return reported


def test_sigkill_never_loses_a_completed_answer_or_damages_the_database(tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite3"
    complete: dict[int, str] = {}  # answer id -> sha256 of its text
    chat_of: dict[int, int] = {}  # answer id -> its chat
    titles: dict[int, str] = {}
    renaming: dict[int, str] = {}  # a rename begun but not reported done: either title is right
    deleted: set[int] = set()
    deleting: set[int] = set()  # a deletion begun but not reported done: either outcome is right
    ever_deleted = 0
    rng = random.Random(22)
    for kill in range(KILLS):
        for words in _run_until_killed(db, seed=kill, after_lines=rng.randrange(1, 60)):
            if words[0] == "COMPLETE":
                chat_id, message_id = int(words[1]), int(words[2])
                assert chat_id not in deleted, f"deleted chat {chat_id}'s id was given to a new one"
                complete[message_id] = words[3]
                chat_of[message_id] = chat_id
            elif words[0] == "RENAMING":
                renaming[int(words[1])] = " ".join(words[2:])
            elif words[0] == "RENAMED":
                titles[int(words[1])] = " ".join(words[2:])
                renaming.pop(int(words[1]), None)
            elif words[0] == "DELETING":
                deleting.add(int(words[1]))
            elif words[0] == "DELETED":
                chat_id = int(words[1])
                deleted.add(chat_id)
                titles.pop(chat_id, None)
                for message_id in [m for m, c in chat_of.items() if c == chat_id]:
                    del complete[message_id], chat_of[message_id]
                ever_deleted += 1

        raw = sqlite3.connect(db)
        try:
            assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
        finally:
            raw.close()
        with History(db) as history:
            for chat_id in deleted:
                assert history.get_chat(chat_id) is None
            for chat_id, title in titles.items():
                chat = history.get_chat(chat_id)
                if chat_id not in deleted and not (chat is None and chat_id in deleting):
                    assert chat is not None and chat.title in (title, renaming.get(chat_id))
            for message_id, digest in complete.items():
                if chat_of[message_id] in deleting and history.get_chat(chat_of[message_id]) is None:
                    continue  # its chat was being deleted when the kill came: gone is right too
                message = history.get_message(message_id)
                assert message is not None and message.finished, (message_id, message)
                assert hashlib.sha256(message.content.encode()).hexdigest() == digest
    assert len(complete) > 50 and ever_deleted and titles  # the kills landed among every kind of step
