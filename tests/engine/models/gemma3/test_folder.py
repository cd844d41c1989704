"""A Gemma 3 folder as the app meets it: its chat template rendered in the sandbox, <end_of_turn>
stopping generation through the engine, and the preflight / `ds4desk check` reports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds4desk.engine import Engine, GenerateRequest, LoadRequest
from ds4desk.engine.api import FinishReason
from ds4desk.engine.loading import detect
from ds4desk.engine.preflight import check_model, preview_model
from ds4desk.engine.tokenizer import ChatTokenizer
from tests.engine.models.gemma3.tiny import SPECIAL, TINY, make_hf_model, save_tiny, write_tokenizer

IDS = {name: i for i, name in enumerate(SPECIAL)}
END_OF_TURN = IDS["<end_of_turn>"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! "},
    {"role": "user", "content": "How are you?"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma3-folder")
    save_tiny(out, "tiny")
    return out


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = Engine()
    yield engine
    engine.close()


def test_the_chat_template_renders_in_the_sandbox(folder: Path) -> None:
    source = detect.read_source(folder)
    assert source.architecture == "Gemma3ForCausalLM" and source.chat_template is not None
    tokenizer = ChatTokenizer.from_source(source)
    assert tokenizer.template is not None and tokenizer.template.ok
    text = tokenizer.render_chat(MESSAGES)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids[0] == IDS["<bos>"] and ids.count(IDS["<bos>"]) == 1  # the template's own, not doubled
    assert ids.count(IDS["<start_of_turn>"]) == 4 and ids.count(END_OF_TURN) == 3
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert not tokenizer.render_chat(MESSAGES[:2], add_generation_prompt=False).endswith("model\n")


def test_end_of_turn_is_a_stop_token(folder: Path) -> None:
    tokenizer = ChatTokenizer.from_source(detect.read_source(folder))
    assert {IDS["<eos>"], END_OF_TURN} <= tokenizer.stop_ids
    assert IDS["<start_of_turn>"] not in tokenizer.stop_ids


def test_the_engine_stops_at_end_of_turn(tmp_path: Path, engine: Engine) -> None:
    """End to end: a chat request rendered by the template, and a model whose greedy reply begins
    with <end_of_turn> (its head rows swapped with the token it would have said) stops there."""
    request = LoadRequest(path=str(tmp_path / "a"), device="cpu", context=64)
    hf = make_hf_model("tiny", seed=7, tie_word_embeddings=False)  # a head of its own: inputs unchanged
    hf.save_pretrained(tmp_path / "a")
    write_tokenizer(tmp_path / "a", TINY["vocab_size"])
    assert engine.load(request).ok
    free = engine.generate(GenerateRequest(messages=MESSAGES[1:2], max_new_tokens=3, stop_tokens=[]))
    assert free.ok and free.finish_reason == FinishReason.LENGTH and len(free.tokens) == 3
    assert free.prompt_tokens[:2] == [IDS["<bos>"], IDS["<start_of_turn>"]]
    said = free.tokens[0]
    assert said != END_OF_TURN  # seed 7's first word; otherwise the swap below proves nothing

    with torch.no_grad():
        head = hf.lm_head.weight
        head[[said, END_OF_TURN]] = head[[END_OF_TURN, said]]
    hf.save_pretrained(tmp_path / "b")
    write_tokenizer(tmp_path / "b", TINY["vocab_size"])
    assert engine.load(LoadRequest(path=str(tmp_path / "b"), device="cpu", context=64)).ok
    forced = engine.generate(GenerateRequest(messages=MESSAGES[1:2], max_new_tokens=3, stop_tokens=[]))
    assert forced.tokens[0] == END_OF_TURN  # the swap took
    stopped = engine.generate(GenerateRequest(messages=MESSAGES[1:2], max_new_tokens=3))
    assert stopped.ok and stopped.finish_reason == FinishReason.STOP
    assert len(stopped.tokens) <= 1 and stopped.text == ""


def test_preflight_sizes_a_gemma3_folder(folder: Path) -> None:
    preview = preview_model(folder, "cpu", None, 4096, free_bytes=10**12)
    assert preview.error is None and preview.fits
    assert (preview.family, preview.architecture) == ("gemma3", "Gemma3ForCausalLM")
    assert preview.context == TINY["max_position_embeddings"]  # 4096 asked, the model stops at 512
    row = 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4
    # Two global layers keep every position; the four local ones a ring of their window (5).
    assert preview.cache_bytes == row * (2 * preview.context + 4 * TINY["sliding_window"])
    hf = make_hf_model("tiny")
    assert preview.parameters == hf.num_parameters()
    assert preview.weight_bytes == 4 * preview.parameters


def test_check_reports_a_gemma3_folder(folder: Path) -> None:
    report = check_model(folder)
    assert (report.family, report.architecture) == ("gemma3", "Gemma3ForCausalLM")
    assert report.has_chat_template and report.context_length == TINY["max_position_embeddings"]
    assert report.parameters == make_hf_model("tiny").num_parameters()
    assert "262 tokens" in report.tokenizer  # 6 special + 256 byte tokens (the model has 300 rows)
    assert "gemma3 family" in report.describe()
    # The load plan sizes the cache through the model's cache_bytes_for: two global layers keep
    # every position of the (clamped) context, the four local ones a ring of their window.
    assert report.memory is not None and report.memory.context == TINY["max_position_embeddings"]
    row = 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4
    assert report.memory.cache_bytes == row * (2 * report.memory.context + 4 * TINY["sliding_window"])
