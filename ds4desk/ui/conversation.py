"""What the window's answers are made of, apart from the widgets: the answer being written, the
note under a message, and the conversation sent to the model."""

from __future__ import annotations

from dataclasses import dataclass

from ds4desk.engine.api import FinishReason
from ds4desk.history import History, Message, StreamingWriter
from ds4desk.ui.chat_view import NoteKind
from ds4desk.ui.markdown_render import split_thinking
from ds4desk.ui.stats_format import stats_footer


@dataclass(slots=True)
class Generation:
    """The answer being written: its chat may not be the one on screen (the user can switch)."""

    chat_id: int
    request_id: int
    writer: StreamingWriter
    thinking_tokens: int = 0  # streamed inside <think>…</think>
    think_tag_pending: bool = False  # thinking mode: the prompt opened <think>, the text will not


def message_note(message: Message) -> tuple[str | None, NoteKind]:
    """What to say under an assistant message: how a finished one went (speed, reuse), or why an
    unfinished one stopped."""
    if message.role != "assistant":
        return None, NoteKind.INFO
    stats = message.stats or {}
    reason = stats.get("finish_reason")
    if message.finished:
        lines = [stats_footer(stats)]
        if reason == FinishReason.LENGTH:
            lines.insert(0, "Stopped at the length limit (max new tokens).")
        return "\n".join(line for line in lines if line) or None, NoteKind.INFO
    if reason == FinishReason.CANCELLED:
        return "Stopped.", NoteKind.INFO
    if reason == FinishReason.ERROR:
        error = stats.get("error") or {}
        detail = error.get("detail") or error.get("code") or "unknown error"
        return f"Generation failed: {detail}", NoteKind.ERROR
    return "Interrupted: ds4desk closed before this answer finished.", NoteKind.WARNING


def conversation(
    history: History, chat_id: int, system_prompt: str, until: int | str | None = None
) -> list[dict[str, str]]:
    """The active branch as chat messages, the system prompt first; `until`: stop after that
    message (regenerate answers the question again, without the old answer)."""
    messages: list[dict[str, str]] = []
    if system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt})
    branch = history.messages(chat_id)
    if isinstance(until, int):
        ids = [m.id for m in branch]
        branch = branch[: ids.index(until) + 1] if until in ids else branch
    for message in branch:
        content = message.content
        if message.role == "assistant":
            # Earlier reasoning is not sent back: models are trained without it in the context.
            content = split_thinking(content)[1]
        if content.strip():
            messages.append({"role": message.role, "content": content})
    return messages
