"""logprobs / top_logprobs: what the server answers today (a clear 400 while the engine has no hook
for them), and the two OpenAI layouts it will send once the engine does, checked by the official
`openai` package's own response types."""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ds4desk.server.shapes import chat_logprobs, completion_logprobs
from tests.server.conftest import API_KEY, Served


@dataclass(slots=True, frozen=True)
class Alt:  # the shape the engine hook is asked for (.notes/requests.md): api.TopLogprob
    token: int
    text: str
    logprob: float


@dataclass(slots=True, frozen=True)
class Entry:  # api.TokenLogprob
    token: int
    text: str
    logprob: float
    top: tuple[Alt, ...] = ()


ENTRIES = [
    Entry(10, "Hel", -0.25, (Alt(10, "Hel", -0.25), Alt(11, "Hi", -1.75))),
    Entry(12, "lo ", -0.5, (Alt(12, "lo ", -0.5), Alt(13, "lo", -1.0))),
    Entry(14, "wörld", -2.0, (Alt(15, "there", -0.75), Alt(14, "wörld", -2.0))),
]


def test_chat_layout_is_what_the_client_reads() -> None:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello wörld"},
                "logprobs": chat_logprobs(ENTRIES),
                "finish_reason": "stop",
            }
        ],
    }
    reply = ChatCompletion.model_validate(body)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [c.token for c in content] == ["Hel", "lo ", "wörld"]
    assert [c.logprob for c in content] == [-0.25, -0.5, -2.0]
    assert bytes(content[2].bytes or []).decode("utf-8") == "wörld"
    assert [(t.token, t.logprob) for t in content[2].top_logprobs] == [("there", -0.75), ("wörld", -2.0)]
    chunk = ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hel"},
                    "logprobs": chat_logprobs(ENTRIES[:1]),
                    "finish_reason": None,
                }
            ],
        }
    )
    assert chunk.choices[0].logprobs is not None and chunk.choices[0].logprobs.content is not None
    assert chunk.choices[0].logprobs.content[0].top_logprobs[1].token == "Hi"


def test_completions_layout_is_what_the_client_reads() -> None:
    layout = completion_logprobs(ENTRIES, offset=4)
    reply = Completion.model_validate(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": "Hello wörld", "logprobs": layout, "finish_reason": "stop"}],
        }
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["Hel", "lo ", "wörld"]
    assert logprobs.token_logprobs == [-0.25, -0.5, -2.0]
    assert logprobs.text_offset == [4, 7, 10]  # where each token starts in the text
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[2] == {"there": -0.75, "wörld": -2.0}


def test_chat_logprobs_of_each_token(server: Served) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(
        model="m", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(c.token for c in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": "yes"},
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": -1},
    ],
)
def test_malformed_logprobs_options_are_a_400(server: Served, extra: dict) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=extra
        )
    assert "logprobs" in str(refused.value)
