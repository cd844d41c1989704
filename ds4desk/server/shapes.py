"""The JSON bodies OpenAI's clients expect: chat completions and (legacy) completions, whole and as
stream chunks, usage, and the two log-probability layouts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ds4desk.engine.api import GenerateResult
from ds4desk.server.generation import Finished, Generation

# Log-probability entries come from the engine (api.TokenLogprob: token, text, logprob, top; each of
# `top` has token, text, logprob). Read by attribute, so this module needs nothing more of them.


def usage(result: GenerateResult) -> dict[str, int]:
    # Every token the model produced counts, its end-of-turn token and any past a stop string too.
    prompt, completion = result.stats.prompt_tokens, result.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- chat ---------------------------------------------------------------------------------------


def chat_completion(
    generation: Generation, model: str, done: Finished, wants_logprobs: bool
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.content}
    if done.reasoning:
        message["reasoning_content"] = done.reasoning  # DeepSeek's field for the thinking part
    choice = {
        "index": 0,
        "message": message,
        "logprobs": chat_logprobs(done.logprobs) if wants_logprobs else None,
        "finish_reason": done.finish_reason,
    }
    return {
        "id": generation.id,
        "object": "chat.completion",
        "created": generation.created,
        "model": model,
        "choices": [choice],
        "usage": usage(done.result),
    }


def chat_chunk(
    generation: Generation,
    model: str,
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: Sequence[Any] | None = None,
) -> str:
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs) if logprobs else None,
        "finish_reason": finish,
    }
    body = {
        "id": generation.id,
        "object": "chat.completion.chunk",
        "created": generation.created,
        "model": model,
        "choices": [choice],
    }
    return sse(body)


def chat_usage_chunk(generation: Generation, model: str, result: GenerateResult) -> str:
    body = {
        "id": generation.id,
        "object": "chat.completion.chunk",
        "created": generation.created,
        "model": model,
        "choices": [],
        "usage": usage(result),
    }
    return sse(body)


def chat_logprobs(entries: Sequence[Any]) -> dict[str, Any]:
    def one(entry: Any) -> dict[str, Any]:
        text = str(entry.text)
        return {"token": text, "logprob": float(entry.logprob), "bytes": list(text.encode("utf-8"))}

    content = [{**one(entry), "top_logprobs": [one(alt) for alt in entry.top]} for entry in entries]
    return {"content": content, "refusal": None}


# ---- completions --------------------------------------------------------------------------------


def text_completion(
    generation: Generation, model: str, done: Finished, wants_logprobs: bool
) -> dict[str, Any]:
    choice = {
        "text": done.content,
        "index": 0,
        "logprobs": completion_logprobs(done.logprobs) if wants_logprobs else None,
        "finish_reason": done.finish_reason,
    }
    return {
        "id": generation.id,
        "object": "text_completion",
        "created": generation.created,
        "model": model,
        "choices": [choice],
        "usage": usage(done.result),
    }


def text_chunk(
    generation: Generation,
    model: str,
    text: str,
    finish: str | None = None,
    logprobs: Sequence[Any] | None = None,
    offset: int = 0,
) -> str:
    choice = {
        "text": text,
        "index": 0,
        "logprobs": completion_logprobs(logprobs, offset) if logprobs else None,
        "finish_reason": finish,
    }
    body = {
        "id": generation.id,
        "object": "text_completion",
        "created": generation.created,
        "model": model,
        "choices": [choice],
    }
    return sse(body)


def text_usage_chunk(generation: Generation, model: str, result: GenerateResult) -> str:
    body = {
        "id": generation.id,
        "object": "text_completion",
        "created": generation.created,
        "model": model,
        "choices": [],
        "usage": usage(result),
    }
    return sse(body)


def completion_logprobs(entries: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """The completions API's layout: parallel lists, and where each token starts in the text."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = str(entry.text)
        tokens.append(text)
        logprobs.append(float(entry.logprob))
        tops.append({str(alt.text): float(alt.logprob) for alt in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
