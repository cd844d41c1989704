"""The block-by-block streaming render: the same document as a whole render, at a cost that grows with
the answer, not with its square (counted in characters rendered, never timed)."""

from __future__ import annotations

import random

import pytest

from ds4desk.ui.chat_view import ChatView
from ds4desk.ui.stream_render import stable_end

BLOCKS = [
    "A paragraph with **bold** and `code`.\n\n",
    "```python\ndef add(a, b):\n\n    return a + b\n```\n\n",
    "- one\n- two\n\n",
    "1. first\n2. second\n\n",
    "# A heading\n\n",
    "> a quote\n\n",
    "| a | b |\n|---|---|\n| 1 | 2 |\n\n",
    "---\n\n",
    "Line one\nline two\n\n",
    "- loose item\n\n- another loose item\n\n",
    "    indented code\n\n",
    "~~~\ntilde fence\n\n~~~\n\n",
]


def answer_text(seed: int, blocks: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(BLOCKS) for _ in range(blocks)) + "The end, without a newline"


def stream(view: ChatView, text: str, seed: int, message_id: int = 1) -> None:
    rng = random.Random(seed)
    view.begin_stream(message_id=message_id)
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 40)
        view.append_stream(text[pos : pos + step])
        pos += step


@pytest.fixture
def view(qtbot) -> ChatView:
    chat = ChatView(render_interval_ms=0)  # render after every batch: the hardest case
    qtbot.addWidget(chat)
    chat.resize(700, 500)
    return chat


def test_stable_end() -> None:
    assert stable_end("Para\n\nNext") == 0  # the next line may still grow
    assert stable_end("Para\n\nNext\n") == len("Para\n\n")
    assert stable_end("```\ncode\n\nmore\n```\n\nAfter\n") == len("```\ncode\n\nmore\n```\n\n")
    assert stable_end("```\ncode\n\nstill open\n") == 0  # inside a fence nothing is finished
    assert stable_end("- a\n\n- b\n") == 0  # a loose list goes on
    assert stable_end("Para\n\n    indented\n") == 0  # indented: code, or a continuation
    assert stable_end("Para\n\n> quote\n") == 0
    text = "One\n\nTwo\n\nThree\n"
    assert stable_end(text, len("One\n\n")) == len("One\n\nTwo\n\n")


@pytest.mark.parametrize("seed", range(6))
def test_streamed_answer_equals_a_whole_render(view: ChatView, seed: int) -> None:
    text = answer_text(seed, 14)
    stream(view, text, seed)
    streamed_plain = view.toPlainText()
    view.end_stream(text, note="decode 30 tok/s")
    finished = view.toPlainText(), view.document().blockCount()
    assert "decode 30 tok/s" in finished[0] and "The end, without a newline" in finished[0]
    assert streamed_plain.strip() in finished[0]  # the stream showed the same text before the note

    view.set_dark(True)  # re-renders every message whole
    assert (view.toPlainText(), view.document().blockCount()) == finished


def test_code_blocks_are_numbered_across_the_answer(view: ChatView) -> None:
    text = "".join(f"Block {i}:\n\n```\nprint({i})\n```\n\n" for i in range(4)) + "Done."
    stream(view, text, seed=1, message_id=7)
    view.end_stream(text)
    assert [view.copy_code(7, i) for i in range(4)] == [f"print({i})" for i in range(4)]
    html = view.toHtml()
    assert all(f"copy-code/7/{i}" in html for i in range(4))


def test_rendering_work_grows_linearly(view: ChatView) -> None:
    """Each render converts only the new finished blocks and the open one: a 12 kB answer rendered
    after every one of its ~600 batches converts a few times its length, not hundreds of times.
    (Kept this size: PySide6 6.12 on Python 3.11 under-counts None on every void call, and a few
    thousand more calls in one process make the interpreter abort at exit.)"""
    text = answer_text(3, 500)
    rendered: list[int] = []
    original = view._renderer.render

    def counting(source: str, **options: object) -> str:
        rendered.append(len(source))
        return original(source, **options)  # type: ignore[arg-type]

    view._renderer.render = counting  # type: ignore[method-assign]
    stream(view, text, seed=3)
    view.end_stream(text)
    assert len(text) > 10_000 and view.renders > 400
    assert sum(rendered) < 6 * len(text)


def test_thinking_and_a_changed_final_text_render_whole(view: ChatView) -> None:
    thought = "<think>Let me think.\n\nStep two.\n\n</think>The answer.\n\nMore.\n"
    stream(view, thought, seed=2)
    view.end_stream(thought)
    assert "The answer." in view.toPlainText() and "More." in view.toPlainText()

    streamed = "First\n\nSecond\n\nThird\n"
    stream(view, streamed, seed=4, message_id=2)
    view.end_stream("Other\n\nWords\n")  # the engine's final decode differs: rendered whole
    last = view.toPlainText().split("The answer.")[-1]
    assert "Other" in last and "Words" in last and "First" not in last


def test_a_new_message_rewrites_only_the_previous_answer_s_actions(qtbot) -> None:
    """Sending moves Regenerate to the new last answer: the old answer's actions line is rewritten,
    the answer itself is not rendered again, and the document is what a fresh render gives."""
    view = ChatView(render_interval_ms=0)
    qtbot.addWidget(view)
    rendered: list[str] = []
    original = view._renderer.render

    def counting(source: str, **options: object) -> str:
        rendered.append(source)
        return original(source, **options)  # type: ignore[arg-type]

    view._renderer.render = counting  # type: ignore[method-assign]
    for i in range(4):
        view.add_message("user", f"question {i}", message_id=2 * i + 1)
        view.add_message("assistant", answer_text(i, 8), message_id=2 * i + 2, note="decode 9 tok/s")
    assert len(rendered) == 4  # each answer once: adding the next message did not render it again
    assert view.toPlainText().count("Regenerate") == 1
    assert view.toPlainText().rstrip().endswith("Regenerate")
    shown = view.toHtml()

    fresh = ChatView(render_interval_ms=0)
    qtbot.addWidget(fresh)
    for i in range(4):
        fresh.add_message("user", f"question {i}", message_id=2 * i + 1)
        fresh.add_message("assistant", answer_text(i, 8), message_id=2 * i + 2, note="decode 9 tok/s")
    fresh.set_dark(True)
    fresh.set_dark(False)  # every message rendered anew into a new document
    assert fresh.toHtml() == shown
