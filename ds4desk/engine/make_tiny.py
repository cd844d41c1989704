"""`ds4desk make-tiny deepseek_v4 OUT`: a tiny random DeepSeek-V4 checkpoint, written without
transformers, in the HF layout or DeepSeek's official one (optionally FP8/FP4-quantized).

It is for tests and demos: every layer kind is present (sliding, CSA, HCA attention; hash-routed
and score-routed MoE), every tensor is random (biases, sinks and the hash table too, since zeros
would hide bugs), and a small byte-level tokenizer with DeepSeek-V4's special tokens comes along.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ds4desk.engine.loading import deepseek_v4_names as names
from ds4desk.engine.loading.quantized import quantize_fp4_block32, quantize_fp8_block128

FAMILIES = ("deepseek_v4",)
FORMATS = ("hf", "official")

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_RATIO_OF = {SLIDING: 0, CSA: 4, HCA: 128}  # compress_ratios' codes; the real rates are below

# HF-style config (DeepseekV4Config keys). Sizes are tiny but keep FP4's 32-value blocks whole
# (hidden and expert widths are multiples of 32) and make q_b_proj span two 128-row FP8 blocks.
TINY_CONFIG: dict[str, Any] = {
    "architectures": [names.ARCHITECTURE],
    "model_type": "deepseek_v4",
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 8},
    "sliding_window": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 16,  # many heads: fewer exact top-k ties at ReLU zero
    "index_head_dim": 16,
    "index_topk": 6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = (BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")

# Official tensors stored as F32 (everything else unquantized is BF16 there).
_F32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")
# Official tensors quantized to FP8 by --fp8 (128 x 128 blocks, as the official checkpoints); routed
# experts go to FP4.
_FP8_SUFFIXES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "indexer.wq_b.weight",
    "shared_experts.w1.weight",
    "shared_experts.w2.weight",
    "shared_experts.w3.weight",
)


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor (HF name -> shape) of a DeepSeek-V4 model with this HF-style config."""
    hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    q_rank, groups, o_rank = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    experts, width, vocab = config["n_routed_experts"], config["moe_intermediate_size"], config["vocab_size"]
    streams, idx_heads, idx_dim = config["hc_mult"], config["index_n_heads"], config["index_head_dim"]
    mixes = (2 + streams) * streams
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "model.hc_head.hc_fn": (streams, streams * hidden),
        "model.hc_head.hc_base": (streams,),
        "model.hc_head.hc_scale": (1,),
        "lm_head.weight": (vocab, hidden),
    }
    for i, (attn, mlp) in enumerate(zip(config["layer_types"], config["mlp_layer_types"], strict=True)):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.sinks": (heads,),
            p + "self_attn.q_a_proj.weight": (q_rank, hidden),
            p + "self_attn.q_a_norm.weight": (q_rank,),
            p + "self_attn.q_b_proj.weight": (heads * head_dim, q_rank),
            p + "self_attn.kv_proj.weight": (head_dim, hidden),
            p + "self_attn.kv_norm.weight": (head_dim,),
            p + "self_attn.o_a_proj.weight": (groups * o_rank, heads * head_dim // groups),
            p + "self_attn.o_b_proj.weight": (hidden, groups * o_rank),
            p + "mlp.gate.weight": (experts, hidden),
            p + "mlp.experts.gate_up_proj": (experts, 2 * width, hidden),
            p + "mlp.experts.down_proj": (experts, hidden, width),
            p + "mlp.shared_experts.gate_proj.weight": (width * config["n_shared_experts"], hidden),
            p + "mlp.shared_experts.up_proj.weight": (width * config["n_shared_experts"], hidden),
            p + "mlp.shared_experts.down_proj.weight": (hidden, width * config["n_shared_experts"]),
        }
        for site in ("attn_hc", "ffn_hc"):
            shapes |= {
                p + f"{site}.fn": (mixes, streams * hidden),
                p + f"{site}.base": (mixes,),
                p + f"{site}.scale": (3,),
            }
        if attn != SLIDING:
            # CSA's compressor keeps two overlapping halves per token, HCA's one.
            c, rate = (
                (2, config["compress_rates"][CSA]) if attn == CSA else (1, config["compress_rates"][HCA])
            )
            comp = p + "self_attn.compressor."
            shapes |= {
                comp + "position_bias": (rate, c * head_dim),
                comp + "kv_proj.weight": (c * head_dim, hidden),
                comp + "gate_proj.weight": (c * head_dim, hidden),
                comp + "kv_norm.weight": (head_dim,),
            }
            if attn == CSA:
                shapes |= {
                    comp + "indexer.position_bias": (rate, 2 * idx_dim),
                    comp + "indexer.kv_proj.weight": (2 * idx_dim, hidden),
                    comp + "indexer.gate_proj.weight": (2 * idx_dim, hidden),
                    comp + "indexer.kv_norm.weight": (idx_dim,),
                    comp + "indexer.q_b_proj.weight": (idx_heads * idx_dim, q_rank),
                    comp + "indexer.scorer.weights_proj.weight": (idx_heads, hidden),
                }
        if mlp == "hash_moe":
            shapes[p + "mlp.gate.tid2eid"] = (vocab, config["num_experts_per_tok"])
        else:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (experts,)
    return shapes


