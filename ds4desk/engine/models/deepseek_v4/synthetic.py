"""Random DeepSeek-V4 models made directly on their devices, with no files.

The full Flash geometry (43 layers, 256 experts, 284B parameters) fits two GPUs only as the
official checkpoint keeps it, FP8 linears and packed FP4 experts; writing ~150 GB of random
safetensors to read them back would test the disk, not the engine. Benchmarks and the two-GPU test
build such a model here, and check it against `dense_layer`, one layer at a time in bf16. With its
routed experts in GGUF block types of 2-3 bits (`build_gguf_experts`, a Q2_K-class mix) it is about
100 GB: one GPU's worth.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from ds4desk.engine.formats import GGUF_TYPES, gguf_type
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.kernels.quant.fp4 import fp4_dequantize
from ds4desk.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.modules import Experts
from ds4desk.engine.split import ShardPlan

# The published DeepSeek-V4-Flash config, in transformers' keys.
FLASH_CONFIG: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "partial_rotary_factor": 64 / 512,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    # Layers 0-1 sliding, then CSA on even and HCA on odd layers; the first three hash-routed.
    "layer_types": [SLIDING, SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(2, 43)],
    "mlp_layer_types": [HASH_MOE] * 3 + [MOE] * 40,
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

_STD = 0.02  # weights; the FP4 experts get the nearest power-of-two scale to it
_SAMPLE_BLOCKS = 1024  # random GGUF blocks: how many their spread is measured on
_E2M1_RMS = 2.93  # root mean square of the 16 e2m1 codes, uniformly drawn
# The UE8M0 byte (2^(s-127) per 32 values) drawn around: a spread of ~0.02 like the other weights.
_FP4_EXPONENT = 127 + round(math.log2(_STD / _E2M1_RMS))


def flash_config(**overrides: Any) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf({**FLASH_CONFIG, **overrides})


def build_quantized(
    config: DeepseekV4Config,
    device: torch.device,
    plan: ShardPlan | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> DeepseekV4Model:
    """A quantized model (FP8 linears, FP4 experts) with random weights, on `device` or split by
    `plan`, ready for allocate_cache."""
    with torch.device("meta"):
        model = DeepseekV4Model(config, dtype, quantized=True)
    if plan is not None:
        model.place(plan)
    model.materialize(device)
    fill_random_(model, seed)
    model.finish_loading()
    return model


def build_gguf_experts(
    config: DeepseekV4Config,
    device: torch.device,
    types: dict[str, str],
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> DeepseekV4Model:
    """A model as a GGUF mix of the official weights holds it, with random weights on `device`: FP8
    linears, the routed experts stacked per projection in GGUF block types (`types`: gate_proj,
    up_proj, down_proj -> a GGML type name such as "Q2_K"), kept packed."""
    by_name = {kind.name: kind.type_id for kind in GGUF_TYPES.values()}
    packed = {
        f"model.layers.{layer}.mlp.experts.{projection}": by_name[name]
        for layer in range(config.num_layers)
        for projection, name in types.items()
    }
    config = dataclasses.replace(config, gguf_experts=True)
    with torch.device("meta"):
        model = DeepseekV4Model(config, dtype, quantized=True, packed=packed)
    model.materialize(device)
    fill_random_(model, seed)
    model.finish_loading()
    return model


@torch.inference_mode()
def fill_random_(model: DeepseekV4Model, seed: int = 0) -> None:
    """Fill every parameter of a materialized model with random values on its own device:
    normal weights (then FP8-quantized per 128 x 128 block where the model keeps FP8), random FP4
    bytes with per-32 exponents around a 0.02 spread, random GGUF blocks of about that spread, norms
    near 1, distinct hash-routed experts."""
    experts = model.config.num_experts
    for index, (prefix, module) in enumerate(model.named_modules()):
        params = dict(module.named_parameters(recurse=False))
        for name, param in params.items():
            gen = torch.Generator(param.device).manual_seed(seed * 100_003 + index * 17 + len(name))
            full = f"{prefix}.{name}"
            if name == "weight_scale_inv":
                continue  # set with its weight
            if isinstance(module, Experts) and module.type_ids.get(name, -1) >= 0:
                random_gguf_blocks_(param, module.type_ids[name], gen)
            elif param.dtype == torch.float8_e4m3fn:
                _quantize_fp8_into(param, module.weight_scale_inv, _normal(param.shape, gen, param.device))
            elif param.dtype == torch.uint8 and name.endswith("_scale"):
                low, high = _FP4_EXPONENT - 1, _FP4_EXPONENT + 2
                param.copy_(torch.randint(low, high, param.shape, generator=gen, device=param.device))
            elif param.dtype == torch.uint8:
                param.copy_(torch.randint(0, 256, param.shape, generator=gen, device=param.device))
            elif name == "tid2eid":
                rows, k = param.shape
                for start in range(0, rows, 8192):  # distinct experts per token, as a real table
                    count = min(8192, rows - start)
                    order = torch.rand((count, experts), generator=gen, device=param.device).argsort(dim=1)
                    param[start : start + count] = order[:, :k]
            elif full.endswith(("norm.weight", "_hc.scale", "hc_head.hc_scale")):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen, device=param.device))
            elif name in ("sinks", "position_bias", "e_score_correction_bias", "base", "hc_base"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen, device=param.device))
            else:
                param.copy_(_normal(param.shape, gen, param.device))


def random_gguf_blocks_(param: torch.Tensor, type_id: int, gen: torch.Generator) -> None:
    """Random GGUF blocks of `type_id` in `param` (uint8, whole blocks): random codes and sub-block
    scales, and one fp16 block scale (d, and dmin where the type has one) for all, chosen so the
    values spread about as the other random weights do."""
    kind = gguf_type(type_id)
    if not kind.fp16_scales:
        raise ValueError(f"random {kind.name} blocks are not made here")
    param.copy_(torch.randint(0, 256, param.shape, generator=gen, device=param.device, dtype=torch.uint8))
    blocks = param.view(-1, kind.block_bytes)

    def set_scale(value: float) -> None:
        scale = torch.tensor([value], dtype=torch.float16, device=param.device).view(torch.uint8)
        for at in kind.fp16_scales:
            blocks[:, at : at + 2] = scale

    set_scale(1.0)
    sample = blocks[:_SAMPLE_BLOCKS]  # the spread at scale 1, measured on a sample
    spread = gguf.dequantize(sample, type_id, (sample.shape[0] * kind.block_values,))
    set_scale(_STD / float(spread.std()))


def _normal(shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return _STD * torch.randn(shape, generator=gen, device=device)


def _quantize_fp8_into(weight: torch.Tensor, scale: torch.Tensor, values: torch.Tensor) -> None:
    """Per 128 x 128 block the smallest power of two that keeps the block within e4m3's 448."""
    rows, cols = values.shape
    br, bc = scale.shape
    padded = torch.nn.functional.pad(values.float(), (0, bc * 128 - cols, 0, br * 128 - rows))
    amax = padded.view(br, 128, bc, 128).abs().amax(dim=(1, 3)).clamp(min=1e-30)
    block = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    scale.copy_(block)
    full = block.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    weight.copy_((values.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn))


