"""DeepSeek-V4's official checkpoint layout, mapped onto the names our model uses (transformers'
DeepseekV4ForCausalLM state-dict names).

The official files use the reference code's short names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, ...), store big matrices as FP8 with a `.scale` tensor beside
them and routed experts as packed FP4, one tensor per expert. Here every model tensor becomes one
TensorEntry that says where its bytes are and how to decode them; nothing is read.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.formats import FP4_DTYPES
from ds4desk.engine.loading.quant_checks import check_quantized
from ds4desk.engine.loading.source import TensorEntry

ARCHITECTURE = "DeepseekV4ForCausalLM"

# Names outside the layers.
TOP_LEVEL: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Within `layers.N.` (official) -> within `model.layers.N.` (ours). Routed experts are not here:
# they are merged per layer (see _experts).
LAYER: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{site}_{p}": f"{site}_hc.{p}" for site in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    # The attention's compressor, and the indexer (which HF nests inside the compressor).
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}

_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
SCALE_SUFFIX = ".scale"

log = logging.getLogger(__name__)


def _fail(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def is_official_layout(tensors: dict[str, Any]) -> bool:
    """True for the reference code's names; the HF layout has `model.`/`lm_head.` prefixes."""
    return "embed.weight" in tensors or any(name.startswith("layers.") for name in tensors)


def hf_name(official: str) -> str | None:
    """Our name for an official non-expert tensor; None for names we do not map (mtp.*, experts)."""
    if official in TOP_LEVEL:
        return TOP_LEVEL[official]
    match = _LAYER_RE.fullmatch(official)
    if match is None or match.group(2) not in LAYER:
        return None
    return f"model.layers.{match.group(1)}.{LAYER[match.group(2)]}"


def official_name(hf: str) -> str | None:
    """The inverse of hf_name (make-tiny writes official folders with it)."""
    for official, ours in TOP_LEVEL.items():
        if ours == hf:
            return official
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if match is None:
        return None
    for official, ours in LAYER.items():
        if ours == match.group(2):
            return f"layers.{match.group(1)}.{official}"
    return None


def _with_scale(name: str, key: str, raw: dict[str, TensorEntry], used: set[str]) -> TensorEntry:
    """The entry for stored tensor `key` (the model's `name`), paired with `key.scale` if present."""
    stored = raw[key]
    used.add(key)
    scale_key = key.removesuffix(".weight") + SCALE_SUFFIX
    scale = raw.get(scale_key)
    if scale is None:
        if stored.dtype == "F8_E4M3":
            raise _fail(f"{stored.file.name}: FP8 tensor {key} has no {scale_key} beside it")
        return TensorEntry(stored.file, stored.dtype, stored.shape, stored.begin, stored.end, key=key)
    used.add(scale_key)
    scale = TensorEntry(scale.file, scale.dtype, scale.shape, scale.begin, scale.end, key=scale_key)
    if stored.dtype in FP4_DTYPES and len(stored.shape) == 2:
        encoding, shape = "fp4_block32", (stored.shape[0], stored.shape[1] * 2)
    else:
        encoding, shape = "fp8_block128", stored.shape
    entry = TensorEntry(
        stored.file, stored.dtype, shape, stored.begin, stored.end, key=key, encoding=encoding, scale=scale
    )
    check_quantized(name, entry)
    return entry


def _experts(
    layer: str, experts: dict[int, dict[str, str]], raw: dict[str, TensorEntry], used: set[str]
) -> dict[str, TensorEntry]:
    """HF keeps a layer's routed experts as two stacked tensors: gate_up_proj [E, 2I, D] (each
    expert's w1 rows, then its w3 rows) and down_proj [E, D, I]."""
    count = max(experts) + 1
    missing = sorted(set(range(count)) - set(experts))
    if missing:
        raise _fail(f"official checkpoint: layer {layer} has no tensors for expert {missing[0]}")
    prefix = f"model.layers.{layer}.mlp.experts."
    result: dict[str, TensorEntry] = {}
    for target, kinds in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        name = prefix + target
        parts: list[TensorEntry] = []
        for e in range(count):
            for kind in kinds:
                key = experts[e].get(kind)
                if key is None:
                    raise _fail(
                        f"official checkpoint: layers.{layer}.ffn.experts.{e}.{kind}.weight is missing"
                    )
                parts.append(_with_scale(name, key, raw, used))
        first = parts[0]
        if any(p.shape != first.shape for p in parts):
            odd = next(p for p in parts if p.shape != first.shape)
            raise _fail(
                f"official checkpoint: {odd.key} has shape {list(odd.shape)}, "
                f"but {first.key} has {list(first.shape)}"
            )
        rows, cols = first.shape
        shape = (count, rows * len(kinds), cols)
        result[name] = TensorEntry(
            first.file, first.dtype, shape, first.begin, first.end, key=first.key,
            encoding=first.encoding, scale=first.scale, parts=tuple(parts),
        )  # fmt: skip
    return result


