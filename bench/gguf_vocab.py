"""A byte-level vocabulary padded to a model's size, written as GGUF tokenizer metadata: what the
benchmarks' random GGUF models need for llama.cpp to load them (one token per embedding row; their
prompts are token ids)."""

from __future__ import annotations

from typing import Any


def add_byte_level_vocab(writer: Any, vocab_size: int, special: list[str], pre: str, eos_id: int) -> None:
    """`special` tokens first (control tokens; BOS is the first), the byte alphabet, one merge, then
    padding tokens up to `vocab_size`, under llama.cpp's gpt2 tokenizer with pre-tokenizer `pre`."""
    from tokenizers import pre_tokenizers

    tokens = [*special, *sorted(pre_tokenizers.ByteLevel.alphabet()), "ĠĠ"]  # one merge: a list of one
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # control, normal
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(False)
