"""Tiny random dense checkpoints written by transformers (the test oracle), and a ModelSource for
them built straight from their safetensors headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.loading.source import ModelSource, TensorEntry

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

# One config per family, each switching on what that family adds.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "num_hidden_layers": 3,
        "tie_word_embeddings": True,
        "rope_theta": 50000.0,
        # original 32 positions: the rope bands fall on all three sides of llama3's blend.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {**_COMMON, "sliding_window": 8, "tie_word_embeddings": False},
    "qwen2": {**_COMMON, "tie_word_embeddings": False, "rope_theta": 1000000.0},
    "qwen3": {**_COMMON, "head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": True},
}

ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def make_hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A transformers model of `family` with every weight random (biases and norms included, which
    transformers would otherwise initialise to 0 and 1 and so leave untested)."""
    import transformers

    torch.manual_seed(seed)
    arch = ARCHITECTURE[family]
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_class(**{**TINY_CONFIGS[family], **overrides}, architectures=[arch])
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    return model


def save_tiny(family: str, folder: Path, seed: int = 0, shard: str | None = None, **overrides: Any):
    """Write a random `family` checkpoint to `folder`; returns (the transformers model, its source)."""
    model = make_hf_model(family, seed, **overrides)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard is not None:
        kwargs["max_shard_size"] = shard
    model.save_pretrained(folder, **kwargs)
    return model, source_from_folder(folder)


def source_from_folder(folder: Path) -> ModelSource:
    """A ModelSource read from a save_pretrained folder's config.json and safetensors headers."""
    config = json.loads((folder / "config.json").read_text())
    tensors: dict[str, TensorEntry] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            tensors[name] = TensorEntry(file, info["dtype"], tuple(info["shape"]), begin, end)
    return ModelSource(
        folder=folder,
        origin=folder,
        config=config,
        architecture=config["architectures"][0],
        tensors=tensors,
    )
