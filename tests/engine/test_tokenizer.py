"""ChatTokenizer, the GGUF-built tokenizers (against transformers), templates and streaming decode."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ds4desk.engine import chat_template
from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.chat_template import ChatTemplate
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.tokenizer import REPLACEMENT_CHAR, ChatTokenizer, IncrementalDetokenizer
from tests.engine.gguf_fakes import write_tiny_gguf

SAMPLES = [
    "Hello world",
    "1234567 + 89 = 1234656, pi is 3.14159",
    "naïve café, Ελληνικά, русский, 日本語のテキスト",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x**2  # square\n\n\tif x != 0: pass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "don't, I'll, we've, THEY'RE",
    "<|endoftext|><repo_name>x",
    "",
]
SMOLLM_CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smollm() -> ChatTokenizer:
    return ChatTokenizer.from_source(read_source(default_model_path()))


@pytest.fixture(scope="module")
def tiny_sp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ChatTokenizer]:
    root = tmp_path_factory.mktemp("sp")
    gguf = write_tiny_gguf(root / "sp.gguf")
    return gguf, ChatTokenizer.from_source(read_source(gguf))


def _bad_request(exc: pytest.ExceptionInfo[EngineFailure]) -> str:
    assert exc.value.error.code == ErrorCode.BAD_REQUEST
    return exc.value.error.detail


# --- agreement with transformers' own GGUF tokenizer loading -------------------------------------


@pytest.mark.slow
def test_smollm_tokenizer_matches_transformers(smollm: ChatTokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    gguf = default_model_path()
    (tmp_path / gguf.name).symlink_to(gguf)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    for text in SAMPLES:
        ids = smollm.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert smollm.decode(ids, skip_special_tokens=False) == text
        assert smollm.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert smollm.vocab_size == 49152


def test_sentencepiece_tokenizer_matches_transformers(tiny_sp: tuple[Path, ChatTokenizer]) -> None:
    from transformers import AutoTokenizer

    gguf, ours = tiny_sp
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in [
        "hello world",
        "the cat in the hat",
        "Hello World",
        " hello",
        "café",
        "naïve 日本 🤖",
        "a\nb",
    ]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    with_specials = ours.encode("<s>hello</s>")
    assert with_specials == reference.encode("<s>hello</s>", add_special_tokens=False)
    assert with_specials[0] == 1 and with_specials[-1] == 2


# --- encode / decode / stop tokens ---------------------------------------------------------------


@pytest.mark.slow
def test_special_tokens_in_text_are_recognised(smollm: ChatTokenizer) -> None:
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids) == "user\nhi"  # special tokens are skipped in displayed text
    assert {0, 2} <= smollm.stop_ids  # <|endoftext|>, <|im_end|> (eos)
    assert 1 not in smollm.stop_ids


def test_stop_ids_include_generation_config_and_end_of_turn(tmp_path: Path, smollm: ChatTokenizer) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    smollm.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    tok = ChatTokenizer.from_folder(folder, None)
    assert tok.stop_ids == {0, 2, 5, 7}


def test_missing_or_broken_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(EngineFailure) as exc:
        ChatTokenizer.from_folder(tmp_path, None)
    assert exc.value.error.code == ErrorCode.LOAD_FAILED and "no tokenizer.json" in exc.value.error.detail
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(EngineFailure) as exc:
        ChatTokenizer.from_folder(tmp_path, None)
    assert exc.value.error.code == ErrorCode.LOAD_FAILED and "tokenizer.json" in exc.value.error.detail


# --- streaming decode ----------------------------------------------------------------------------


def _stream(tok: ChatTokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.slow
def test_incremental_detokenizer_byte_level(smollm: ChatTokenizer) -> None:
    text = "Robots 🤖 cheer 🎉 — 日本語, ü, 👨‍👩‍👧 and ascii."
    ids = smollm.encode(text)
    pieces = _stream(smollm, ids)
    assert "".join(pieces) == smollm.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert pieces.count("") > 1  # emoji bytes were held back until their character was complete
    assert len(ids) > len(text.split())


def test_incremental_detokenizer_sentencepiece_byte_fallback(tiny_sp: tuple[Path, ChatTokenizer]) -> None:
    _, tok = tiny_sp
    text = "hello world 🤖 café naïve 日本"
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert pieces[1] == " world"  # the space SentencePiece drops from a lone word is kept


def test_incremental_detokenizer_flushes_an_incomplete_character(tiny_sp: tuple[Path, ChatTokenizer]) -> None:
    _, tok = tiny_sp
    detok = IncrementalDetokenizer(tok)
    first_byte_of_robot = tok.token_id("<0xF0>")
    assert detok.push(tok.token_id("▁hello")) == "hello"
    assert detok.push(first_byte_of_robot) == ""
    assert detok.flush() == REPLACEMENT_CHAR


# --- chat templates ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm_template_renders_chatml(smollm: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    assert smollm.render_chat(messages) == SMOLLM_CHATML
    assert smollm.render_chat(messages, add_generation_prompt=False) == SMOLLM_CHATML.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = smollm.encode_chat(messages)
    assert ids[0] == 1 and ids == smollm.encode(SMOLLM_CHATML)
    assert smollm.decode(ids, skip_special_tokens=False) == SMOLLM_CHATML
    assert smollm.describe() == "BPE, 49152 tokens"


def _with_template(tok: ChatTokenizer, template: str | None) -> ChatTokenizer:
    """The same vocabulary with another template (a fresh object, so tests cannot leak into each other)."""
    compiled = ChatTemplate(template) if template is not None else None
    return ChatTokenizer(tokenizer=tok.tokenizer, chat_template=template, template=compiled)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    ],
)
def test_malicious_template_is_refused(tiny_sp: tuple[Path, ChatTokenizer], template: str) -> None:
    tok = _with_template(tiny_sp[1], template)
    with pytest.raises(EngineFailure) as exc:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert "chat template" in _bad_request(exc)


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
        ("{% for %}", "broken"),
        ("{{ 'x' * 100000000 }}", "enormous"),
        ("{{ 2 ** 100000000 }}", "enormous"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "too much work"),
    ],
)
def test_failing_template_is_a_bad_request(
    tiny_sp: tuple[Path, ChatTokenizer], template: str, problem: str
) -> None:
    tok = _with_template(tiny_sp[1], template)
    with pytest.raises(EngineFailure) as exc:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert problem in _bad_request(exc)


def test_spinning_template_hits_the_deadline(
    tiny_sp: tuple[Path, ChatTokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 0.5)
    spin = "{% set s = 'a' * 999999 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}"
    tok = _with_template(tiny_sp[1], spin)
    started = time.perf_counter()
    with pytest.raises(EngineFailure) as exc:
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert "ran longer than" in _bad_request(exc)
    assert time.perf_counter() - started < 5
    # The tokenizer is still fine afterwards, and nothing stray is raised later in this thread.
    assert tok.encode("hello") == [tiny_sp[1].token_id("▁hello")]
    time.sleep(0.6)


def test_template_helpers_match_hf(tiny_sp: tuple[Path, ChatTokenizer]) -> None:
    # trim_blocks eats the newline after a tag, lstrip_blocks the indentation before one.
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "    {% if loop.index > 5 %}{% break %}{% endif %}\n"
        "{{ m.role }}: {{ m.content | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok = _with_template(tiny_sp[1], template)
    tok.special_tokens = {"bos_token": "<s>"}
    out = tok.render_chat([{"role": "user", "content": "<b>&ü"}])
    assert out == '<s>user: "<b>&ü"\nassistant:'


def test_no_template_falls_back_to_a_plain_prompt(tiny_sp: tuple[Path, ChatTokenizer]) -> None:
    tok = _with_template(tiny_sp[1], None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert tok.render_chat(messages) == "System: Be brief.\nUser: hello\nAssistant:"
    assert "no chat template" in tok.describe()
    tok.add_bos_token = True
    tok.special_tokens = {"bos_token": "<s>"}
    assert tok.encode_chat(messages)[0] == 1