def dense_layer(model: DeepseekV4Model, index: int, dtype: torch.dtype) -> DeepseekV4Model:
    """A one-layer dense model in `dtype` holding layer `index` of a quantized model, dequantized,
    on that layer's device, with the same hyper-connection head and norm: the reference that layer
    is checked against (`reference._block(0, reference.model.layers[0], ...)`)."""
    cfg = model.config
    one = dataclasses.replace(
        cfg,
        num_layers=1,
        layer_types=(cfg.layer_types[index],),
        mlp_layer_types=(cfg.mlp_layer_types[index],),
    )
    layer = model.model.layers[index]
    device = layer.input_layernorm.weight.device
    with torch.device("meta"):
        reference = DeepseekV4Model(one, dtype)
    reference.materialize(device)
    with torch.inference_mode():
        copy_dequantized(layer, reference.model.layers[0], dtype)
        for name in ("embed_tokens", "norm", "hc_head"):
            for target, source in zip(
                getattr(reference.model, name).parameters(),
                getattr(model.model, name).parameters(),
                strict=True,
            ):
                target.copy_(source)
        if reference.lm_head is not None and model.lm_head is not None:
            reference.lm_head.weight.copy_(model.lm_head.weight)
    reference.finish_loading()
    return reference


def copy_dequantized(source: nn.Module, target: nn.Module, dtype: torch.dtype) -> None:
    """Fill `target` (a dense model or module) from `source` (its quantized twin), dequantizing
    FP8 weights and packed FP4 experts; every other parameter is copied as it is."""
    wanted = dict(target.named_parameters())
    given = dict(source.named_parameters())
    for name, param in wanted.items():
        value = given[name]
        if value.dtype == torch.float8_e4m3fn:
            scale = given[name.removesuffix("weight") + "weight_scale_inv"]
            rows, cols = value.shape
            full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            param.copy_(value.float() * full)
        elif value.dtype == torch.uint8:  # packed FP4 experts: one at a time
            scale = given[name + "_scale"]
            for expert in range(value.shape[0]):
                param[expert].copy_(fp4_dequantize(value[expert], scale[expert], dtype))
        else:
            param.copy_(value)
