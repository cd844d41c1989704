"""Gemma's turn format, for Gemma 3 files that carry no chat template (many GGUF conversions).

Each turn is `<start_of_turn>{role}\n{text}<end_of_turn>\n` with the roles `user` and `model` (an
assistant turn); the reply opens with `<start_of_turn>model\n` and ends at `<end_of_turn>`. Gemma
has no system role: a system prompt is put in front of the first user turn's text, separated by a
blank line, as Gemma's own template does. The BOS token is added by the tokenizer, not here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode

ARCHITECTURE = "Gemma3ForCausalLM"
START, END = "<start_of_turn>", "<end_of_turn>"
_ROLES = {"user": "user", "assistant": "model", "model": "model"}


def encode_gemma_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    system = ""
    parts: list[str] = []
    for index, message in enumerate(messages):
        role, text = message.get("role"), message.get("content") or ""
        if not isinstance(text, str):
            raise EngineFailure(ErrorCode.BAD_REQUEST, f"messages[{index}].content must be text")
        if role == "system":
            system += text
            continue
        if role not in _ROLES:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"messages[{index}].role {role!r} is not one Gemma knows"
            )
        if system and _ROLES[role] == "user":
            text, system = f"{system}\n\n{text}", ""
        parts.append(f"{START}{_ROLES[role]}\n{text.strip()}{END}\n")
    if add_generation_prompt:
        parts.append(f"{START}model\n")
    return "".join(parts)