def random_state(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors (int64 hash tables) for every tensor of `config`'s model."""
    gen = torch.Generator().manual_seed(seed)
    experts = config["n_routed_experts"]
    state: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("tid2eid"):
            # Distinct valid experts per token, like a real hash table (all-zero would send
            # every token to expert 0 and hide routing bugs).
            order = torch.rand((shape[0], experts), generator=gen).argsort(dim=1)
            state[name] = order[:, : shape[1]].contiguous().to(torch.int64)
        elif name.endswith(("norm.weight", "hc_scale", "_hc.scale")):
            state[name] = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith(("sinks", "position_bias", "e_score_correction_bias", "base")):
            state[name] = 0.5 * torch.randn(shape, generator=gen)
        else:
            state[name] = 0.1 * torch.randn(shape, generator=gen)
    return state


def official_config(config: dict[str, Any], fp8: bool) -> dict[str, Any]:
    """The config as DeepSeek ships it: legacy keys instead of HF's layer lists."""
    out = {k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    out.pop("partial_rotary_factor", None)
    out["compress_ratios"] = [_RATIO_OF[t] for t in config["layer_types"]] + [0]  # + the MTP layer
    out["compress_rate_csa"] = config["compress_rates"][CSA]
    out["compress_rate_hca"] = config["compress_rates"][HCA]
    out["num_hash_layers"] = config["mlp_layer_types"].count("hash_moe")
    out["qk_rope_head_dim"] = int(config["head_dim"] * config["partial_rotary_factor"])
    if fp8:
        out["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        out["expert_dtype"] = "fp4"
    return out


def official_state(state: dict[str, torch.Tensor], fp8: bool) -> dict[str, torch.Tensor]:
    """`state` under the official names, dtypes and (with fp8) quantization."""
    out: dict[str, torch.Tensor] = {}

    def put(key: str, value: torch.Tensor, quantize: str | None) -> None:
        if quantize == "fp8":
            out[key], out[key.removesuffix(".weight") + ".scale"] = quantize_fp8_block128(value)
        elif quantize == "fp4":
            out[key], out[key.removesuffix(".weight") + ".scale"] = quantize_fp4_block32(value)
        elif not value.is_floating_point():
            out[key] = value.to(torch.int32)  # the official code declares tid2eid int32
        elif key.endswith(_F32_SUFFIXES):
            out[key] = value.to(torch.float32)
        else:
            out[key] = value.to(torch.bfloat16)

    for name, value in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = name.split(".")[2]
            for e in range(value.shape[0]):
                base = f"layers.{layer}.ffn.experts.{e}."
                if name.endswith("gate_up_proj"):
                    gate, up = value[e].chunk(2, dim=0)
                    put(base + "w1.weight", gate.contiguous(), "fp4" if fp8 else None)
                    put(base + "w3.weight", up.contiguous(), "fp4" if fp8 else None)
                else:
                    put(base + "w2.weight", value[e].contiguous(), "fp4" if fp8 else None)
            continue
        key = names.official_name(name)
        if key is None:
            raise ValueError(f"no official name for {name}")
        put(key, value, "fp8" if fp8 and key.endswith(_FP8_SUFFIXES) else None)
    return out


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE (no merges: one token per byte) with V4's special tokens at the front,
    so BOS/EOS are ids 0/1 as the config says; it fits any vocab_size >= 263."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"the tiny tokenizer needs vocab_size >= {len(vocab)}")
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False, indent=2) + "\n")


def make_tiny(
    family: str, out: Path, seed: int = 0, layout: str = "hf", fp8: bool = False
) -> dict[str, torch.Tensor]:
    """Write the tiny checkpoint to `out`; returns the HF-named float values it was made from."""
    if family not in FAMILIES:
        raise ValueError(f"make-tiny knows {', '.join(FAMILIES)}, not {family!r}")
    if layout not in FORMATS:
        raise ValueError(f"--format is one of {', '.join(FORMATS)}")
    if fp8 and layout != "official":
        raise ValueError("--fp8 writes DeepSeek's official FP8/FP4 layout: use it with --format official")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_CONFIG)
    state = random_state(config, seed)
    if layout == "hf":
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt"}
        )
    else:
        (out / "config.json").write_text(json.dumps(official_config(config, fp8), indent=2) + "\n")
        _write_sharded(out, official_state(state, fp8))
    write_tokenizer(out, config["vocab_size"])
    return state


def _write_sharded(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    # Two shards (first half of the layers, the rest) so the index path is exercised too.
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    half = layers[len(layers) // 2] if layers else 0
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for key, value in tensors.items():
        first = key.startswith("layers.") and int(key.split(".")[1]) < half
        shards[0 if first else 1][key] = value
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), {"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(math.prod(v.shape) * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
