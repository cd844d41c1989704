"""A DeepSeek-V4-Flash-shaped GGUF in llama.cpp's `deepseek4` layout with random weights: the file both
engines run in the one-GPU comparison (bench/flash_one_gpu.py --model FILE against llama-bench).

    python3 bench/flash_gguf.py OUT.gguf [--layers 4] [--experts Q2_K,Q2_K,Q3_K] [--tiny]

Flash's per-layer shapes with `--layers` of its layers (the whole file, 43 layers, is ~110 GB: more
than a 64 GB disk holds, so the peers are compared per layer). The routed experts are stacked per
projection in the given GGML block types (random codes, block scales that spread the values as the
other weights); the other matrices Q8_0, the router BF16, vectors and the hyper-connection maps
F32, the hash-routing tables I32 (distinct experts per token), as llama.cpp's converter and
llama-quantize leave a Q2_K-class mix. The vocabulary is byte-level tokens padded to Flash's 129,280
(prompts are token ids); tensor names come from ds4desk's own mapping (loading/gguf_deepseek4.py),
checked against llama.cpp by tests/engine/models/deepseek_v4/test_gguf_experts_synthetic.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds4desk.engine.formats import GGUF_TYPES, gguf_packed_bytes
from ds4desk.engine.loading.gguf_deepseek4 import DEEPSEEK4_ARCH, stored_name
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.synthetic import flash_config, random_gguf_blocks_

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_one_gpu import PROJECTIONS, geometry  # sibling scripts
from gguf_vocab import add_byte_level_vocab

_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_STD = 0.02
_FLOAT_KEEP = ("norm.weight", "sinks", "position_bias", "e_score_correction_bias", "_hc.", "hc_head.")


def write(path: Path, hf: dict[str, Any], types: dict[str, str], seed: int = 0) -> None:
    import gguf

    by_name = {kind.name: kind.type_id for kind in GGUF_TYPES.values()}
    config = dataclasses.replace(flash_config(**hf), gguf_experts=True)
    packed = {
        f"model.layers.{layer}.mlp.experts.{projection}": by_name[name]
        for layer in range(config.num_layers)
        for projection, name in types.items()
    }
    with torch.device("meta"):
        model = DeepseekV4Model(config, torch.bfloat16, quantized=False, packed=packed)
    writer = gguf.GGUFWriter(str(path), DEEPSEEK4_ARCH)
    _metadata(writer, hf)
    rng = np.random.default_rng(seed)
    torch_gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        gguf_name = stored_name(name)
        shape = tuple(param.shape)
        if name.endswith("tid2eid"):  # distinct experts per token, as a real table
            table = np.argsort(rng.random((shape[0], config.num_experts), dtype=np.float32), axis=1)
            writer.add_tensor(gguf_name, np.ascontiguousarray(table[:, : shape[1]]).astype(np.int32))
        elif param.dtype == torch.uint8:  # routed experts, in their block types
            blocks = torch.empty(shape, dtype=torch.uint8)
            random_gguf_blocks_(blocks, packed[name], torch_gen)
            block_type = gguf.GGMLQuantizationType(packed[name])
            writer.add_tensor(gguf_name, blocks.numpy(), raw_shape=shape, raw_dtype=block_type)
        elif len(shape) == 1 or any(key in name for key in _FLOAT_KEEP):
            writer.add_tensor(gguf_name, _floats(name, shape, rng))
        elif name.endswith("mlp.gate.weight"):
            values = torch.from_numpy(_floats(name, shape, rng)).to(torch.bfloat16)
            raw = values.view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gguf_name, _q8_0(shape, rng), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _floats(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith(("norm.weight", "_hc.scale", "hc_head.hc_scale")):
        return (0.5 + rng.random(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base", "hc_base")):
        return (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return (_STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _q8_0(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks (codes -127..127, one fp16 scale per 32) of about the weights' spread, as
    [rows, row bytes]."""
    kind = next(k for k in GGUF_TYPES.values() if k.name == "Q8_0")
    rows, cols = shape
    blocks = rng.integers(-127, 128, (rows * cols // kind.block_values, kind.block_bytes), dtype=np.int8)
    blocks = blocks.view(np.uint8)
    blocks[:, 0:2] = np.array([_STD / 73.0], dtype=np.float16).view(np.uint8)  # codes' RMS: ~73
    return blocks.reshape(rows, gguf_packed_bytes(kind.type_id, (cols,)))


def _metadata(w: Any, hf: dict[str, Any]) -> None:
    import gguf

    layers = hf["num_hidden_layers"]
    arch = DEEPSEEK4_ARCH

    def key(name: str) -> str:
        return f"{arch}.{name}"

    w.add_name(f"ds4desk-bench-flash-{layers}-layers")
    rope = hf["rope_scaling"]
    for name, value in {
        "block_count": layers,
        "context_length": 16384,
        "embedding_length": hf["hidden_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": 1,
        "expert_count": hf["n_routed_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_gating_func": 4,  # sqrt(softplus)
        "attention.key_length": hf["head_dim"],
        "attention.value_length": hf["head_dim"],
        "rope.dimension_count": int(hf["head_dim"] * hf["partial_rotary_factor"]),
        "attention.q_lora_rank": hf["q_lora_rank"],
        "attention.sliding_window": hf["sliding_window"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
        "expert_shared_count": 1,
        "attention.indexer.head_count": hf["index_n_heads"],
        "attention.indexer.key_length": hf["index_head_dim"],
        "attention.indexer.top_k": hf["index_topk"],
        "attention.output_group_count": hf["o_groups"],
        "attention.output_lora_rank": hf["o_lora_rank"],
        "hyper_connection.count": hf["hc_mult"],
        "hyper_connection.sinkhorn_iterations": hf["hc_sinkhorn_iters"],
        "hash_layer_count": hf["mlp_layer_types"].count("hash_moe"),
        "embedding_length_out": hf["hidden_size"] * hf["hc_mult"],
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }.items():
        w.add_uint32(key(name), value)
    for name, value in {
        "rope.freq_base": hf["rope_theta"],
        "attention.compress_rope_freq_base": hf["compress_rope_theta"],
        "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "expert_weights_scale": hf["routed_scaling_factor"],
        "hyper_connection.epsilon": hf["hc_eps"],
        "rope.scaling.factor": rope["factor"],
        "rope.scaling.yarn_beta_fast": rope["beta_fast"],
        "rope.scaling.yarn_beta_slow": rope["beta_slow"],
    }.items():
        w.add_float32(key(name), value)
    w.add_string(key("rope.scaling.type"), "yarn")
    w.add_bool(key("expert_weights_norm"), True)
    w.add_array(key("swiglu_clamp_exp"), [float(hf["swiglu_limit"])] * layers)
    w.add_array(key("swiglu_clamp_shexp"), [float(hf["swiglu_limit"])] * layers)
    w.add_array(key("attention.compress_ratios"), [_RATIO[t] for t in hf["layer_types"]])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q2_K)
    special = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    add_byte_level_vocab(w, hf["vocab_size"], special, "joyai-llm", eos_id=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", default="Q2_K,Q2_K,Q3_K", help="GGML types of gate, up and down")
    parser.add_argument("--tiny", action="store_true", help="bench/flash_one_gpu.py's small geometry")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.layers < 3 and not args.tiny:
        # Flash's first two layers are sliding-window only; llama.cpp (0.3.36's tree) stops with
        # SIGFPE on a file with no compressed-attention layer.
        parser.error("--layers must be 3 or more: llama.cpp needs one compressed-attention layer")
    types = dict(zip(PROJECTIONS, args.experts.split(","), strict=True))
    write(args.out, geometry(args.layers, args.tiny), types, args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
