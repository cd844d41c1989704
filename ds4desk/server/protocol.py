"""The OpenAI chat and completions requests as ds4desk reads them, and OpenAI-shaped errors.

Every check happens here, before anything reaches the engine: a malformed request is answered with
the error object OpenAI's clients know how to show, never with a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ds4desk import strict_json
from ds4desk.engine.api import ErrorCode

MAX_TOKENS = 2**20  # far beyond any context, far below anything that overflows
MAX_SEED = 2**63 - 1  # the engine's generator takes a non-negative 64-bit seed
MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's completions API
MAX_TOKEN_ID = 2**31 - 1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An answer that is an error: HTTP status plus OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_of_engine(code: ErrorCode, detail: str) -> ApiError:
    """An engine error as the HTTP answer a client can act on (retry, shorten, give up)."""
    if code == ErrorCode.CONTEXT_OVERFLOW:
        return ApiError(400, detail, code="context_length_exceeded")
    if code == ErrorCode.BAD_REQUEST:
        return ApiError(400, detail)
    if code in (ErrorCode.MODEL_NOT_LOADED, ErrorCode.MODEL_PARKED, ErrorCode.LOAD_FAILED):
        return ApiError(503, detail, kind="server_error", code=str(code))
    return ApiError(500, detail, kind="server_error", code=str(code))


@dataclass(slots=True)
class GenerationParams:
    """What chat and plain completions share: length, sampling, stops, streaming, log-probabilities."""

    max_tokens: int | None  # None: as many as the context leaves (see generation.Generation)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: run to max_tokens
    # None: no log-probabilities; n: each token's own and its n most likely alternatives.
    logprobs: int | None = None
    # llama.cpp's `cache_prompt`: keep the state after the answer in a snapshot slot, so the next
    # turn of the same conversation continues from it instead of reading it all again (GET /slots).
    cache_prompt: bool = False


@dataclass(slots=True)
class ChatParams(GenerationParams):
    messages: list[dict[str, str]] = field(default_factory=list)
    thinking: bool = False  # the chat format's thinking mode (for models that have one)
    thinking_budget: int | None = None  # at most this many thinking tokens, then </think> is forced


@dataclass(slots=True)
class CompletionParams(GenerationParams):
    """Exactly one of `text` (tokenized as-is, nothing added) and `tokens` is the prompt."""

    text: str | None = None
    tokens: list[int] | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN or Infinity, no numbers that overflow to them, valid UTF-8, no lone
    surrogates), and an object at the top."""

    try:
        value = strict_json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8") from None
    except strict_json.StrictJsonError as exc:
        if exc.kind == "deep":
            raise bad("the request body is nested too deeply") from None
        if exc.kind == "invalid":
            raise bad(f"the request body is not valid JSON ({exc.detail})") from None
        raise bad(exc.detail) from None
    if not isinstance(value, dict):
        raise bad("the request body must be a JSON object")
    if strict_json.has_lone_surrogate(value):
        raise bad("a string holds a lone surrogate")
    return value


