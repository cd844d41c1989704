"""POST /v1/completions through the official `openai` client against a real `ds4desk serve`: the
answers are those `ds4desk generate --raw` (and `--prompt-tokens`) gives for the same prompt."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.server.conftest import API_KEY, Served, ds4desk
from tests.server.test_hostile_requests import assert_openai_error, send

RAW = "The three primary colours are"
TOKENS = 12


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def generated_raw(ds4_home: Path) -> dict:
    """What `ds4desk generate` answers greedily to RAW tokenized as-is."""
    out = ds4desk(
        "generate", "--device", "cpu", "--raw", RAW, "--max-tokens", str(TOKENS), "--json", home=ds4_home
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_string_prompt_is_answered_as_generate_raw(client: openai.OpenAI, generated_raw: dict) -> None:
    reply = client.completions.create(model="m", prompt=RAW, max_tokens=TOKENS, temperature=0)
    assert reply.object == "text_completion"
    assert reply.id.startswith("cmpl-")
    choice = reply.choices[0]
    assert choice.text == generated_raw["text"]
    assert choice.finish_reason == generated_raw["finish_reason"]
    assert choice.logprobs is None
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(generated_raw["prompt_tokens"])
    assert reply.usage.completion_tokens == generated_raw["stats"]["generated_tokens"]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_token_ids_and_a_one_string_list_give_the_same_answer(
    client: openai.OpenAI, generated_raw: dict
) -> None:
    ids = generated_raw["prompt_tokens"]
    for prompt in (ids, [ids], [RAW]):
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=TOKENS, temperature=0)
        assert reply.choices[0].text == generated_raw["text"], prompt
        assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)


def test_the_streamed_answer_is_the_same(client: openai.OpenAI, generated_raw: dict) -> None:
    stream = client.completions.create(
        model="m",
        prompt=RAW,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finishes, usages = [], [], []
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert len(pieces) > 2  # it did stream, piece by piece
    assert "".join(pieces) == generated_raw["text"]
    assert finishes == [generated_raw["finish_reason"]]
    assert len(usages) == 1 and usages[0].completion_tokens == generated_raw["stats"]["generated_tokens"]


def test_a_stop_string_cuts_the_answer(client: openai.OpenAI, generated_raw: dict) -> None:
    text = str(generated_raw["text"])
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[1]
    expected = text[: text.find(stop)]
    reply = client.completions.create(model="m", prompt=RAW, max_tokens=TOKENS, temperature=0, stop=stop)
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="m", prompt=RAW, max_tokens=TOKENS, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_a_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model="m", prompt=RAW, max_tokens=8, temperature=1.5, top_p=0.95, seed=seed
        )
        return reply.choices[0].text

    first = sample(5)
    assert first and sample(5) == first


def test_logprobs_of_a_completion(client: openai.OpenAI, generated_raw: dict) -> None:
    reply = client.completions.create(model="m", prompt=RAW, max_tokens=4, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    for own, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 2 and own <= 0.0
        assert own == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the sampled one leads


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"prompt": RAW, "echo": True}, "echo"),
        ({"prompt": RAW, "suffix": "end"}, "suffix"),
        ({"prompt": RAW, "best_of": 3}, "best_of"),
        ({"prompt": RAW, "n": 2}, "n = 1"),
        ({"prompt": [RAW, RAW]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 2**40]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": RAW, "logprobs": 6}, "logprobs"),
        ({"prompt": RAW, "logprobs": "yes"}, "logprobs"),
        ({"prompt": RAW, "max_tokens": 0}, "max_tokens"),
        ({"prompt": RAW, "temperature": -1}, "temperature"),
        ({"prompt": [5] * 5000}, "context"),
        ({"prompt": [10**9]}, "vocabulary"),
        ({}, "prompt"),
    ],
)
def test_a_malformed_completion_request_is_a_400(server: Served, body: dict, mentions: str) -> None:
    status, answer = send(server, "POST", "/v1/completions", json.dumps({"max_tokens": 2, **body}).encode())
    assert_openai_error(status, answer, 400, mentions)


def test_completions_need_the_key(server: Served) -> None:
    status, answer = send(server, "POST", "/v1/completions", json.dumps({"prompt": RAW}).encode(), key=None)
    assert_openai_error(status, answer, 401, "API key")
