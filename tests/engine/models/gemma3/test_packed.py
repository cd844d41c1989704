"""Gemma 3 with weights kept in GGUF block types (models/packed.py): gguf-py quantizes the random
weights (the oracle), transformers runs on gguf-py's dequantized values, and ours runs on the blocks
themselves, the embedding and its tied head included."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from ds4desk.engine.models.gemma3.model import Gemma3Model
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear
from ds4desk.engine.models.registry import build_model
from tests.engine.models.gemma3.tiny import ARCHITECTURE, make_hf_model

CPU = torch.device("cpu")
Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0


def packed_types(hf: torch.nn.Module) -> dict[str, int]:
    """Q8_0 for the embedding and most linears; layer 0's q_proj stays float (a q/k/v group mixing
    float and packed parts) and layer 1's gate_proj is Q4_0 (a gate/up group of two block types)."""
    types: dict[str, int] = {"model.embed_tokens.weight": int(Q8_0)}
    for name, _ in hf.named_parameters():
        if name.endswith("_proj.weight"):
            types[name] = int(Q8_0)
    del types["model.layers.0.self_attn.q_proj.weight"]
    types["model.layers.1.mlp.gate_proj.weight"] = int(Q4_0)
    return types


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Gemma3Model]:
    hf = make_hf_model("tiny", seed=11)
    types = packed_types(hf)
    model = build_model(ARCHITECTURE, hf.config.to_dict(), torch.float32, False, types)
    assert isinstance(model, Gemma3Model)
    model.materialize(CPU)
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name not in types:
                ours[name].copy_(param)
                continue
            kind = GGMLQuantizationType(types[name])
            blocks = gguf.quants.quantize(param.numpy(), kind)
            ours[name].copy_(torch.from_numpy(np.ascontiguousarray(blocks)))
            param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind)))  # what the blocks hold
    model.finish_loading()
    model.allocate_cache(64)
    return hf, model


def test_the_packed_weights_stay_packed(pair) -> None:
    hf, model = pair
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert isinstance(layer0.self_attn.k_proj, PackedLinear) and not isinstance(
        layer0.self_attn.q_proj, PackedLinear
    )
    assert layer1.mlp.gate_proj.type_id == int(Q4_0) and layer1.mlp.up_proj.type_id == int(Q8_0)
    assert model.model.embed_tokens.weight.dtype == torch.uint8
    assert layer0.fused == {}  # nothing to fuse where a part is packed
    float_bytes = sum(p.numel() * 4 for p in hf.parameters())
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < float_bytes / 3


def test_packed_prefill_and_decode_match_transformers(pair) -> None:
    hf, model = pair
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        prefill = model.forward(ids[:20], 0, "all")  # past the window of 5
        steps = [model.forward(ids[i : i + 1], i, "last") for i in (20, 21)]
        steps.append(model.decode_graphable(ids[22:23], torch.tensor([22]), 64))
        model.set_length(23)
        steps.append(model.forward(ids[23:24], 23, "last"))
    assert float((prefill - ref[:20]).norm() / ref[:20].norm()) < 1e-4
    for offset, got in enumerate(steps):
        want = ref[20 + offset]
        assert float((got - want).norm() / want.norm()) < 1e-4