def parse_chat(body: dict[str, Any], context: int) -> ChatParams:
    """The fields ds4desk honours, checked; a field it cannot honour faithfully is refused rather
    than silently ignored (n > 1, tools). Other fields (user, metadata, ...) are ignored."""
    if body.get("tools") or body.get("functions"):
        raise bad("tools are not supported", "tools")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise bad("logprobs must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = _integer(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    thinking, budget = _thinking(body)
    return ChatParams(
        **_generation_fields(body, context),
        logprobs=(top or 0) if logprobs else None,
        messages=_messages(body.get("messages")),
        thinking=thinking,
        thinking_budget=budget,
    )


def parse_completion(body: dict[str, Any], context: int) -> CompletionParams:
    """POST /v1/completions: one prompt (a string, token ids, or a list holding one of them)."""
    if body.get("echo", False) is not False:
        raise bad("echo is not supported: the answer holds only the new text", "echo")
    if body.get("suffix"):
        raise bad("suffix (fill in the middle) is not supported", "suffix")
    if body.get("best_of", 1) != 1:
        raise bad("only best_of = 1 is supported", "best_of")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _integer(logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    text, tokens = _prompt(body.get("prompt"), context)
    return CompletionParams(**_generation_fields(body, context), logprobs=logprobs, text=text, tokens=tokens)


def _generation_fields(body: dict[str, Any], context: int) -> dict[str, Any]:
    if body.get("n", 1) != 1:
        raise bad("only n = 1 is supported", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _integer(max_tokens, "max_tokens", 1, min(MAX_TOKENS, context))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage must be true or false", "stream_options")
    seed = body.get("seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos must be true or false", "ignore_eos")
    cache_prompt = body.get("cache_prompt", False)
    if not isinstance(cache_prompt, bool):
        raise bad("cache_prompt must be true or false", "cache_prompt")
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    return {
        "cache_prompt": cache_prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0 if temperature is None else _number(temperature, "temperature", 0.0, 2.0),
        "top_p": 1.0 if top_p is None else _number(top_p, "top_p", 0.0, 1.0),
        "seed": None if seed is None else _integer(seed, "seed", 0, MAX_SEED),
        "stop": _stops(body.get("stop")),
        "stream": stream,
        "include_usage": include_usage,
        "ignore_eos": ignore_eos,
    }


def _thinking(body: dict[str, Any]) -> tuple[bool, int | None]:
    """Thinking on or off, and its budget. DeepSeek's own API spells it `thinking: {"type":
    "enabled" | "disabled"}`; vLLM and SGLang pass `chat_template_kwargs: {"thinking": true}` (or
    `enable_thinking`). `thinking.budget_tokens` (Anthropic's spelling) caps the thinking part.
    Off unless asked for, as the window's Think switch."""
    thinking = False
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        for name in ("thinking", "enable_thinking"):
            if name in kwargs:
                if not isinstance(kwargs[name], bool):
                    raise bad(f"chat_template_kwargs.{name} must be true or false", "chat_template_kwargs")
                thinking = kwargs[name]
    option = body.get("thinking")
    if option is None:
        return thinking, None
    if not isinstance(option, dict) or option.get("type") not in ("enabled", "disabled"):
        raise bad('thinking must be {"type": "enabled"} or {"type": "disabled"}', "thinking")
    budget = option.get("budget_tokens")
    if budget is not None:
        budget = _integer(budget, "thinking.budget_tokens", 0, MAX_TOKENS)
    enabled = option["type"] == "enabled"
    return enabled, budget if enabled else None


def _prompt(value: Any, context: int) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids). OpenAI also takes a list of prompts; only one is answered."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # ["text"] or [[1, 2, 3]]: one prompt in a list
    if isinstance(value, str):
        if not value:
            raise bad("prompt must not be empty", "prompt")
        return value, None
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        if len(value) > context:
            raise ApiError(
                400,
                f"the prompt has {len(value)} tokens; this model's context is {context}",
                param="prompt",
                code="context_length_exceeded",
            )
        if not all(0 <= v <= MAX_TOKEN_ID for v in value):
            raise bad("prompt token ids must be non-negative 32-bit integers", "prompt")
        return None, list(value)
    raise bad("prompt must be one string, one list of token ids, or a list holding one of them", "prompt")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object", where)
        role = message.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
        entry = {"role": _ROLES[role], "content": _content(message.get("content"), where)}
        reasoning = message.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            # DeepSeek-V4's format keeps the reasoning of a reply after the last user turn.
            if not isinstance(reasoning, str):
                raise bad(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
            entry["reasoning_content"] = reasoning
        messages.append(entry)
    return messages


def _content(value: Any, where: str) -> str:
    """A string, or OpenAI's list of parts of which ds4desk reads the text ones."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(f"{where}.content may hold only text parts", f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(stop, str) and 0 < len(stop) <= MAX_STOP_CHARS for stop in stops)
    ):
        raise bad(
            f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings "
            f"of at most {MAX_STOP_CHARS} characters",
            "stop",
        )
    return stops


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(f"{name} must be an integer in {low}..{high}, got {_shown(value)}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(f"{name} must be a number in {low:g}..{high:g}, got {_shown(value)}", name)
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
