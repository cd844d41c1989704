"""A server whose context is smaller than the default answer length: without max_tokens the answer
runs to the end of the context; with one that does not fit, the client hears why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import API_KEY, Served, serving

CONTEXT = 64


@pytest.fixture(scope="module")
def small(ds4_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("serve-small") / "stderr.txt"
    with serving(ds4_home, log, "--context", str(CONTEXT)) as served:
        yield served


def test_without_max_tokens_the_answer_fills_the_context(small: Served) -> None:
    client = openai.OpenAI(base_url=small.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        temperature=0,
        extra_body={"ignore_eos": True},  # so it can only end where the context does
    )
    assert reply.usage is not None
    assert reply.usage.total_tokens == CONTEXT
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content


def test_a_prompt_longer_than_the_context_is_a_400(small: Served) -> None:
    client = openai.OpenAI(base_url=small.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    long_prompt = "word " * 200
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": long_prompt}], max_tokens=4, stream=stream
            )
        assert refused.value.code == "context_length_exceeded"
