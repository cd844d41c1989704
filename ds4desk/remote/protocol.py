"""The OpenAI API's shapes as a remote engine writes and reads them: request bodies from a
GenerateRequest, the pieces of a streamed chunk, the model list. Everything read is checked: a
server is another program, and what it sends is data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode, FinishReason, GenerateRequest
from ds4desk.remote.http import error_message

CHAT_PATH = "/chat/completions"
COMPLETIONS_PATH = "/completions"
MODELS_PATH = "/models"


@dataclass(slots=True, frozen=True)
class RemoteModel:
    id: str
    context: int = 0  # 0 where the server does not say (vLLM says max_model_len)
    owned_by: str = ""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class ChunkParts:
    """What one streamed chunk (or one whole answer) carries."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


def uses_chat(request: GenerateRequest) -> bool:
    """Messages go to /chat/completions; raw text and token ids to /completions (no template)."""
    return request.messages is not None


def request_body(request: GenerateRequest, model: str, stop: tuple[str, ...], stream: bool) -> dict[str, Any]:
    sampling = request.sampling
    body: dict[str, Any] = {"model": model, "max_tokens": request.max_new_tokens, "stream": stream}
    if request.messages is not None:
        body["messages"] = [dict(message) for message in request.messages]
    elif request.raw_text is not None:
        body["prompt"] = request.raw_text
    elif request.prompt_tokens is not None:
        body["prompt"] = list(request.prompt_tokens)  # token ids: vLLM, SGLang, llama.cpp, ds4desk
    else:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "the request has no prompt")
    if stream:
        body["stream_options"] = {"include_usage": True}
    body["temperature"] = 0.0 if sampling.greedy else float(sampling.temperature)
    if not sampling.greedy and sampling.top_p < 1.0:
        body["top_p"] = float(sampling.top_p)
    if not sampling.greedy and sampling.top_k > 0:
        body["top_k"] = int(sampling.top_k)  # not OpenAI's own; vLLM, SGLang, llama.cpp, Ollama take it
    if sampling.seed is not None:
        body["seed"] = int(sampling.seed)
    if stop:
        body["stop"] = list(stop)
    if request.stop_tokens == []:
        body["ignore_eos"] = True  # "never stop at the end token": vLLM's, llama.cpp's, ds4desk's spelling
    if request.thinking and request.messages is not None:
        # The switch of the chat template, in the spellings of vLLM / SGLang (Qwen3 reads
        # enable_thinking, DeepSeek thinking) and of DeepSeek's own API.
        body["chat_template_kwargs"] = {"thinking": True, "enable_thinking": True}
        thinking: dict[str, Any] = {"type": "enabled"}
        if request.thinking_budget is not None:
            thinking["budget_tokens"] = request.thinking_budget.max_tokens
        body["thinking"] = thinking
    return body


def chunk_parts(data: Any, chat: bool) -> ChunkParts:
    """The pieces of one chunk (streamed) or one whole answer; raises on an error object or a shape
    that is no chunk at all."""
    if not isinstance(data, dict):
        raise EngineFailure(ErrorCode.DECODE_FAILED, "the server sent an event that is not a JSON object")
    if "error" in data or data.get("object") == "error":
        message, code = error_message(data)
        lowered = f"{message} {code}".lower()
        kind = (
            ErrorCode.CONTEXT_OVERFLOW
            if "context" in lowered and "length" in lowered
            else ErrorCode.DECODE_FAILED
        )
        raise EngineFailure(kind, f"the server reported an error: {message or code or 'no message'}")
    parts = ChunkParts(usage=_usage(data.get("usage")))
    choices = data.get("choices")
    if choices is None:
        return parts  # the usage-only chunk at the end
    if not isinstance(choices, list):
        raise EngineFailure(ErrorCode.DECODE_FAILED, "the server sent a chunk whose choices are not a list")
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue  # only the first choice is asked for
        source = choice.get("delta") if "delta" in choice else choice.get("message")
        if chat and isinstance(source, dict):
            parts.content += _text(source.get("content"))
            # DeepSeek's and ds4desk's reasoning_content; vLLM's newer and Ollama's reasoning.
            parts.reasoning += _text(source.get("reasoning_content")) or _text(source.get("reasoning"))
        elif not chat:
            parts.content += _text(choice.get("text"))
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            parts.finish_reason = reason
    return parts


def finish_of(reason: str | None) -> FinishReason:
    if reason == "length":
        return FinishReason.LENGTH
    if reason in ("abort", "cancelled"):  # SGLang's and vLLM's word for an answer stopped on their side
        return FinishReason.CANCELLED
    return FinishReason.STOP  # stop, eos, content_filter, tool_calls: the answer ended on its own


def models_of(data: Any) -> list[RemoteModel]:
    """GET /v1/models: {"data": [{"id", ...}]}; Ollama and llama.cpp add fields, which are ignored."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise EngineFailure(
            ErrorCode.DECODE_FAILED, "the server's model list is not OpenAI's {\"data\": [...]}"
        )
    models = []
    for entry in entries[:1000]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            continue
        context = entry.get("max_model_len") or entry.get("context_length") or 0
        if isinstance(entry.get("meta"), dict):  # llama.cpp's server
            context = context or entry["meta"].get("n_ctx_train") or 0
        owned = entry.get("owned_by")
        models.append(
            RemoteModel(
                entry["id"][:512],
                context if isinstance(context, int) and 0 < context < 2**40 else 0,
                owned[:128] if isinstance(owned, str) else "",
            )
        )
    return models


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: [{"type": "text", "text": ...}]
        return "".join(p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _usage(value: Any) -> Usage | None:
    if not isinstance(value, dict):
        return None
    details = value.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(_count(value.get("prompt_tokens")), _count(value.get("completion_tokens")), _count(cached))


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return int(value) if 0 <= value < 2**53 else 0
