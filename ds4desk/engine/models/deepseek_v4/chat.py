"""DeepSeek-V4's chat format, for checkpoints that ship no Jinja chat template.

Layout (DeepSeek's encoding_dsv4): BOS, then each message in order: a system prompt as bare
text, a user turn as `<｜User｜>text`, an assistant turn as `[reasoning</think>]answer<EOS>`.
A user turn followed by an assistant turn (or ending the prompt) opens the reply with
`<｜Assistant｜>` and then `<think>` (thinking mode, last user turn only) or `</think>` (chat mode,
and every earlier turn). Earlier turns' reasoning is dropped, so only the reply to the last user
message carries it. Tool calls (DSML blocks) and the reasoning-effort preambles are not produced
here; the default effort ("low") adds no text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode

ARCHITECTURE = "DeepseekV4ForCausalLM"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
_USER_ROLES = ("user", "developer")


def _text(message: Mapping[str, Any], key: str, index: int) -> str:
    value = message.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise EngineFailure(ErrorCode.BAD_REQUEST, f"messages[{index}].{key} must be text")
    return value


def encode_deepseek_v4_chat(
    messages: Sequence[Mapping[str, Any]], thinking: bool = False, add_generation_prompt: bool = True
) -> str:
    """The prompt text (BOS included) for `messages` in DeepSeek-V4's official format. Without
    `add_generation_prompt` a trailing user turn gets no `<｜Assistant｜>` opener."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "user", "developer", "assistant"):
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"messages[{index}]: role {role!r} is not supported for DeepSeek-V4"
            )
    last_user = max((i for i, m in enumerate(messages) if m.get("role") in _USER_ROLES), default=-1)
    if thinking:
        # In thinking mode the reference drops developer turns before the last user turn.
        kept = [m for i, m in enumerate(messages) if m.get("role") != "developer" or i >= last_user]
        messages = kept
        last_user = max((i for i, m in enumerate(messages) if m.get("role") in _USER_ROLES), default=-1)

    prompt = BOS
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            prompt += _text(message, "content", index)
        elif role in _USER_ROLES:
            prompt += USER + _text(message, "content", index)
        else:
            # Only the reply after the last user turn keeps its reasoning (thinking mode).
            if thinking and index > last_user:
                prompt += _text(message, "reasoning_content", index) + THINK_END
            prompt += _text(message, "content", index) + EOS
        last = index + 1 == len(messages)
        following = None if last else messages[index + 1]["role"]
        if role in _USER_ROLES and (following == "assistant" or (last and add_generation_prompt)):
            prompt += ASSISTANT
            prompt += THINK_START if thinking and index >= last_user else THINK_END
    return prompt
