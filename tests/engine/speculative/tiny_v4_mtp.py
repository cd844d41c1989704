"""Tiny random DeepSeek-V4 checkpoints for the speculative tests: transformers writes the model
(tests/engine/tiny_v4.py), and an MTP block is added beside it in the checkpoint's own names,
`mtp.0.*`, shaped as one of the model's layers (its attention kind and routing with it) plus the
block's projections, norms and stream head, all random. transformers has no MTP forward: the
block's math is checked against its definition in test_mtp_drafter.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.tiny_v4 import TINY_V4_CONFIG, save_tiny_v4

CPU = torch.device("cpu")
# A vocabulary large enough for tiny_pairs' prompts (PLAIN reaches 202, the budget's close 150..249).
VOCAB = 256


def _random_like(name: str, tensor: torch.Tensor, gen: torch.Generator, experts: int) -> torch.Tensor:
    """A random tensor for `name`, drawn as make_hf_v4 draws the model's own."""
    if name.endswith("tid2eid"):
        rows = [torch.randperm(experts, generator=gen)[: tensor.shape[1]] for _ in range(tensor.shape[0])]
        return torch.stack(rows).to(tensor.dtype)
    if name.endswith(("norm.weight", "hc_scale", "_hc.scale")):
        return torch.rand(tensor.shape, generator=gen) + 0.5
    if name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or "base" in name:
        return torch.randn(tensor.shape, generator=gen) * 0.5
    return torch.randn(tensor.shape, generator=gen) * 0.1


def save_tiny_v4_with_mtp(folder: Path, seed: int, template_layer: int | None = 1) -> Path:
    """A tiny V4 checkpoint (vocabulary VOCAB) in `folder`; with an MTP block shaped as layer
    `template_layer` (1: CSA with its indexer, hash-routed; 2: HCA; 0: sliding), or none (None)."""
    save_tiny_v4(folder, seed, vocab_size=VOCAB)
    if template_layer is None:
        return folder
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        tensors.update(load_file(file))
    gen = torch.Generator().manual_seed(seed + 1000)
    experts = TINY_V4_CONFIG["n_routed_experts"]
    prefix = f"model.layers.{template_layer}."
    block = {
        "mtp.0." + name.removeprefix(prefix): _random_like(name, value, gen, experts)
        for name, value in tensors.items()
        if name.startswith(prefix)
    }
    hidden, mult = TINY_V4_CONFIG["hidden_size"], TINY_V4_CONFIG["hc_mult"]
    extras = {
        "e_proj.weight": torch.empty(hidden, hidden),
        "h_proj.weight": torch.empty(hidden, hidden),
        "enorm.weight": torch.empty(hidden),
        "hnorm.weight": torch.empty(hidden),
        "norm.weight": torch.empty(hidden),
        "hc_head.hc_fn": torch.empty(mult, mult * hidden),
        "hc_head.hc_base": torch.empty(mult),
        "hc_head.hc_scale": torch.empty(1),
    }
    for name, shape in extras.items():
        block["mtp.0." + name] = _random_like(name, shape, gen, experts)
    for file in files:
        file.unlink()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    save_file({**tensors, **block}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == VOCAB
    return folder


def load_v4(folder: Path) -> DeepseekV4Model:
    model = load_model(inspect_folder(folder), CPU, torch.float32).model
    assert isinstance(model, DeepseekV4Model)
    return model
