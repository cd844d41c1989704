"""The real app, used as a user would, until it is killed: a real MainWindow (offscreen) on the real
engine thread answering with a real model, storing answers exactly as the window does (a row made
when the answer starts, StreamingWriter while it streams, `finished` when it ends), and renaming,
deleting, undoing, branching (regenerate, edit) and switching branches through the window's own
methods. Nothing of the window is replaced.

It opens the history with `open_history`, as the app does at start, and prints one line after each
step's writes have returned, so the test knows what the user has seen as done:

    OPENED <problem or ->                 the history opened (a problem: it was moved aside)
    ANSWERING <chat> <answer row> <kind>  an answer's row exists and the engine is writing it
                                          (kind: new, follow-up, regenerate or edit: a branch)
    COMPLETE <chat> <answer> <sha256 of the engine's text> <sha256 of the question>
    FAILED <chat> <answer row> <why>      the engine did not answer (never expected)
    RENAMED <chat> <title...>
    HIDDEN <chat> / RESTORED <chat> / DELETED <chat>   deleted with undo pending / undone / for good
    RENAMING, DELETING, RESTORING <chat>  said before the step: a kill before its report may leave
                                          either outcome, and the database says which
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before anything imports Qt

import asyncio
import hashlib
import random
import sys
from collections.abc import Callable
from pathlib import Path

import qasync
from PySide6.QtWidgets import QApplication

from ds4desk.app import open_history
from ds4desk.engine import Engine, EngineClient
from ds4desk.engine.api import FinishReason
from ds4desk.history import Message
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow

# Random sampling: every answer has its own text, so a message swapped for another would show.
SETTINGS = dict(temperature=1.0, top_p=1.0, context=1024, chunk=64, device="cpu", snapshot_slots=4)


# Longer chats get no follow-up: the prompt and the answer must fit the context.
FOLLOW_UPS_UNTIL = 6


def say(*words: object) -> None:
    print(*words, flush=True)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def words(rng: random.Random, count: int) -> str:
    # The tiny model's tokenizer knows the words t0..t255; anything else is one unknown token.
    return " ".join(f"t{rng.randrange(256)}" for _ in range(count))


class User:
    def __init__(self, window: MainWindow, rng: random.Random) -> None:
        self.window = window
        self.rng = rng

    async def answer(self, start: Callable[[], object], kind: str) -> None:
        """`start`: the window's submit (the composer already filled) or regenerate. Reports the
        answer once the window has stored it."""
        window = self.window
        before = window._send_task
        start()
        task = window._send_task
        if task is None or task is before:  # nothing was sent
            return
        while window._generation is None and not task.done():
            await asyncio.sleep(0.001)
        generation = window._generation
        if generation is not None:
            say("ANSWERING", generation.chat_id, generation.writer.message_id, kind)
        result = await task
        if generation is None or result is None:
            return
        answer = window.history.get_message(generation.writer.message_id)
        done = result.error is None and result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if done and answer is not None and answer.finished:
            question = window.history.get_message(answer.parent_id or 0)
            asked = digest(question.content) if question else "-"
            say("COMPLETE", generation.chat_id, answer.id, digest(result.text), asked)
        else:  # not a kill: the engine refused or failed, which this test does not expect
            say(
                "FAILED",
                generation.chat_id,
                generation.writer.message_id,
                result.error or result.finish_reason,
            )

    def pick_chat(self) -> int | None:
        chats = self.window.history.list_chats()
        return self.rng.choice(chats).id if chats else None

    async def step(self) -> None:
        window, rng = self.window, self.rng
        roll = rng.random()
        chat_id = self.pick_chat()
        if chat_id is None or roll < 0.35:  # a new chat
            window.new_chat()
            window.composer.setPlainText(words(rng, rng.randrange(3, 12)))
            await self.answer(window.submit, "new")
            return
        window.open_chat(chat_id)
        thread: list[Message] = window.history.messages(chat_id)
        if roll < 0.5 and len(thread) < FOLLOW_UPS_UNTIL:  # a follow-up in the chat
            window.composer.setPlainText(words(rng, rng.randrange(3, 12)))
            await self.answer(window.submit, "follow-up")
        elif roll < 0.6:  # a branch: another answer to the same question
            await self.answer(window.regenerate, "regenerate")
        elif roll < 0.7:  # a branch: the question edited
            users = [m for m in thread if m.role == "user"]
            if users:
                window.edit_message(rng.choice(users).id)
                window.composer.setPlainText(words(rng, rng.randrange(3, 12)))
                await self.answer(window.submit, "edit")
        elif roll < 0.75:  # back to the other branch
            branched = [item for item in window.history.thread(chat_id) if len(item.sibling_ids) > 1]
            if branched:
                window.switch_branch(branched[-1].message.id, -1 if branched[-1].index else 1)
        elif roll < 0.87:
            title = f"renamed {rng.randrange(10**6)}"
            say("RENAMING", chat_id, title)
            window.rename_chat(chat_id, title)
            say("RENAMED", chat_id, title)
        else:
            say("DELETING", chat_id)
            if not window.delete_chat(chat_id):
                return
            say("HIDDEN", chat_id)
            await asyncio.sleep(rng.random() * 0.02)  # the undo window, shortened
            if rng.random() < 0.3:
                say("RESTORING", chat_id)
                if window.sidebar.undo_delete() == chat_id:
                    say("RESTORED", chat_id)
            else:
                window.sidebar.purge_pending()  # the undo window ended
                say("DELETED", chat_id)


async def use(window: MainWindow, model: str, seed: int) -> None:
    loaded = await window.load_model(model)
    if not loaded.ok:
        say("LOAD-FAILED", loaded.error)
        return
    user = User(window, random.Random(seed))
    while True:  # until killed
        await user.step()


def main(db: str, model: str, seed: int, max_new_tokens: int) -> None:
    app = QApplication([])
    app.setQuitOnLastWindowClosed(False)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    history, problem = open_history(Path(db))
    say("OPENED", problem or "-")
    engine = Engine()
    window = MainWindow(EngineClient(engine), history, Settings(**SETTINGS, max_new_tokens=max_new_tokens))
    window.chat_view.render_interval_ms = 0
    window.show()
    loop.run_until_complete(use(window, model, seed))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
