"""The official `openai` package against a real `ds4desk serve`: the answers are the engine's own."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import urllib.request

import openai
import pytest

from tests.server.conftest import API_KEY, MAX_TOKENS, PROMPT, Served

MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)


def test_models_lists_the_loaded_model(client: openai.OpenAI, server: Served) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == [server.model]
    assert server.model.startswith("SmolLM2")


def test_greedy_answer_equals_ds4desk_generate(client: openai.OpenAI, generated: dict) -> None:
    reply = client.chat.completions.create(
        model="anything", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == generated["text"]
    assert choice.finish_reason == generated["finish_reason"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == generated["stats"]["prompt_tokens"] == len(generated["prompt_tokens"])
    assert reply.usage.completion_tokens == generated["stats"]["generated_tokens"]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_answer_equals_ds4desk_generate(client: openai.OpenAI, generated: dict) -> None:
    stream = client.chat.completions.create(
        model="anything",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finishes, usages = [], [], []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert "".join(pieces) == generated["text"]
    assert finishes == [generated["finish_reason"]]
    assert len(usages) == 1
    assert usages[0].prompt_tokens == generated["stats"]["prompt_tokens"]
    assert usages[0].completion_tokens == generated["stats"]["generated_tokens"]


def test_stop_string_cuts_the_answer(client: openai.OpenAI, generated: dict) -> None:
    text = str(generated["text"])
    words = text.split()
    assert len(words) >= 4, text
    stop = " " + words[2]  # a stop string from the middle of the answer, across token pieces or not
    expected = text[: text.find(stop)]
    reply = client.chat.completions.create(
        model="anything", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "never-said"]
    )
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="anything", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]


def test_a_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        reply = client.chat.completions.create(
            model="anything", messages=MESSAGES, max_tokens=8, temperature=1.5, top_p=0.95, seed=seed
        )
        return reply.choices[0].message.content

    first = sample(11)
    assert first and sample(11) == first


def test_bad_requests_raise_the_clients_own_errors(client: openai.OpenAI, server: Served) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=-5)
    assert refused.value.status_code == 400
    assert "max_tokens" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as overflow:
        client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=4096)
    assert "context" in str(overflow.value)
    wrong_key = openai.OpenAI(base_url=server.base_url, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def health(server: Served) -> dict:
    with urllib.request.urlopen(f"{server.root}/health", timeout=30) as answer:
        return json.load(answer)


def test_a_client_that_leaves_mid_stream_cancels_its_answer(client: openai.OpenAI, server: Served) -> None:
    """A 4000-token answer (ignore_eos: it cannot end early) is abandoned after its first event. The
    next request queues behind it on the one engine thread, so when that one is answered the engine
    is done with the first: it must have stopped far short of its 4000 tokens."""
    before = health(server)["served"]
    connection = http.client.HTTPConnection(server.host, server.port, timeout=300)
    body = {"messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    connection.close()  # leaves mid-answer
    reply = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage is not None
    after = health(server)
    assert after["requests"] == 0
    assert after["served"]["cancelled"] == before["cancelled"] + 1
    assert after["served"]["answers"] == before["answers"] + 1
    abandoned = (
        after["served"]["generated_tokens"] - before["generated_tokens"] - reply.usage.completion_tokens
    )
    assert 1 <= abandoned < 4000


def test_concurrent_clients_each_get_their_own_answer(client: openai.OpenAI) -> None:
    """Requests queue behind the one engine thread: at temperature 0 each concurrent answer equals
    the one the same request gets alone, none crossed with another's stream."""
    prompts = ["Say hello.", "What is the capital of Italy?", "Count to five."]

    def ask(prompt: str, stream: bool) -> str:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
            return reply.choices[0].message.content or ""
        chunks = client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = {prompt: ask(prompt, stream=False) for prompt in prompts}
    assert len(set(alone.values())) == len(prompts)  # different answers, so a crossing would show
    jobs = [(prompt, stream) for prompt in prompts for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(*job), jobs))
    assert answers == [alone[prompt] for prompt, _stream in jobs]


def test_a_client_that_leaves_before_a_plain_answer_cancels_it(client: openai.OpenAI, server: Served) -> None:
    """The same without streaming: the client leaves while its answer is being written."""
    before = health(server)["served"]
    body = {"messages": MESSAGES, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    connection = http.client.HTTPConnection(server.host, server.port, timeout=300)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    for _ in range(600):  # until the server holds it (no answer can come before 4000 tokens)
        if health(server)["requests"] >= 1:
            break
        time.sleep(0.1)
    connection.close()  # leaves without reading a byte
    reply = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=4, temperature=0)
    assert reply.usage is not None
    after = health(server)
    assert after["requests"] == 0
    assert after["served"]["cancelled"] == before["cancelled"] + 1
    abandoned = (
        after["served"]["generated_tokens"] - before["generated_tokens"] - reply.usage.completion_tokens
    )
    assert 0 <= abandoned < 4000
