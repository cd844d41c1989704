"""Text <-> token ids for a loaded model, its chat template, and streaming detokenization.

The template itself renders in a sandbox (chat_template.py); a model without one gets a plain
"User: ... / Assistant:" transcript.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.chat_template import ChatTemplate
from ds4desk.engine.models.deepseek_v4.chat import ARCHITECTURE as DEEPSEEK_V4
from ds4desk.engine.models.deepseek_v4.chat import EOS as V4_EOS
from ds4desk.engine.models.deepseek_v4.chat import encode_deepseek_v4_chat
from ds4desk.engine.models.gemma3.chat import ARCHITECTURE as GEMMA3
from ds4desk.engine.models.gemma3.chat import encode_gemma_chat

if TYPE_CHECKING:
    from ds4desk.engine.loading.source import ModelSource

MAX_TOKENIZER_BYTES = 512 * 1024 * 1024
MAX_JSON_BYTES = 32 * 1024 * 1024
# End-of-turn markers of common chat formats; a model stops on whichever of these its vocabulary
# has as a special token, besides the eos its config names.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
    "<｜end▁of▁sentence｜>",
)
REPLACEMENT_CHAR = "\ufffd"
# Architectures whose chat format ds4desk knows when a file carries no template.
_BUILT_IN_FORMATS = {DEEPSEEK_V4: "deepseek_v4", GEMMA3: "gemma"}


def _read_json(path: Path) -> dict[str, Any]:
    """A small JSON object file, or {} when absent; LOAD_FAILED when present but unreadable."""
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise EngineFailure(ErrorCode.LOAD_FAILED, f"{path} is implausibly large for a settings file")
        data = json.loads(path.read_text(encoding="utf-8"))
    except EngineFailure:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"{path} is not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"{path} does not hold a JSON object")
    return data


def _token_text(value: object) -> str | None:
    # tokenizer_config writes special tokens either as a string or as {"content": "...", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: object) -> list[int]:
    if type(value) is int:
        return [value]
    if isinstance(value, list):
        return [v for v in value if type(v) is int]
    return []


@dataclass(slots=True)
class ChatTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> text
    stop_ids: set[int] = field(default_factory=set)
    add_bos_token: bool = False
    template: ChatTemplate | None = None
    # Without a template: "plain" (a User:/Assistant: transcript) or a built-in format
    # ("deepseek_v4": DeepSeek ships its chat format as Python code, not as a template; "gemma":
    # Gemma 3 GGUF conversions often carry no template).
    chat_format: str = "plain"
    # What the user may want to know about how the tokenizer was rebuilt (a GGUF's unknown
    # pre-tokenizer name, for one): shown by describe().
    notes: tuple[str, ...] = ()

    @classmethod
    def from_source(cls, source: ModelSource) -> ChatTokenizer:
        """The tokenizer of a detected checkpoint: its architecture picks a built-in chat format."""
        spec = source.tokenizer
        if spec is None:
            return cls.from_folder(source.folder, source.chat_template, source.architecture)
        self = cls(
            tokenizer=spec.tokenizer,
            chat_template=source.chat_template,
            special_tokens=dict(spec.special_tokens),
            add_bos_token=spec.add_bos_token,
            notes=spec.notes,
        )
        self._finish(source.architecture, set(spec.stop_ids))
        return self

    @classmethod
    def from_folder(
        cls, folder: Path, chat_template: str | None, architecture: str | None = None
    ) -> ChatTokenizer:
        """`architecture`: config.json's, as detection reads it (None: read the folder's config)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise EngineFailure(
                ErrorCode.LOAD_FAILED,
                f"no tokenizer.json in {folder}: ds4desk needs a fast-tokenizer file next to the weights",
            )
        try:
            if path.stat().st_size > MAX_TOKENIZER_BYTES:
                raise EngineFailure(ErrorCode.LOAD_FAILED, f"{path} is implausibly large")
            tok = Tokenizer.from_file(str(path))
        except EngineFailure:
            raise
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad JSON
            raise EngineFailure(
                ErrorCode.LOAD_FAILED, f"{path} cannot be read as a tokenizer ({exc})"
            ) from exc

        tok_config = _read_json(folder / "tokenizer_config.json")
        special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(tok_config.get(name))) is not None
        }
        self = cls(
            tokenizer=tok,
            chat_template=chat_template,
            special_tokens=special,
            add_bos_token=tok_config.get("add_bos_token") is True,
        )
        if architecture is None:
            architecture = _folder_architecture(folder)
        stops: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            # A broken side file must not make the tokenizer unusable; config is checked elsewhere.
            with contextlib.suppress(EngineFailure):
                stops.update(_ids(_read_json(folder / name).get("eos_token_id")))
        self._finish(architecture, stops)
        return self

    def _finish(self, architecture: str | None, stops: set[int]) -> None:
        """The chat format, stop tokens and compiled template, once the tokenizer is known."""
        if self.chat_template is None and architecture in _BUILT_IN_FORMATS:
            self.chat_format = _BUILT_IN_FORMATS[architecture]
        self.stop_ids = self._find_stop_ids(stops)
        if self.chat_template is not None:
            # A template that does not compile is reported per request (BAD_REQUEST), not at load:
            # raw-text and token prompts still work with it.
            self.template = ChatTemplate(self.chat_template)

    def _find_stop_ids(self, stops: set[int]) -> set[int]:
        """`stops` (the config's eos ids), the eos token's id, and the end-of-turn markers."""
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := self.tokenizer.token_to_id(eos)) is not None:
            stops.add(eos_id)
        special = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        stops.update(special[t] for t in END_OF_TURN_TOKENS if t in special)
        if self.chat_format == "deepseek_v4" and (end := self.tokenizer.token_to_id(V4_EOS)) is not None:
            stops.add(end)  # its replies end with <｜end▁of▁sentence｜>, special-flagged or not
        vocab = self.vocab_size
        return {i for i in stops if 0 <= i < vocab}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as written: special tokens spelled in it are recognised, none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation; BAD_REQUEST when the template fails or misbehaves."""
        if self.template is None and self.chat_format == "deepseek_v4":
            options = variables or {}
            thinking = bool(options.get("thinking") or options.get("enable_thinking"))
            return encode_deepseek_v4_chat(messages, thinking, add_generation_prompt)
        if self.template is None and self.chat_format == "gemma":
            return encode_gemma_chat(messages, add_generation_prompt)
        if self.template is None:
            return _plain_prompt(messages, add_generation_prompt)
        context: dict[str, Any] = {"tools": None, "documents": None, **(variables or {})}
        context.update(self.special_tokens)
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        return self.template.render(context)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        ids = self.encode(self.render_chat(messages, add_generation_prompt, variables))
        # Real templates spell the BOS token themselves; the plain fallback does not.
        bos = self.special_tokens.get("bos_token")
        bos_id = self.token_id(bos) if bos is not None else None
        if self.template is None and self.add_bos_token and bos_id is not None and ids[:1] != [bos_id]:
            ids.insert(0, bos_id)
        return ids

    def describe(self) -> str:
        model = type(self.tokenizer.model).__name__
        text = f"{model}, {self.vocab_size} tokens"
        if self.template is None and self.chat_format == "deepseek_v4":
            text += "; built-in DeepSeek-V4 chat format"
        elif self.template is None and self.chat_format == "gemma":
            text += "; built-in Gemma chat format"
        elif self.template is None:
            text += "; no chat template (plain 'User:/Assistant:' prompt)"
        elif not self.template.ok:
            text += "; chat template is broken"
        return "; ".join((text, *self.notes))


def _folder_architecture(folder: Path) -> str | None:
    """The architecture the folder's config.json names, in whichever spelling detection knows (a
    config may name only the model type, or use DeepSeek's reference-code keys); None when it names
    none ds4desk runs. config.json is checked, and reported, by the load itself."""
    from ds4desk.engine.loading.detect import read_config

    with contextlib.suppress(EngineFailure):
        return str(read_config(folder)["architectures"][0])
    return None


def _plain_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """For models without a template (base models): a neutral transcript the model can continue."""
    lines = [f"{str(m.get('role', 'user')).capitalize()}: {m.get('content', '')}" for m in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never split a character.

    Byte-level BPE and SentencePiece byte-fallback both emit one UTF-8 byte per token for rare
    characters, and SentencePiece drops a word's leading space when it is decoded alone. So we
    decode a short window (from the last emitted boundary) and emit only what grew past the part
    already sent, holding back while the window's tail is an incomplete character (U+FFFD).
    """

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already emitted as text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        window = self._ids[self._prefix :]
        before = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(window)
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(before) or not text.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :] if text.startswith(before) else text