def official_tensors(raw: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The model's tensors (by our names) from an official checkpoint's headers. MTP tensors are
    ignored (we do not run the MTP head from this layout); any other unknown name is an error, so
    a checkpoint of a different model is not half-loaded silently."""
    tensors: dict[str, TensorEntry] = {}
    used: set[str] = set()
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for key in raw:
        if key.endswith(SCALE_SUFFIX) or key.startswith("mtp."):
            continue
        match = _LAYER_RE.fullmatch(key)
        expert = _EXPERT_RE.fullmatch(match.group(2)) if match else None
        if match is not None and expert is not None:
            experts[match.group(1)][int(expert.group(1))][expert.group(2)] = key
            continue
        name = hf_name(key)
        if name is None:
            raise _fail(f"official checkpoint: unknown tensor '{key}' in {raw[key].file.name}")
        tensors[name] = _with_scale(name, key, raw, used)
    for layer, per_expert in experts.items():
        tensors.update(_experts(layer, per_expert, raw, used))
    mtp = sum(key.startswith("mtp.") for key in raw)
    if mtp:
        log.info("skipping %d MTP tensors: ds4desk does not run the MTP head yet", mtp)
    stray = sorted(k for k in raw if k.endswith(SCALE_SUFFIX) and k not in used and not k.startswith("mtp."))
    if stray:
        raise _fail(f"official checkpoint: scale tensor '{stray[0]}' has no weight beside it")
    return tensors


_LAYER_TYPE_OF_RATIO = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's own config.json spells the layer schedule with legacy keys (`compress_ratios`,
    `num_hash_layers`, `compress_rate_csa/hca`, `qk_rope_head_dim`); fold them into the HF keys
    the model reads, as transformers does, so both spellings load alike. HF keys win."""
    out = dict(config)
    layers = out.get("num_hidden_layers")
    if type(layers) is not int or layers <= 0:
        raise _fail("config.json: num_hidden_layers must be a positive integer")
    rates = dict(out.get("compress_rates") or {})
    for legacy, kind in (
        ("compress_rate_csa", "compressed_sparse_attention"),
        ("compress_rate_hca", "heavily_compressed_attention"),
    ):
        if legacy in out:
            rates[kind] = out[legacy]
    if rates:
        out["compress_rates"] = rates
    ratios = out.get("compress_ratios")
    if "layer_types" not in out and ratios is not None:
        # The list also covers MTP/padding layers past num_hidden_layers; only the first L count.
        if not isinstance(ratios, list) or len(ratios) < layers:
            raise _fail(f"config.json: compress_ratios must list at least {layers} layers")
        bad = [r for r in ratios[:layers] if r not in _LAYER_TYPE_OF_RATIO]
        if bad:
            raise _fail(f"config.json: compress_ratios holds {bad[0]!r}; DeepSeek-V4 uses 0, 4 and 128")
        out["layer_types"] = [_LAYER_TYPE_OF_RATIO[r] for r in ratios[:layers]]
    hashed = out.get("num_hash_layers")
    if "mlp_layer_types" not in out and hashed is not None:
        if type(hashed) is not int or hashed < 0:
            raise _fail(f"config.json: num_hash_layers must be a non-negative integer, got {hashed!r}")
        out["mlp_layer_types"] = ["hash_moe"] * min(hashed, layers) + ["moe"] * max(0, layers - hashed)
    rope_dims, head_dim = out.get("qk_rope_head_dim"), out.get("head_dim")
    if (
        "partial_rotary_factor" not in out
        and type(rope_dims) is int
        and type(head_dim) is int
        and head_dim > 0
    ):
        out["partial_rotary_factor"] = rope_dims / head_dim
    return out


HF_SCALE_SUFFIX = ".weight_scale_inv"


def pair_hf_scales(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The HF layout of an FP8 checkpoint keeps DeepSeek's block scale as `X.weight_scale_inv`
    (a multiplier despite the name) beside an F8_E4M3 `X.weight`: pair them into one entry."""
    if not any(name.endswith(HF_SCALE_SUFFIX) for name in tensors):
        return tensors
    out: dict[str, TensorEntry] = {}
    scales = {name for name in tensors if name.endswith(HF_SCALE_SUFFIX)}
    for name, entry in tensors.items():
        if name in scales:
            if name.removesuffix("_scale_inv") not in tensors:
                raise _fail(f"{entry.file.name}: scale tensor '{name}' has no weight beside it")
            continue
        scale = tensors.get(name + "_scale_inv") if name.endswith(".weight") else None
        if scale is None:
            if entry.dtype == "F8_E4M3":
                raise _fail(f"{entry.file.name}: FP8 tensor {name} has no {name}_scale_inv beside it")
            out[name] = entry
            continue
        scale = TensorEntry(
            scale.file, scale.dtype, scale.shape, scale.begin, scale.end, key=name + "_scale_inv"
        )
        paired = TensorEntry(
            entry.file, entry.dtype, entry.shape, entry.begin, entry.end,
            key=name, encoding="fp8_block128", scale=scale,
        )  # fmt: skip
        check_quantized(name, paired)
        out[name] = paired
    return out


# The reference code's own config (`inference/config.json`, its ModelArgs) -> HF keys.
MODEL_ARGS_KEYS: dict[str, str] = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "n_hash_layers": "num_hash_layers",
    "max_seq_len": "max_position_embeddings",
}


def is_model_args_config(config: dict[str, Any]) -> bool:
    return "architectures" not in config and {"dim", "n_layers", "compress_ratios"} <= config.keys()


def model_args_to_hf(config: dict[str, Any]) -> dict[str, Any]:
    """A ModelArgs-style config as the HF-style one (legacy keys are folded by normalize_config).
    Its YaRN settings (rope_factor, original_seq_len, beta_fast/slow) become `rope_scaling`, which
    applies to the compressed layers only, as in the reference."""
    out = {MODEL_ARGS_KEYS.get(k, k): v for k, v in config.items()}
    out["architectures"] = [ARCHITECTURE]
    out.setdefault("model_type", "deepseek_v4")
    out.setdefault("num_key_value_heads", 1)
    out.setdefault("bos_token_id", 0)
    out.setdefault("eos_token_id", 1)
    factor = out.pop("rope_factor", None)
    original = out.pop("original_seq_len", None)
    fast, slow = out.pop("beta_fast", 32), out.pop("beta_slow", 1)
    if factor is not None and original and factor != 1:
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
            "beta_fast": fast,
            "beta_slow": slow,
        }
    return out
