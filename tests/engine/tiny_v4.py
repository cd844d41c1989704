"""A tiny random DeepSeek-V4 checkpoint written by transformers (the test oracle).

Every layer kind is present (sliding, CSA, HCA; hash and score-routed MoE) and the sizes are
chosen so short prompts exercise what matters: the raw window is 8 (the ring wraps after 8
tokens), CSA closes a window every 4 tokens and HCA every 8, and `index_topk` is smaller than the
number of compressed rows after 32 tokens. transformers initialises biases, sinks, position biases
and the hash table to zeros; `make_hf_v4` overwrites every tensor with random values.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.loading.source import ModelSource
from tests.engine.tiny_dense import source_from_folder

TINY_V4_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,  # 16 rotary dims of 32
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 12,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    # Many indexer heads: with few, ReLU zeros make exact top-k ties that break differently
    # between implementations.
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    # original 4096 puts the YaRN ramp in the middle of the 8 rotary pairs (pairs 3-4 blend).
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 16384,  # = factor x original, which YaRN expects
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def make_hf_v4(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A transformers DeepseekV4ForCausalLM with every tensor random, eager attention, float32."""
    import transformers

    torch.manual_seed(seed)
    # A deep copy: transformers edits nested dicts (rope_scaling) in place.
    config = transformers.DeepseekV4Config(**copy.deepcopy({**TINY_V4_CONFIG, **overrides}))
    config._attn_implementation = "eager"
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    experts = config.n_routed_experts
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("inv_freq"):
                continue  # rope tables, not weights
            if name.endswith("tid2eid"):
                # Distinct valid experts per token, as a real hash table has.
                rows = [torch.randperm(experts)[: tensor.shape[1]] for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows))
            elif name.endswith(("norm.weight", "hc_scale", "_hc.scale")):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or "base" in name:
                tensor.normal_(0.0, 0.5)
            else:
                tensor.normal_(0.0, 0.1)
    return model


def save_tiny_v4(
    folder: Path, seed: int = 0, original_format: bool = False, **overrides: Any
) -> tuple[torch.nn.Module, ModelSource]:
    """Write a random tiny V4 checkpoint (config.json + safetensors) to `folder`.

    By default the tensors carry transformers' state-dict names (`model.layers.0.self_attn.q_a_proj
    .weight`, one `experts.gate_up_proj` per layer). `original_format=True` lets save_pretrained
    revert them to the DeepSeek names it converts from on load (`attn.wq_a`, per-expert `w1/w2/w3`).
    """
    model = make_hf_v4(seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True, save_original_format=original_format)
    return model, source_from_folder(folder)
