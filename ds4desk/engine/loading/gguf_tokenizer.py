"""Rebuild a Hugging Face tokenizer.json from the vocabulary a GGUF file carries in its metadata.

GGUF keeps the tokenizer as plain arrays: `tokenizer.ggml.tokens`, `token_type` (1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and, for byte-level BPE, `merges`; for
SentencePiece-style vocabularies, `scores` instead of merges. `tokenizer.ggml.pre` names the
pre-tokenizer (the regex that cuts text into words before BPE runs), which the arrays do not encode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ds4desk.engine.api import EngineFailure, ErrorCode

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The word-splitting regexes the model families were trained with (they are part of each model's
# published tokenizer definition). Llama 3 keeps runs of up to three digits together; Qwen2 splits
# every digit; Qwen3.5 also keeps combining marks (\p{M}) inside words; GPT-4o style splits
# camel case apart and keeps contractions on their word.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-V3 / V4 (and models reusing their vocabulary) split in three passes, each on the pieces
# the previous one left: runs of up to three digits, runs of CJK ideographs and kana, then words,
# punctuation runs and whitespace.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    '[!"' + r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(slots=True, frozen=True)
class _SplitRule:
    regex: str | tuple[str, ...]  # one pass, or several applied in turn
    # Qwen's published tokenizers NFC-normalize text before splitting it, so a decomposed accent
    # ("e" + U+0301) is encoded as the composed character the model was trained on.
    nfc: bool = False


# `tokenizer.ggml.pre` names (as llama.cpp's converter writes them) -> the family's split rule.
# Several names are other models that reuse a family's tokenizer unchanged.
_SPLIT_RULES: dict[str, _SplitRule] = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe", "pixtral"),
        _SplitRule(_LLAMA3_SPLIT),
    ),
    "qwen2": _SplitRule(_QWEN2_SPLIT, nfc=True),
    # DeepSeek-R1's Qwen distills reuse Qwen's vocabulary and regex; their GGUF does not say whether
    # the published tokenizer normalizes, so none is assumed (as llama.cpp does).
    "deepseek-r1-qwen": _SplitRule(_QWEN2_SPLIT),
    "qwen35": _SplitRule(_QWEN35_SPLIT, nfc=True),
    # llama.cpp names DeepSeek-V4's vocabulary after the first model its hash matched (joyai-llm).
    **dict.fromkeys(("deepseek-v3", "joyai-llm", "hunyuan-dense", "hy_v4"), _SplitRule(_DEEPSEEK3_SPLITS)),
    **dict.fromkeys(("gpt-4o", "llama4"), _SplitRule(_GPT4O_SPLIT)),
}
_GPT2_NAMES = ("default", "gpt2", "gpt-2", "")


@dataclass(slots=True)
class BuiltTokenizer:
    tokenizer: Tokenizer
    kind: str  # "BPE (byte-level)" or "BPE (SentencePiece)"
    notes: list[str] = field(
        default_factory=list
    )  # things the user may want to know (an unknown pre-tokenizer)


def _fail(problem: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, f"cannot rebuild the tokenizer from the GGUF: {problem}")


def _string_list(meta: dict[str, object], key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(f"'{key}' is missing or not a list of strings")
    return value


def _token_types(meta: dict[str, object], n_tokens: int) -> list[int]:
    value = meta.get("tokenizer.ggml.token_type")
    if value is None:
        return [TOKEN_NORMAL] * n_tokens
    if not isinstance(value, list) or len(value) != n_tokens or not all(type(v) is int for v in value):
        raise _fail("'tokenizer.ggml.token_type' does not match the token list")
    return value


def _vocab(tokens: list[str]) -> dict[str, int]:
    # A few GGUF vocabularies repeat a string (padding slots); the first id keeps it, as in llama.cpp.
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # normalized=False: these must match the raw text exactly, before any pre-tokenizer sees it.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == TOKEN_USER_DEFINED
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _add_bos_eos(tok: Tokenizer, meta: dict[str, object], tokens: list[str], add_bos_default: bool) -> None:
    """What `encode(..., add_special_tokens=True)` adds around the text, as the GGUF's add_bos/add_eos
    flags say. ds4desk's own prompts pass add_special_tokens=False (chat templates spell BOS
    themselves); this keeps the rebuilt tokenizer equal to the model's published one for any other
    caller."""

    def flagged(key: str, default: bool) -> tuple[str, int] | None:
        flag = meta.get(f"tokenizer.ggml.add_{key}_token", default)
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if flag is not True or type(tid) is not int or not 0 <= tid < len(tokens):
            return None
        return tokens[tid], tid

    bos, eos = flagged("bos", add_bos_default), flagged("eos", False)
    if bos is None and eos is None:
        return
    # The pair template repeats the same marks around the second text, as the published tokenizers do.
    first = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    second = ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    try:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(first),
            pair=" ".join(first + second),
            special_tokens=list({mark for mark in (bos, eos) if mark is not None}),
        )
    except Exception:  # a marker spelled with a space or colon cannot be templated; ds4desk never needs it
        return


def _byte_level_pre_tokenizer(
    pre: str,
) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer, str | None]:
    """(normalizer, pre-tokenizer, note) for a byte-level vocabulary whose pre-tokenizer is `pre`."""
    if pre == "smollm":
        # SmolLM's published tokenizer splits every digit on its own, then applies the GPT-2 regex.
        steps = [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
        return None, pre_tokenizers.Sequence(steps), None
    rule = _SPLIT_RULES.get(pre)
    if rule is not None:
        passes = (rule.regex,) if isinstance(rule.regex, str) else rule.regex
        steps = [
            *(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False) for regex in passes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        return (normalizers.NFC() if rule.nfc else None), pre_tokenizers.Sequence(steps), None
    note = None
    if pre not in _GPT2_NAMES:
        note = f"unknown pre-tokenizer '{pre}', using GPT-2's; tokenization may differ slightly"
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), note


def _build_byte_level(meta: dict[str, object], tokens: list[str], types: list[int]) -> BuiltTokenizer:
    merges: list[tuple[str, str]] = []
    for m in _string_list(meta, "tokenizer.ggml.merges"):
        parts = m.split(" ")
        if len(parts) != 2:
            raise _fail(f"merge {m!r} is not two tokens separated by a space")
        merges.append((parts[0], parts[1]))
    vocab = _vocab(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    normalizer, tok.pre_tokenizer, note = _byte_level_pre_tokenizer(
        pre if isinstance(pre, str) else "default"
    )
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, types)
    _add_bos_eos(tok, meta, tokens, add_bos_default=False)
    return BuiltTokenizer(tok, "BPE (byte-level)", [note] if note else [])


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges two pieces when the result is a vocabulary piece; a higher score wins.

    So every way of cutting a normal piece into two vocabulary pieces is a merge, ranked by the
    merged piece's score (ties: lower id first, as the vocabulary is ordered by training frequency).
    """
    vocab = _vocab(tokens)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for pid, (piece, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != TOKEN_NORMAL or len(piece) < 2 or vocab.get(piece) != pid:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-scores[pid], pid, li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _build_sentencepiece(meta: dict[str, object], tokens: list[str], types: list[int]) -> BuiltTokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if (
        not isinstance(scores, list)
        or len(scores) != len(tokens)
        or not all(isinstance(s, float | int) for s in scores)
    ):
        raise _fail("'tokenizer.ggml.scores' is missing or does not match the token list")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if type(unk_id) is int and 0 <= unk_id < len(tokens) else None
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is not False
    tok = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=_sentencepiece_merges(tokens, [float(s) for s in scores], types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,  # characters outside the vocabulary become <0xNN> byte tokens
        )
    )
    # SentencePiece marks word starts with U+2581 and (usually) puts one before the first word.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the space the encoder prepended
    tok.decoder = decoders.Sequence(steps)
    _add_special_tokens(tok, tokens, types)
    # llama.cpp (and so the converters that write these files) adds BOS to a SentencePiece vocabulary
    # that does not say otherwise.
    _add_bos_eos(tok, meta, tokens, add_bos_default=True)
    return BuiltTokenizer(tok, "BPE (SentencePiece)")


def build_tokenizer(meta: dict[str, object]) -> BuiltTokenizer:
    """A tokenizers.Tokenizer equivalent to the GGUF's vocabulary; LOAD_FAILED when it can't be built."""
    model = meta.get("tokenizer.ggml.model")
    tokens = _string_list(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise _fail("the token list is empty")
    types = _token_types(meta, len(tokens))
    try:
        if model == "gpt2":
            return _build_byte_level(meta, tokens, types)
        if model == "llama":
            return _build_sentencepiece(meta, tokens, types)
    except EngineFailure:
        raise
    except Exception as exc:  # the tokenizers library rejects inconsistent vocabularies with various errors
        raise _fail(f"{type(exc).__name__}: {exc}") from exc
    raise _fail(f"tokenizer model {model!r} is not supported (ds4desk reads 'gpt2' and 'llama')")
