"""Tiny random Gemma 3 text checkpoints written by transformers (the test oracle), with a Gemma-style
tokenizer and chat template, and a ModelSource for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.loading.source import ModelSource
from tests.engine.tiny_dense import source_from_folder

ARCHITECTURE = "Gemma3ForCausalLM"

# Small enough for the CPU, shaped to exercise what Gemma 3 adds: GQA, a head_dim that is not
# hidden // heads, a window (5) far shorter than the test prompts, two global layers among four
# local ones, distinct local / global RoPE bases and linear scaling on the global layers.
TINY: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "query_pre_attn_scalar": 24,
    "sliding_window": 5,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    },
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

# The published 270M model's shapes scaled down, ratios kept: hidden 640 -> 160, 4 heads of 256
# -> 4 of 64 (head_dim * heads > hidden, as there), 1 kv head, ffn 2048 -> 512, window 512 -> 16,
# query_pre_attn_scalar == head_dim (256 there); the first five layers local, the sixth global.
SCALED_270M: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 160,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 16,
    "sliding_window_pattern": 6,  # the older spelling: no layer_types, rope_theta + local base
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

CONFIGS = {"tiny": TINY, "270m": SCALED_270M}

# A minimal Gemma turn format (written for these tests): the system message is folded into the
# first user turn, the assistant's role is "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma's special tokens at Gemma's ids for the first four; the turn markers right after.
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def make_hf_model(kind: str = "tiny", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A transformers Gemma 3 text model with every weight random (norm weights included, which
    transformers would otherwise initialise to 0 and so leave untested)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**{**CONFIGS[kind], **overrides}, architectures=[ARCHITECTURE])
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
            else:
                param.normal_(0.0, 0.08)
    return model


def write_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """A byte-level tokenizer with Gemma's special tokens, its settings and generation config that
    lists <end_of_turn> among the eos ids, as Gemma's instruction-tuned models ship it."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    assert len(vocab) <= vocab_size
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    settings = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    ids = {name: vocab[name] for name in SPECIAL}
    generation = {"bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def save_tiny(folder: Path, kind: str = "tiny", seed: int = 0, **overrides: Any):
    """Write a random Gemma 3 checkpoint (and tokenizer) to `folder`; (transformers model, source)."""
    model = make_hf_model(kind, seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, model.config.vocab_size)
    return model, source_from_folder(folder)


def as_source(folder: Path) -> ModelSource:
    return source_from_folder(folder)
