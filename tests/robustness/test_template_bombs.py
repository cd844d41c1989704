"""Chat templates that try to take the machine's memory: each is refused with a clear error before
the string it asks for exists, and the same sandbox still renders an ordinary template afterwards."""

from __future__ import annotations

import tracemalloc

import pytest

from ds4desk.engine.api import EngineFailure
from ds4desk.engine.chat_template import ChatTemplate
from tests.robustness.hostile_files import TEMPLATE_BOMBS

BOMBS = TEMPLATE_BOMBS
MESSAGES = {"messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("source", BOMBS.values(), ids=BOMBS.keys())
def test_a_memory_bomb_is_refused_before_it_is_built(source: str) -> None:
    template = ChatTemplate(source)
    tracemalloc.start()
    try:
        with pytest.raises(EngineFailure, match="chat template"):
            template.render(MESSAGES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 400 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_ordinary_templates_still_render() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{{ '<|' ~ m['role'] ~ '|>' }}{{ m['content']|trim|center(12) }}"
        "{{ '%s;' % m['role'] }}{{ '{}!'.format(m['role']) }}{% endfor %}"
    )
    assert template.render(MESSAGES) == "<|user|>   hello    user;user!"
    # A long chat accumulated in a namespace string (quadratic, as some templates do) still fits.
    long_chat = {"messages": [{"role": "user", "content": "x" * 40_000}] * 100}
    accumulate = ChatTemplate(
        "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s + m['content'] %}"
        "{% endfor %}{{ ns.s|length }}"
    )
    assert accumulate.render(long_chat) == "4000000"
