"""Writes chat history the way the window does, forever, until it is killed: answers streamed
through StreamingWriter and finished, plus renames, deletions and branches. After each step is
committed it prints one line saying what is now durable, so the test knows what must survive."""

from __future__ import annotations

import hashlib
import random
import sys

from ds4desk.history import History


def main(path: str, seed: int) -> None:
    rng = random.Random(seed)
    history = History(path)

    def say(*words: object) -> None:
        print(*words, flush=True)

    while True:
        chats = history.list_chats()
        roll = rng.random()
        if chats and roll < 0.15:
            chat = rng.choice(chats)
            title = f"renamed {rng.randrange(10**6)}"
            say("RENAMING", chat.id, title)  # from here a kill may leave the old title or this one
            history.rename_chat(chat.id, title)
            say("RENAMED", chat.id, title)
        elif chats and roll < 0.25:
            chat = rng.choice(chats)
            say("DELETING", chat.id)  # from here a kill may leave it hidden (undo pending) or gone
            history.hide_chat(chat.id)
            history.purge_hidden(chat.id)
            say("DELETED", chat.id)
        else:
            if chats and roll < 0.45:  # a branch: a new answer under an earlier user message
                chat = rng.choice(chats)
                users = [m for m in history.all_messages(chat.id) if m.role == "user"]
                if not users:
                    continue
                parent = rng.choice(users)
                answer = history.add_message(chat.id, "assistant", parent_id=parent.id, finished=False)
            else:
                chat = history.create_chat()
                history.add_message(chat.id, "user", f"question {rng.randrange(10**6)}")
                answer = history.add_message(chat.id, "assistant", finished=False)
            writer = history.streaming_writer(answer.id, interval_s=0.0, chars=40)
            for _ in range(rng.randrange(5, 40)):
                writer.append(f"token{rng.randrange(1000)} ")
            text = writer.text
            writer.finish(finished=True, stats={"finish_reason": "stop"})
            digest = hashlib.sha256(text.encode()).hexdigest()
            say("COMPLETE", chat.id, answer.id, digest)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
