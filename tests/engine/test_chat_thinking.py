"""Which chat formats have a thinking mode (the window offers Think only for those), learned by
rendering: the built-in SmolLM2 (ChatML, none), DeepSeek-V4 (its prompt opens <think>), a
template with a thinking switch whose model writes <think> itself, and one that always opens it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode, ThinkingFormat
from ds4desk.engine.chat_template import ChatRenderer, ChatTemplate, probe_thinking
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.deepseek_v4.chat import encode_deepseek_v4_chat
from ds4desk.engine.models.gemma3.chat import encode_gemma_chat
from ds4desk.engine.tokenizer import ChatTokenizer

# The switch spelled the way Hugging Face templates spell it: thinking off writes an empty block.
SWITCHED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# A reasoning-only model's template: every reply opens <think>, whatever the switch says.
ALWAYS_OPEN = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)


def _jinja(source: str) -> ChatRenderer:
    template = ChatTemplate(source)

    def render(messages: list[dict[str, Any]], variables: Mapping[str, Any]) -> str:
        return template.render({"messages": messages, "add_generation_prompt": True, **variables})

    return render


def test_the_built_in_smollm2_has_no_thinking_mode() -> None:
    tokenizer = ChatTokenizer.from_source(read_source(default_model_path()))
    assert tokenizer.has_chat_template  # a real Jinja template, not the plain fallback
    found = probe_thinking(lambda m, v: tokenizer.render_chat(m, variables=v))
    assert found == ThinkingFormat(switch=False, opened_when_on=False, opened_when_off=False)
    assert not found.opened(True) and not found.opened(False)


def test_deepseek_v4_opens_the_thinking_in_its_prompt() -> None:
    found = probe_thinking(lambda m, v: encode_deepseek_v4_chat(m, bool(v["thinking"])))
    assert found.switch and found.opened(True) and not found.opened(False)


def test_gemma_has_no_thinking_mode() -> None:
    assert probe_thinking(lambda m, v: encode_gemma_chat(m)) == ThinkingFormat()


def test_a_switch_whose_model_writes_the_tag_itself() -> None:
    found = probe_thinking(_jinja(SWITCHED))
    assert found.switch
    assert not found.opened(True)  # the model writes <think>; the window must not add one
    assert not found.opened(False)  # the empty block is closed


def test_a_prompt_that_always_opens_thinking() -> None:
    found = probe_thinking(_jinja(ALWAYS_OPEN))
    assert not found.switch and found.opened(False) and found.opened(True)


def test_a_template_that_fails_the_probe_offers_no_thinking() -> None:
    def broken(messages: list[dict[str, Any]], variables: Mapping[str, Any]) -> str:
        raise EngineFailure(ErrorCode.BAD_REQUEST, "the model's chat template failed")

    assert probe_thinking(broken) == ThinkingFormat()
    assert probe_thinking(_jinja("{{ raise_exception('system role required') }}")) == ThinkingFormat()


def test_the_loaded_engine_reports_the_format() -> None:
    """Through the real engine: the embedded SmolLM2's ModelInfo says it has no thinking mode."""
    from ds4desk.engine.api import LoadRequest
    from ds4desk.engine.engine import Engine

    engine = Engine()
    try:
        result = engine.load(LoadRequest(device="cpu"))
        assert result.ok and result.info is not None
        assert result.info.thinking == ThinkingFormat()
    finally:
        engine.close()
