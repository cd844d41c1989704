"""A Qwen3.5 folder as the app meets it: the engine's greedy tokens against transformers'
generate, `ds4desk generate` and `ds4desk check` on it, a chat follow-up served from the snapshot
of the previous turn, and a Qwen-style chat template with its thinking switch rendered in the
sandbox."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds4desk.cli import main as cli_main
from ds4desk.engine import Engine, GenerateRequest, LoadRequest
from ds4desk.engine.api import FinishReason, SamplingParams, SaveSnapshot
from ds4desk.engine.loading import detect
from ds4desk.engine.preflight import check_model
from ds4desk.engine.tokenizer import ChatTokenizer
from tests.engine.models.qwen3_5.tiny import SPECIAL, TINY, save_tiny

IDS = {name: i for i, name in enumerate(SPECIAL)}

# A chat format in the style of Qwen's (written for these tests): <|im_start|>role ... <|im_end|>
# turns; earlier answers lose their thinking; the generation prompt opens <think> when thinking is
# on (the default) and writes an empty thinking block when it is off.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}"
    "{{- '<think>\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},
    {"role": "user", "content": "How are you?"},
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("qwen3_5-folder")
    hf, _ = save_tiny(folder, seed=11, chat_template=CHAT_TEMPLATE)
    return hf, folder


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine()
    yield engine
    engine.close()


def greedy_reference(hf: torch.nn.Module, ids: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_the_chat_template_and_its_thinking_switch_render_in_the_sandbox(saved) -> None:
    _, folder = saved
    source = detect.read_source(folder)
    assert source.architecture == "Qwen3_5ForCausalLM" and source.chat_template is not None
    tokenizer = ChatTokenizer.from_source(source)
    assert tokenizer.template is not None and tokenizer.template.ok
    thinking = tokenizer.render_chat(MESSAGES, variables={"enable_thinking": True})
    assert thinking == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    plain = tokenizer.render_chat(MESSAGES, variables={"enable_thinking": False})
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids.count(IDS["<|im_start|>"]) == 5 and ids.count(IDS["<|im_end|>"]) == 4
    assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.render_chat(MESSAGES)
    assert IDS["<|im_end|>"] in tokenizer.stop_ids and IDS["<|im_start|>"] not in tokenizer.stop_ids


def test_the_engine_reports_the_thinking_format(saved, engine: Engine) -> None:
    _, folder = saved
    info = engine.load(LoadRequest(path=str(folder), device="cpu", dtype="float32", context=256))
    assert info.ok and info.info is not None
    assert (info.info.family, info.info.architecture) == ("qwen3_5", "Qwen3_5ForCausalLM")
    assert info.info.thinking.switch and info.info.thinking.opened_when_on
    assert not info.info.thinking.opened_when_off


def test_engine_greedy_generation_matches_transformers(saved, engine: Engine) -> None:
    hf, folder = saved
    ids = [(i * 53 + 7) % 290 + 5 for i in range(37)]
    assert engine.load(LoadRequest(path=str(folder), device="cpu", dtype="float32", context=256, chunk=16)).ok
    result = engine.generate(
        GenerateRequest(prompt_tokens=ids, sampling=SamplingParams(), max_new_tokens=20, stop_tokens=[])
    )
    assert result.ok and result.finish_reason == FinishReason.LENGTH
    assert result.tokens == greedy_reference(hf, ids, 20)


def test_a_chat_follow_up_is_served_from_the_last_turns_snapshot(saved, engine: Engine) -> None:
    _, folder = saved
    assert engine.load(LoadRequest(path=str(folder), device="cpu", dtype="float32", context=256)).ok
    chat = MESSAGES[:2]
    first = engine.generate(
        GenerateRequest(messages=chat, max_new_tokens=8, stop_tokens=[], save_snapshot=SaveSnapshot())
    )
    assert first.ok and first.snapshot_slot is not None
    follow = [*chat, {"role": "assistant", "content": first.text}, {"role": "user", "content": "More?"}]
    # The next prompt, as tokens: what the snapshot's positions hold, then the new turn.
    prompt = [*first.prompt_tokens, *first.tokens[:-1]]
    tokens = [*prompt, IDS["<|im_end|>"], 10, 11, 12]
    warm = engine.generate(GenerateRequest(prompt_tokens=tokens, max_new_tokens=6, stop_tokens=[]))
    cold = engine.generate(
        GenerateRequest(prompt_tokens=tokens, max_new_tokens=6, stop_tokens=[], use_snapshots=False)
    )
    assert warm.stats.reused_tokens == len(prompt) and warm.stats.prefill_tokens == 4
    assert cold.stats.reused_tokens == 0 and warm.tokens == cold.tokens
    rendered = engine.generate(GenerateRequest(messages=follow, max_new_tokens=2, stop_tokens=[]))
    assert rendered.ok  # the rendered follow-up (the template drops nothing here) runs too


def test_ds4desk_generate_prints_transformers_greedy_tokens(saved, tmp_path: Path, capsys) -> None:
    hf, folder = saved
    ids = [(i * 31 + 3) % 290 + 5 for i in range(12)]
    code = cli_main(
        [
            "--data-dir", str(tmp_path), "generate", str(folder), "--prompt-tokens", ",".join(map(str, ids)),
            "--max-tokens", "10", "--device", "cpu", "--dtype", "float32", "--context", "128", "--json",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = greedy_reference(hf, ids, 10)
    stops = {IDS["<|im_end|>"], IDS["<|endoftext|>"]}
    assert not stops & set(expected)  # else the CLI would rightly stop early and prove less
    assert result["tokens"] == expected


def test_ds4desk_check_reports_the_folder(saved) -> None:
    hf, folder = saved
    report = check_model(folder)
    assert (report.family, report.architecture) == ("qwen3_5", "Qwen3_5ForCausalLM")
    assert report.has_chat_template and report.context_length == TINY["max_position_embeddings"]
    assert report.parameters == hf.num_parameters()
    assert "qwen3_5 family" in report.describe()
    # Two full layers keep keys and values for every position; four linear layers a fixed state
    # (a 3-input conv window over 80 channels and four 8 x 12 float32 matrices).
    assert report.memory is not None
    context = report.memory.context
    full = 2 * (2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4) * context
    linear = 4 * (80 * 3 * 4 + 4 * 8 * 12 * 4)
    assert report.memory.cache_bytes == full + linear
