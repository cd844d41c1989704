"""Gemma's built-in turn format, for Gemma 3 files without a chat template (the real Gemma-3-270M GGUF)."""

from __future__ import annotations

import pytest

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.gemma3.chat import encode_gemma_chat
from ds4desk.engine.tokenizer import ChatTokenizer
from tests.real_models import gemma3_gguf


def test_turns_roles_and_the_system_prompt() -> None:
    text = encode_gemma_chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Capital of France?"},
        ]
    )
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert not encode_gemma_chat([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "model\n"
    )
    with pytest.raises(EngineFailure) as exc:
        encode_gemma_chat([{"role": "tool", "content": "x"}])
    assert exc.value.error.code == ErrorCode.BAD_REQUEST and "'tool'" in exc.value.error.detail


def test_a_gguf_without_a_template_gets_the_gemma_format() -> None:
    source = read_source(gemma3_gguf())
    assert source.chat_template is None
    tok = ChatTokenizer.from_source(source)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    start, end = tok.token_id("<start_of_turn>"), tok.token_id("<end_of_turn>")
    # One BOS, the turn markers as single special tokens, the reply opened for the model.
    assert ids[:2] == [tok.token_id("<bos>"), start] and ids.count(start) == 2 and ids.count(end) == 1
    assert tok.decode(ids[-3:], skip_special_tokens=False) == "<start_of_turn>model\n"
    assert end in tok.stop_ids and "built-in Gemma chat format" in tok.describe()
