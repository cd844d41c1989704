"""A request's prompt as token ids, and a generated token's log-probability entry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds4desk.engine.api import EngineFailure, ErrorCode, GenerateRequest, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from ds4desk.engine.runtime import Scored
    from ds4desk.engine.tokenizer import ChatTokenizer


def token_logprob(tokenizer: ChatTokenizer, token: int, scored: Scored) -> TokenLogprob:
    logprob, top = scored

    def text(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)

    alternatives = tuple(TopLogprob(i, text(i), value) for i, value in top)
    return TokenLogprob(token, text(token), logprob, alternatives)


def prompt_ids(request: GenerateRequest, tokenizer: ChatTokenizer) -> list[int]:
    given = [x is not None for x in (request.prompt_tokens, request.messages, request.raw_text)]
    if sum(given) != 1:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "give exactly one of prompt_tokens, messages or raw_text")
    if request.max_new_tokens < 1:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "max_new_tokens must be at least 1")
    if request.prompt_tokens is not None:
        ids = list(request.prompt_tokens)  # the runtime checks them against the model's vocabulary
    elif request.messages is not None:
        thinking = request.thinking or request.thinking_budget is not None
        # Both spellings: our DeepSeek-V4 encoder and Hugging Face templates (enable_thinking).
        ids = tokenizer.encode_chat(
            request.messages, variables={"thinking": thinking, "enable_thinking": thinking}
        )
    else:
        ids = tokenizer.encode(request.raw_text or "")
    if not ids:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
    return ids
