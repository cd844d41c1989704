"""ThinkSplitter: an answer's <think> part apart from its reply, however the text is cut into pieces."""

from __future__ import annotations

import pytest

from ds4desk.engine.api import ThinkingFormat
from ds4desk.server.thinking import ThinkSplitter, split_text

OPENS = ThinkingFormat(switch=True, opened_when_on=True)  # DeepSeek-V4: the prompt opens <think>
WRITES = ThinkingFormat(switch=True)  # the model writes <think> itself (Qwen3-like)
NONE = ThinkingFormat()


def streamed(text: str, fmt: ThinkingFormat, thinking: bool, size: int) -> tuple[str, str, list[str]]:
    splitter = ThinkSplitter(fmt, thinking)
    reasoning, content, order = "", "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for out in [splitter.feed(piece) for piece in pieces] + [splitter.flush()]:
        reasoning += out.reasoning
        content += out.content
        order += ["r"] * bool(out.reasoning) + ["c"] * bool(out.content)
    return reasoning, content, order


CASES = [
    # (text, format, thinking on, reasoning, content)
    ("step one</think>The answer.", OPENS, True, "step one", "The answer."),
    ("no close yet", OPENS, True, "no close yet", ""),
    ("The answer.", OPENS, False, "", "The answer."),
    ("<think>hmm</think>\n\nYes.", WRITES, True, "hmm", "\n\nYes."),
    ("  \n<think>hmm</think>Yes.", WRITES, False, "hmm", "Yes."),
    ("Yes. <think>not at the start</think>", WRITES, True, "", "Yes. <think>not at the start</think>"),
    ("<thin", WRITES, True, "", "<thin"),
    ("<think>a</think>b</think>c", WRITES, True, "a", "b</think>c"),
    ("<think>x</think>y", NONE, True, "", "<think>x</think>y"),
    ("x</think>y", NONE, True, "", "x</think>y"),
    ("a </thi nk> b</think>c", OPENS, True, "a </thi nk> b", "c"),
]


@pytest.mark.parametrize(("text", "fmt", "thinking", "reasoning", "content"), CASES)
def test_every_cut_of_the_text_splits_the_same(
    text: str, fmt: ThinkingFormat, thinking: bool, reasoning: str, content: str
) -> None:
    whole = split_text(text, fmt, thinking)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for size in range(1, len(text) + 1):
        got_reasoning, got_content, order = streamed(text, fmt, thinking, size)
        assert (got_reasoning, got_content) == (reasoning, content), size
        assert order == sorted(order, key=lambda kind: kind == "c"), size  # reasoning never after reply


def test_a_half_written_tag_is_held_back_until_it_is_decided() -> None:
    splitter = ThinkSplitter(OPENS, True)
    out = splitter.feed("thinking</th")
    assert (out.reasoning, out.content) == ("thinking", "")
    out = splitter.feed("ink>reply")
    assert (out.reasoning, out.content) == ("", "reply")
