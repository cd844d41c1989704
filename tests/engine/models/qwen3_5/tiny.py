"""Tiny random Qwen3.5 checkpoints (dense and MoE) written by transformers (the test oracle), with
a Qwen-style tokenizer, and a ModelSource for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.loading.source import ModelSource
from tests.engine.tiny_dense import source_from_folder

ARCHITECTURE = "Qwen3_5ForCausalLM"
MOE_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
LINEAR, FULL = "linear_attention", "full_attention"

# Small enough for the CPU, shaped to exercise what Qwen3.5 adds: linear layers on both sides of
# the full ones, more value heads than key heads (each key head serves two), key and value head
# sizes that differ, GQA in the full layers, a head_dim that is not hidden // heads and RoPE on a
# quarter of it (transformers' default partial_rotary_factor).
TINY: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "layer_types": [LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
}

# The MoE variant of TINY: no dense MLP width; eight experts, two picked per token, an expert width
# that differs from the shared expert's (so a swapped weight would not fit).
TINY_MOE: dict[str, Any] = {
    **{k: v for k, v in TINY.items() if k != "intermediate_size"},
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

# Qwen's special tokens (the ones its chat format uses) at the start of the vocabulary.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def make_hf_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A transformers Qwen3.5 text model with every weight random: norm weights (which transformers
    initialises to 0 or 1), the decay rates A_log and dt_bias (so decays range from slow to fast)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{**TINY, **overrides}, architectures=[ARCHITECTURE])
    return randomized(transformers.Qwen3_5ForCausalLM(config).eval())


def make_hf_moe_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """make_hf_model for the MoE variant (TINY_MOE), the routers' weights wide enough that no two
    experts' scores come within rounding of each other (a tie would pick by rounding)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(**{**TINY_MOE, **overrides}, architectures=[MOE_ARCHITECTURE])
    model = randomized(transformers.Qwen3_5MoeForCausalLM(config).eval())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
    return model


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
            elif name.endswith("A_log"):
                param.uniform_(-3.0, 1.0)
            elif name.endswith("dt_bias"):
                param.uniform_(-1.0, 1.0)
            elif name.endswith("conv1d.weight"):
                param.normal_(0.0, 0.4)
            else:
                param.normal_(0.0, 0.08)
    return model


def write_tokenizer(folder: Path, vocab_size: int, chat_template: str | None = None) -> dict[str, int]:
    """A byte-level tokenizer with Qwen's special tokens, and its settings."""
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
    settings: dict[str, Any] = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
    }
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    ids = {name: vocab[name] for name in SPECIAL}
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def save_tiny(folder: Path, seed: int = 0, chat_template: str | None = None, **overrides: Any):
    """Write a random Qwen3.5 checkpoint (and tokenizer) to `folder`; (transformers model, source)."""
    model = make_hf_model(seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, model.config.vocab_size, chat_template)
    return model, source_from_folder(folder)


def save_tiny_moe(folder: Path, seed: int = 0, chat_template: str | None = None, **overrides: Any):
    """save_tiny for the MoE variant."""
    model = make_hf_moe_model(seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, model.config.vocab_size, chat_template)
    return model, source_from_folder(folder)


def save_tiny_moe_stacked(folder: Path, seed: int = 0, **overrides: Any):
    """save_tiny_moe with the experts stored stacked (`mlp.experts.gate_up_proj` [E, 2I, hidden],
    `mlp.experts.down_proj` [E, hidden, I]: transformers' own state-dict names, the published
    checkpoints' layout) and the source marked so (config.STACKED_EXPERTS_KEY, what the name
    detection is to set for such a folder)."""
    from safetensors.torch import save_file

    from ds4desk.engine.models.qwen3_5.config import STACKED_EXPERTS_KEY

    model, _ = save_tiny_moe(folder, seed, **overrides)
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    from ds4desk.engine.loading.detect import read_source

    source = read_source(folder)  # the name detection marks the layout (loading/detect.py)
    assert source.config.get(STACKED_EXPERTS_KEY) is True, "stacked experts not recognised"
    return model, source


def as_source(folder: Path) -> ModelSource:
    return source_from_folder(folder)
