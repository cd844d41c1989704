"""A Qwen3.5 GGUF (llama.cpp's `qwen35` and `qwen35moe`) as a loadable model, read in place.

llama.cpp's converter changes some tensors on the way to GGUF. Most are taken as stored, the model
following the file (models/qwen3_5/config.py's GGUF_LAYOUT_KEY); the rest are undone while copying:
- RMSNorm weights that Qwen3.5 centres on 0 (the layer norms, q/k norms, the final norm) are stored
  as 1 + w: `shift` = -1 gives w back. The linear layers' output norm is not centred, nor shifted.
- A_log is stored as the rate -exp(A_log) (`ssm_a`): the model keeps that rate (`neg_rate`).
- With more value heads than key heads, every per-value-head row, channel or column (q/k/v's value
  rows, z, beta, alpha, the rate, dt_bias, the convolution's value channels, out_proj's columns) is
  stored tiled over the key heads rather than grouped: the model computes in the file's order.
- The convolution is stored as [channels, kernel]; the model's [channels, 1, kernel] is the same bytes.
- MoE experts are stacked into one 3-D tensor per projection ([E, rows, cols], or gate and up
  together in `ffn_gate_up_exps`): each expert's rows are consecutive bytes, so each becomes an entry
  of its own (`mlp.experts.<e>.*`), and packed experts stay in their block type, expert by expert.
- The shared expert's gate is stored as a vector; the model's [1, hidden] is the same bytes.
Multi-token-prediction layers (`nextn_predict_layers`, stored after the trunk's) are not loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ds4desk.engine.formats import GgufType
from ds4desk.engine.loading.gguf_header import GGUFHeader, GGUFTensor
from ds4desk.engine.loading.gguf_meta import (
    IGNORED_TENSORS,
    MetaReader,
    gguf_entry,
    load_failed,
    special_token_ids,
    stored_type,
)
from ds4desk.engine.loading.source import NameLayout, TensorEntry

# llama.cpp's architecture -> the Hugging Face architecture the model registry knows.
QWEN35_ARCHES: dict[str, str] = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
# models/qwen3_5/config.py's GGUF_LAYOUT_KEY (loading/ imports no family, hence the literal; a test
# holds the two equal).
GGUF_LAYOUT_KEY = "ds4desk_gguf_layout"
LINEAR, FULL = "linear_attention", "full_attention"
_DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default, as transformers'
_SOFTMAX_GATING = 1  # gguf's ExpertGatingFuncType.SOFTMAX

_ANY_LAYER = re.compile(r"^blk\.(\d+)\.")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?$")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF layer tensor part -> the module it fills in a layer, by the layer kinds that have it.
_EVERY_LAYER = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
_FULL_PARTS = {
    "attn_q": "self_attn.q_proj",  # per head: the query, then its gate (as Hugging Face stores it)
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LINEAR_PARTS = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
}
# Parts stored without a module: the parameter itself (GGUF part, its suffix) -> the model's name.
_LINEAR_PARAMETERS = {("ssm_dt", "bias"): "linear_attn.dt_bias", ("ssm_a", None): "linear_attn.neg_rate"}
_DENSE_PARTS = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MOE_PARTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Stacked experts: GGUF part -> the projections it holds, in row order within an expert.
_EXPERT_PARTS = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
# Norms llama.cpp multiplies by as stored, where Qwen3.5 scales by 1 + w.
_SHIFTED = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"}


@dataclass(slots=True, frozen=True)
class Qwen35Gguf:
    """What gguf_source needs of a Qwen3.5 file beyond its tokenizer."""

    config: dict[str, object]
    tensors: dict[str, TensorEntry]
    layout: NameLayout
    architecture: str


def qwen35_model(path: Path, header: GGUFHeader, read: MetaReader) -> Qwen35Gguf:
    """The config, the tensor entries (keyed by the model's parameter names) and the name layout of
    the Qwen3.5 GGUF at `path`; LOAD_FAILED naming the file and the key or tensor on any problem."""
    config = _config(path, header, read)
    layer_types = config["layer_types"]
    assert isinstance(layer_types, list)
    moe = read.arch == "qwen35moe"
    return Qwen35Gguf(
        config=config,
        tensors=_entries(path, header, layer_types, read.int_or("block_count", None), moe),
        layout=NameLayout("llama.cpp GGUF", lambda name: stored_name(name, moe)),
        architecture=QWEN35_ARCHES[read.arch],
    )


# --- the config ------------------------------------------------------------------------------------


def _config(path: Path, header: GGUFHeader, read: MetaReader) -> dict[str, object]:
    tensors, meta = header.tensors, header.metadata
    stored_layers = read.int_or("block_count", None)
    layers = stored_layers - read.int_or("nextn_predict_layers", 0)
    hidden = read.int_or("embedding_length", None)
    heads = read.int_or("attention.head_count", None)
    kv_heads = read.int_or("attention.head_count_kv", heads)
    if layers <= 0 or not hidden or not heads or not kv_heads or heads % kv_heads:
        raise load_failed(
            path, f"implausible sizes: {layers} layers, width {hidden}, {heads}/{kv_heads} heads"
        )
    head_dim = read.int_or("attention.key_length", hidden // heads)
    if read.int_or("attention.value_length", head_dim) != head_dim:
        raise load_failed(path, "keys and values of different widths are not supported")
    rotary = read.int_or("rope.dimension_count", head_dim)
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise load_failed(path, f"rope over {rotary} of {head_dim} head dimensions is not supported")
    scaling = meta.get(f"{read.arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise load_failed(path, f"rope scaling '{scaling}' is not supported for Qwen3.5")
    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2 or embed.shape[1] != hidden:
        raise load_failed(path, "it has no token_embd.weight of the model's width")
    config: dict[str, object] = {
        "architectures": [QWEN35_ARCHES[read.arch]],
        "model_type": "qwen3_5_moe_text" if read.arch == "qwen35moe" else "qwen3_5_text",
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layer_types": _layer_types(path, read, stored_layers, layers),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": read.float_or("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": read.float_or("rope.freq_base", 10_000_000.0),
            "partial_rotary_factor": _rotary_factor(rotary, head_dim),
        },
        "max_position_embeddings": read.int_or("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensors),
        "hidden_act": "silu",
        "torch_dtype": "float32",
        GGUF_LAYOUT_KEY: True,
        **_linear_sizes(path, read),
        **(_moe_sizes(path, header, read) if read.arch == "qwen35moe" else _dense_sizes(header, read)),
    }
    config.update(special_token_ids(meta))
    return config


def _rotary_factor(rotary: int, head_dim: int) -> float:
    """partial_rotary_factor such that int(head_dim * factor) == rotary, as the config reads it back."""
    factor = rotary / head_dim
    while int(head_dim * factor) < rotary:  # a quotient rounded down by an ulp
        factor = math.nextafter(factor, 2.0)
    return factor


def _layer_types(path: Path, read: MetaReader, stored_layers: int, layers: int) -> list[str]:
    """Which layers are linear attention: the per-layer `attention.recurrent_layers` flags where the
    file has them, else every `full_attention_interval`-th layer is full attention (llama.cpp's rule)."""
    flags = read.get("attention.recurrent_layers")
    if flags is not None:
        if (
            not isinstance(flags, list)
            or len(flags) != stored_layers
            or any(type(f) not in (bool, int) for f in flags)
        ):
            raise load_failed(
                path, f"metadata '{read.arch}.attention.recurrent_layers' must flag every layer"
            )
        return [LINEAR if flags[i] else FULL for i in range(layers)]
    interval = read.int_or("full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL)
    if not interval:
        raise load_failed(path, f"metadata '{read.arch}.full_attention_interval' must be positive")
    return [LINEAR if (i + 1) % interval else FULL for i in range(layers)]


def _linear_sizes(path: Path, read: MetaReader) -> dict[str, object]:
    """The Gated DeltaNet sizes, from llama.cpp's SSM keys: the key head width is the state size,
    the key heads the groups, the value heads the time-step rank; inner size = value heads x width."""
    kernel = read.int_or("ssm.conv_kernel", None)
    key_dim = read.int_or("ssm.state_size", None)
    key_heads = read.int_or("ssm.group_count", None)
    value_heads = read.int_or("ssm.time_step_rank", None)
    inner = read.int_or("ssm.inner_size", None)
    if not (kernel and key_dim and key_heads and value_heads and inner) or inner % value_heads:
        raise load_failed(
            path,
            f"implausible linear-attention sizes: kernel {kernel}, {key_heads} key heads of {key_dim}, "
            f"{value_heads} value heads over an inner size of {inner}",
        )
    return {
        "linear_conv_kernel_dim": kernel,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": inner // value_heads,
    }


def _dense_sizes(header: GGUFHeader, read: MetaReader) -> dict[str, object]:
    up = header.tensors.get("blk.0.ffn_up.weight")
    return {"intermediate_size": read.int_or("feed_forward_length", up.shape[0] if up is not None else None)}


def _moe_sizes(path: Path, header: GGUFHeader, read: MetaReader) -> dict[str, object]:
    experts = read.int_or("expert_count", None)
    used = read.int_or("expert_used_count", None)
    if not experts or not used or used > experts:
        raise load_failed(path, f"implausible experts: {used} used of {experts}")
    gating = read.get("expert_gating_func")
    if gating is not None and gating != _SOFTMAX_GATING:
        raise load_failed(path, f"expert gating function {gating!r} is not supported (Qwen3.5 uses softmax)")
    width = read.get("expert_feed_forward_length")
    if isinstance(width, list):  # per layer: Qwen3.5 has one width
        if not width or any(w != width[0] for w in width):
            raise load_failed(path, f"experts of different widths per layer are not supported ({width})")
        width = width[0]
    if width is None:
        stacked = header.tensors.get("blk.0.ffn_down_exps.weight")
        width = stacked.shape[-1] if stacked is not None else None
    shared_down = header.tensors.get("blk.0.ffn_down_shexp.weight")
    shared = read.int_or(
        "expert_shared_feed_forward_length", shared_down.shape[-1] if shared_down is not None else None
    )
    if type(width) is not int or width <= 0 or not shared:
        raise load_failed(path, f"implausible expert widths: {width!r} routed, {shared!r} shared")
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": shared,
    }


# --- the tensors -----------------------------------------------------------------------------------


def _entries(
    path: Path, header: GGUFHeader, layer_types: list[str], stored_layers: int, moe: bool
) -> dict[str, TensorEntry]:
    """The model's parameter name -> where its bytes are, for every tensor of the trunk's layers;
    tensors of the multi-token-prediction layers after them are skipped, any other stray refused."""
    entries: dict[str, TensorEntry] = {}
    for name, t in header.tensors.items():
        if IGNORED_TENSORS.match(name):
            continue
        kind = stored_type(path, t)
        model_name = _GLOBAL.get(name)
        if model_name is not None:
            shift = -1.0 if name == "output_norm.weight" else 0.0
            entries[model_name] = gguf_entry(path, kind, t.shape, t.offset, t.nbytes, shift=shift)
            continue
        in_layer = _ANY_LAYER.match(name)
        if in_layer is not None and len(layer_types) <= int(in_layer.group(1)) < stored_layers:
            continue  # a multi-token-prediction layer (`blk.<n>.nextn.*` and the like): not run
        match = _LAYER_TENSOR.match(name)
        if match is None or int(match.group(1)) >= stored_layers:
            raise load_failed(path, f"tensor '{name}' has no counterpart in a Qwen3.5 model")
        layer, part, suffix = int(match.group(1)), match.group(2), match.group(3)
        prefix = f"model.layers.{layer}"
        if part in _EXPERT_PARTS and moe and suffix == "weight":
            entries |= _expert_entries(path, t, kind, prefix, _EXPERT_PARTS[part])
            continue
        module = _module_of(path, name, part, suffix, layer_types[layer], moe)
        shape: tuple[int, ...] = t.shape
        if part == "ssm_conv1d" and len(shape) == 2:
            shape = (shape[0], 1, shape[1])
        elif part == "ffn_gate_inp_shexp" and len(shape) == 1:
            shape = (1, shape[0])
        # A parameter stored on its own (dt_bias, neg_rate) is named by the module path alone.
        is_parameter = (part, suffix) in _LINEAR_PARAMETERS
        full_name = f"{prefix}.{module}" if is_parameter else f"{prefix}.{module}.{suffix}"
        shift = -1.0 if part in _SHIFTED else 0.0
        entries[full_name] = gguf_entry(path, kind, shape, t.offset, t.nbytes, shift=shift)
    return entries


def _module_of(path: Path, name: str, part: str, suffix: str | None, kind: str, moe: bool) -> str:
    """The module (or parameter) a layer tensor fills; LOAD_FAILED naming it when the layer's kind
    (from the metadata) has no such tensor."""
    parameter = _LINEAR_PARAMETERS.get((part, suffix))
    if parameter is not None:
        if kind != LINEAR:
            raise _wrong_kind(path, name, LINEAR)
        return parameter
    if suffix is not None:
        for table, wanted in ((_FULL_PARTS, FULL), (_LINEAR_PARTS, LINEAR)):
            if part in table:
                if kind != wanted:
                    raise _wrong_kind(path, name, wanted)
                return table[part]
        ffn = _MOE_PARTS if moe else _DENSE_PARTS
        module = _EVERY_LAYER.get(part) or ffn.get(part)
        if module is not None:
            return module
    what = "mixture-of-experts" if moe else "dense"
    raise load_failed(path, f"tensor '{name}' has no counterpart in a {what} Qwen3.5 model")


def _wrong_kind(path: Path, name: str, wanted: str) -> Exception:
    layer = name.split(".")[1]
    other = FULL if wanted == LINEAR else LINEAR
    return load_failed(
        path,
        f"tensor '{name}' belongs to a {wanted} layer, but the metadata makes layer {layer} {other}",
    )


def _expert_entries(
    path: Path, t: GGUFTensor, kind: GgufType, prefix: str, projections: tuple[str, ...]
) -> dict[str, TensorEntry]:
    """One entry per expert and projection of a stacked [E, rows, cols] tensor: expert e's rows are
    bytes e * rows * row_bytes onward, `projections` splitting them evenly in order."""
    if len(t.shape) != 3 or t.shape[1] % len(projections):
        raise load_failed(path, f"tensor '{t.name}' has shape {list(t.shape)}, not [experts, rows, columns]")
    experts, rows, cols = t.shape
    per_expert, remainder = divmod(t.nbytes, experts)
    if remainder or per_expert % len(projections):
        raise load_failed(path, f"tensor '{t.name}' does not divide into {experts} experts")
    part_rows, part_bytes = rows // len(projections), per_expert // len(projections)
    out: dict[str, TensorEntry] = {}
    for expert in range(experts):
        for index, projection in enumerate(projections):
            begin = t.offset + expert * per_expert + index * part_bytes
            name = f"{prefix}.mlp.experts.{expert}.{projection}.weight"
            out[name] = gguf_entry(path, kind, (part_rows, cols), begin, part_bytes)
    return out


# --- names back ------------------------------------------------------------------------------------

_MODEL_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stored_name(model_name: str, moe: bool) -> str:
    """The GGUF tensor a parameter of the model comes from, as the user would look for it in the
    file (a missing tensor's message names this); the model's name where nothing maps it."""
    for gguf_name, ours in _GLOBAL.items():
        if ours == model_name:
            return gguf_name
    match = _MODEL_LAYER.match(model_name)
    if match is None:
        return model_name
    layer, rest = match.group(1), match.group(2)
    expert = _EXPERT.match(rest)
    if expert is not None:
        # The stacked tensor holding the expert (the message adds the model's name, which says which).
        part = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
        return f"blk.{layer}.{part[expert.group(2)]}.weight"
    for (part, suffix), ours in _LINEAR_PARAMETERS.items():
        if rest == ours:
            return f"blk.{layer}.{part}" + (f".{suffix}" if suffix else "")
    module, _, suffix = rest.rpartition(".")
    tables = (_EVERY_LAYER, _FULL_PARTS, _LINEAR_PARTS, _MOE_PARTS if moe else _DENSE_PARTS)
    for table in tables:
        for part, ours in table.items():
            if ours == module:
                return f"blk.{layer}.{part}.{suffix}"
    return model_name
