"""What a remote engine writes (request bodies, URLs) and how it reads odd but possible chunks."""

from __future__ import annotations

import json

import pytest

from ds4desk.engine.api import EngineFailure, FinishReason, GenerateRequest, SamplingParams, ThinkingBudget
from ds4desk.remote.config import base_url
from ds4desk.remote.protocol import chunk_parts, finish_of, models_of, request_body

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("typed", "base"),
    [
        ("http://gpu-box:8000/v1", "http://gpu-box:8000/v1"),
        ("http://gpu-box:8000/v1/", "http://gpu-box:8000/v1"),
        ("http://gpu-box:8000", "http://gpu-box:8000/v1"),
        ("localhost:11434", "http://localhost:11434/v1"),
        ("https://example.org/api/v1", "https://example.org/api/v1"),
        ("http://[::1]:8000", "http://[::1]:8000/v1"),
    ],
)
def test_base_urls(typed: str, base: str) -> None:
    assert base_url(typed) == base


def test_greedy_is_temperature_zero_and_sampling_is_sent_as_openai_names_it() -> None:
    greedy = request_body(GenerateRequest(messages=MESSAGES, max_new_tokens=9), "m", (), stream=True)
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "seed" not in greedy
    assert greedy["max_tokens"] == 9 and greedy["model"] == "m" and greedy["messages"] == MESSAGES
    # top_k of 1 is greedy too, whatever the temperature says.
    top_k_1 = GenerateRequest(messages=MESSAGES, sampling=SamplingParams(temperature=0.9, top_k=1))
    assert request_body(top_k_1, "m", (), stream=False)["temperature"] == 0.0
    sampled = request_body(
        GenerateRequest(
            messages=MESSAGES, sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=5)
        ),
        "m",
        ("###",),
        stream=False,
    )
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.7, 0.9, 40, 5)
    assert sampled["stop"] == ["###"] and "stream_options" not in sampled
    json.dumps(sampled, allow_nan=False)  # what goes on the wire is strict JSON


def test_prompts_other_than_messages_go_to_completions_and_thinking_asks_in_both_spellings() -> None:
    assert request_body(GenerateRequest(raw_text="Once"), "m", (), stream=True)["prompt"] == "Once"
    assert request_body(GenerateRequest(prompt_tokens=[1, 2]), "m", (), stream=True)["prompt"] == [1, 2]
    assert (
        request_body(GenerateRequest(raw_text="x", stop_tokens=[]), "m", (), stream=True)["ignore_eos"]
        is True
    )
    thinking = request_body(
        GenerateRequest(messages=MESSAGES, thinking=True, thinking_budget=ThinkingBudget(64, [])),
        "m",
        (),
        True,
    )
    assert thinking["chat_template_kwargs"]["thinking"] is True
    assert thinking["thinking"] == {"type": "enabled", "budget_tokens": 64}
    with pytest.raises(EngineFailure):
        request_body(GenerateRequest(), "m", (), stream=True)


def test_odd_but_possible_chunks() -> None:
    # Content as a list of parts; a second choice (not asked for) ignored; numbers where text goes ignored.
    parts = chunk_parts(
        {"choices": [
            {"index": 0, "delta": {"content": [{"type": "text", "text": "a"}, {"text": "b"}]}},
            {"index": 1, "delta": {"content": "other choice"}},
        ]},
        chat=True,
    )  # fmt: skip
    assert parts.content == "ab"
    assert chunk_parts({"choices": [{"index": 0, "delta": {"content": 12}}]}, chat=True).content == ""
    assert chunk_parts({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}, chat=True).reasoning == "hm"
    usage = chunk_parts({"usage": {"prompt_tokens": -4, "completion_tokens": 1e300}}, chat=True).usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (0, 0)
    for broken in ([], "text", {"choices": "nope"}, {"error": "overloaded"}):
        with pytest.raises(EngineFailure):
            chunk_parts(broken, chat=True)


def test_finish_reasons() -> None:
    assert finish_of("length") == FinishReason.LENGTH
    assert finish_of("abort") == FinishReason.CANCELLED
    assert {finish_of(r) for r in ("stop", "eos", "tool_calls", "content_filter", None)} == {
        FinishReason.STOP
    }


def test_model_lists_of_several_servers() -> None:
    vllm = {"object": "list", "data": [{"id": "deepseek-ai/DeepSeek-V4-Flash", "max_model_len": 65536}]}
    llama_cpp = {"data": [{"id": "smol.gguf", "meta": {"n_ctx_train": 8192}}]}
    ollama = {"object": "list", "data": [{"id": "qwen3:8b", "owned_by": "library"}, {"no": "id"}, {"id": 5}]}
    assert [(m.id, m.context) for m in models_of(vllm)] == [("deepseek-ai/DeepSeek-V4-Flash", 65536)]
    assert [(m.id, m.context) for m in models_of(llama_cpp)] == [("smol.gguf", 8192)]
    assert [(m.id, m.owned_by) for m in models_of(ollama)] == [("qwen3:8b", "library")]
    with pytest.raises(EngineFailure):
        models_of({"models": []})
