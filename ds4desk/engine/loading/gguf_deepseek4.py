"""A DeepSeek-V4 GGUF (llama.cpp's `deepseek4` architecture) as a loadable model, read in place.

What llama.cpp's converter does on the way from DeepSeek's official checkpoint, and how it is read:
- The FP8 linears are dequantized and stored as Q8_0; bf16 and float32 tensors keep their type;
  `llama-quantize` then puts most 2-D tensors in the chosen mix (even the hyper-connection maps and
  the compressors' position biases). The routed experts (models/deepseek_v4/modules.py's Experts),
  the linears a decode step reads whole (attention's, the compressors', the indexer's query, the
  shared expert's), the head and the embedding stay in their block types; every other tensor the
  model keeps as floats is dequantized while loading.
- The FP4 routed experts are repacked as MXFP4 (the same values and power-of-two scales) and
  stacked per projection: `ffn_gate_exps` (w1), `ffn_up_exps` (w3), `ffn_down_exps` (w2), each
  [experts, rows, columns], expert after expert. They stay stacked: the model's experts are three
  stacked tensors in the file's block types (config GGUF_EXPERTS_KEY says so).
- The hash-routing tables (`ffn_gate_tid2eid`) are I32; the hash layers' unused score bias is dropped.
- Nothing is permuted: ggml's rope rotates adjacent pairs, as V4 does, and the norms are stored as is.
- The schedule of attention kinds is the per-layer `attention.compress_ratios` (0 sliding, 4 CSA,
  128 HCA), the hash layers the first `hash_layer_count`.
The multi-token-prediction (MTP) block comes in a file of its own: llama.cpp's converter writes
it with `--mtp` (`mtp-<name>.gguf`), numbered after the trunk's layers (`blk.<n>.*`, `nextn_predict_layers`
1), its e_proj and h_proj side by side as one `nextn.eh_proj`, its final norm as
`nextn.shared_head_norm`, its stream head as `output_hc_*`, beside copies of the model's embedding,
head and final norm (what llama.cpp's draft needs; here the model's own are used). Such a file
beside the model (`mtp-<model file>`, or the only `mtp-*.gguf` there that fits) is loaded as the
model's MTP block; opened alone it is refused. MTP layers inside a model's own file are skipped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ds4desk.engine.api import EngineFailure
from ds4desk.engine.formats import GgufType
from ds4desk.engine.loading.deepseek_v4_names import with_mtp
from ds4desk.engine.loading.gguf_header import GGUFHeader, read_gguf_header
from ds4desk.engine.loading.gguf_meta import (
    IGNORED_TENSORS,
    MetaReader,
    gguf_entry,
    load_failed,
    special_token_ids,
    stored_type,
)
from ds4desk.engine.loading.source import NameLayout, TensorEntry

log = logging.getLogger(__name__)

DEEPSEEK4_ARCH = "deepseek4"
ARCHITECTURE = "DeepseekV4ForCausalLM"
# models/deepseek_v4/config.py's key (loading/ imports no family, hence the literal; a test holds
# the two equal): the routed experts are stacked per projection as the GGUF stores them.
GGUF_EXPERTS_KEY = "ds4desk_gguf_experts"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_KIND_OF_RATIO = {0: SLIDING, 4: CSA, 128: HCA}
_SQRT_SOFTPLUS = 4  # gguf's ExpertGatingFuncType.SQRTSOFTPLUS
# GGML's 32-bit integers, what llama.cpp stores the hash-routing tables in: read as plain integers,
# for those tables only (a weight stored so is refused as formats.py says).
_I32 = GgufType("I32", 26, 1, 4)
_HASH_TABLE = "mlp.gate.tid2eid"

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_.]+)\.(weight|bias)$")
_ANY_LAYER = re.compile(r"^blk\.(\d+)\.")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base",
    "output_hc_scale.weight": "model.hc_head.hc_scale",
}
# An MTP file's own tensors beyond a layer's: `blk.N.nextn.X.weight` and the stream head.
_NEXTN = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "shared_head_norm": "norm.weight"}
_MTP_HEAD = {
    "output_hc_fn.weight": "hc_head.hc_fn",
    "output_hc_base.weight": "hc_head.hc_base",
    "output_hc_scale.weight": "hc_head.hc_scale",
}
_SHARED = ("token_embd.weight", "output.weight", "output_norm.weight")  # the model's, copied beside
_NEXTN_TENSOR = re.compile(r"^blk\.(\d+)\.nextn\.([a-z_]+)\.weight$")

# GGUF layer tensor (part, suffix) -> the parameter within `model.layers.N.`.
_LAYER: dict[tuple[str, str], str] = {
    ("attn_norm", "weight"): "input_layernorm.weight",
    ("ffn_norm", "weight"): "post_attention_layernorm.weight",
    **{
        (f"hc_{site}_{p}", "weight"): f"{site}_hc.{p}"
        for site in ("attn", "ffn")
        for p in ("fn", "base", "scale")
    },
    ("attn_sinks", "weight"): "self_attn.sinks",
    ("attn_q_a", "weight"): "self_attn.q_a_proj.weight",
    ("attn_q_a_norm", "weight"): "self_attn.q_a_norm.weight",
    ("attn_q_b", "weight"): "self_attn.q_b_proj.weight",
    ("attn_kv", "weight"): "self_attn.kv_proj.weight",
    ("attn_kv_a_norm", "weight"): "self_attn.kv_norm.weight",
    ("attn_output_a", "weight"): "self_attn.o_a_proj.weight",
    ("attn_output_b", "weight"): "self_attn.o_b_proj.weight",
    ("attn_compressor_kv", "weight"): "self_attn.compressor.kv_proj.weight",
    ("attn_compressor_gate", "weight"): "self_attn.compressor.gate_proj.weight",
    ("attn_compressor_ape", "weight"): "self_attn.compressor.position_bias",
    ("attn_compressor_norm", "weight"): "self_attn.compressor.kv_norm.weight",
    ("indexer_compressor_kv", "weight"): "self_attn.compressor.indexer.kv_proj.weight",
    ("indexer_compressor_gate", "weight"): "self_attn.compressor.indexer.gate_proj.weight",
    ("indexer_compressor_ape", "weight"): "self_attn.compressor.indexer.position_bias",
    ("indexer_compressor_norm", "weight"): "self_attn.compressor.indexer.kv_norm.weight",
    ("indexer.attn_q_b", "weight"): "self_attn.compressor.indexer.q_b_proj.weight",
    ("indexer.proj", "weight"): "self_attn.compressor.indexer.scorer.weights_proj.weight",
    ("ffn_gate_inp", "weight"): "mlp.gate.weight",
    ("exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias",
    ("ffn_gate_tid2eid", "weight"): "mlp.gate.tid2eid",
    ("ffn_gate_shexp", "weight"): "mlp.shared_experts.gate_proj.weight",
    ("ffn_up_shexp", "weight"): "mlp.shared_experts.up_proj.weight",
    ("ffn_down_shexp", "weight"): "mlp.shared_experts.down_proj.weight",
    ("ffn_gate_exps", "weight"): "mlp.experts.gate_proj",
    ("ffn_up_exps", "weight"): "mlp.experts.up_proj",
    ("ffn_down_exps", "weight"): "mlp.experts.down_proj",
}


@dataclass(slots=True, frozen=True)
class Deepseek4Gguf:
    """What gguf_source needs of a DeepSeek-V4 file beyond its tokenizer."""

    config: dict[str, object]
    tensors: dict[str, TensorEntry]
    layout: NameLayout
    architecture: str = ARCHITECTURE


def deepseek4_model(path: Path, header: GGUFHeader, read: MetaReader) -> Deepseek4Gguf:
    """The config, the tensor entries (keyed by the model's parameter names) and the name layout of
    the DeepSeek-V4 GGUF at `path`; LOAD_FAILED naming the file and the key or tensor on any problem."""
    if _mtp_only(header, read):
        raise load_failed(
            path,
            "it holds only DeepSeek-V4's multi-token-prediction block (llama.cpp's `--mtp` export), "
            "not a model: open the model's own GGUF with this file beside it, named mtp-<that file's "
            "name>; the model then drafts with it (speculative mode mtp)",
        )
    config = _config(path, header, read)
    layers = config["num_hidden_layers"]
    assert isinstance(layers, int)
    tensors = _entries(path, header, layers, read.int_or("block_count", None))
    mtp = _mtp_beside(path, config, tensors)
    if mtp:
        tensors.update(mtp)
        config = with_mtp(config, tensors)
    return Deepseek4Gguf(
        config=config,
        tensors=tensors,
        layout=NameLayout("llama.cpp GGUF (deepseek4)", stored_name),
    )


def _mtp_only(header: GGUFHeader, read: MetaReader) -> bool:
    """A file of MTP layers alone: it declares some and holds no layer 0."""
    return read.int_or("nextn_predict_layers", 0) > 0 and not any(
        name.startswith("blk.0.") for name in header.tensors
    )


def _mtp_beside(
    path: Path, config: dict[str, object], tensors: dict[str, TensorEntry]
) -> dict[str, TensorEntry]:
    """The MTP block's entries (`mtp.0.*`) from the MTP file beside the model: `mtp-<its name>`,
    else the one `mtp-*.gguf` in its folder that fits it. A file that does not fit, or is damaged,
    is passed over with a log line: the model loads without MTP."""
    named = path.with_name(f"mtp-{path.name}")
    candidates = [named] if named.is_file() else sorted(path.parent.glob("mtp-*.gguf"))
    found: list[dict[str, TensorEntry]] = []
    for candidate in candidates:
        if candidate == path:
            continue
        try:
            found.append(_fitting(candidate, mtp_entries(candidate, config), tensors))
        except EngineFailure as exc:
            why = exc.error.detail
            log.warning("not loading %s as the MTP block of %s: %s", candidate.name, path.name, why)
    if len(found) > 1:
        log.warning("%d MTP files fit %s; loading none (name one mtp-%s)", len(found), path.name, path.name)
        return {}
    return found[0] if found else {}


def _fitting(
    path: Path, mtp: dict[str, TensorEntry], tensors: dict[str, TensorEntry]
) -> dict[str, TensorEntry]:
    """`mtp` where each of its layer tensors has the shape of the model's layers' own (so a block
    of another model is passed over rather than failing the model's load)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in tensors.items():
        match = _MODEL_LAYER.match(name)
        if match is not None:
            shapes.setdefault(match.group(2), tuple(entry.shape))
    for name, entry in mtp.items():
        part = name.removeprefix("mtp.0.")
        if part in shapes and tuple(entry.shape) != shapes[part]:
            raise load_failed(path, f"its {part} is {list(entry.shape)}, the model's {list(shapes[part])}")
    return mtp


def mtp_entries(path: Path, config: dict[str, object]) -> dict[str, TensorEntry]:
    """The entries of llama.cpp's MTP file at `path` (see the module's docstring) for the model of
    `config`, under the MTP block's names; LOAD_FAILED naming the file where it does not fit."""
    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    if arch != DEEPSEEK4_ARCH:
        raise load_failed(path, f"it is a GGUF for '{arch}', not DeepSeek-V4's MTP block")
    read = MetaReader(path, header.metadata, DEEPSEEK4_ARCH)
    if not _mtp_only(header, read):
        raise load_failed(path, "it is not an MTP file (no nextn_predict_layers, or it holds a model)")
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    assert isinstance(layers, int) and isinstance(hidden, int)
    first = read.int_or("block_count", None) - read.int_or("nextn_predict_layers", 0)
    sizes = {
        "layers before its own": (first, layers),
        "width": (read.int_or("embedding_length", None), hidden),
        "experts": (read.int_or("expert_count", None), config["n_routed_experts"]),
    }
    for what, (its, ours) in sizes.items():
        if its != ours:
            raise load_failed(path, f"its {what} ({its}) are not the model's ({ours})")
    entries: dict[str, TensorEntry] = {}
    for name, t in header.tensors.items():
        if IGNORED_TENSORS.match(name) or name in _SHARED:
            continue
        head = _MTP_HEAD.get(name)
        nextn = _NEXTN_TENSOR.match(name)
        layer = _LAYER_TENSOR.match(name)
        block = int((nextn or layer).group(1)) - first if (nextn or layer) else -1
        if head is not None:
            entries[f"mtp.0.{head}"] = gguf_entry(path, stored_type(path, t), t.shape, t.offset, t.nbytes)
            continue
        if block != 0:  # one block: llama.cpp's export names every block's stream head alike
            raise load_failed(path, f"tensor '{name}' is not part of the one MTP block ds4desk reads")
        is_table = layer is not None and layer.group(2) == "ffn_gate_tid2eid" and int(t.qtype) == _I32.type_id
        kind = _I32 if is_table else stored_type(path, t)
        if nextn is not None and nextn.group(2) == "eh_proj":
            if tuple(t.shape) != (hidden, 2 * hidden):
                raise load_failed(path, f"'{name}' is {list(t.shape)}, not [{hidden}, {2 * hidden}]")
            whole = gguf_entry(path, kind, (hidden, hidden), t.offset, t.nbytes)
            entries["mtp.0.e_proj.weight"] = replace(whole, columns=(0, 2 * hidden))
            entries["mtp.0.h_proj.weight"] = replace(whole, columns=(hidden, 2 * hidden))
            continue
        part = _NEXTN.get(nextn.group(2)) if nextn else None
        if part is None and layer is not None:
            part = _LAYER.get((layer.group(2), layer.group(3)))
        if part is None:
            raise load_failed(path, f"tensor '{name}' has no counterpart in a DeepSeek-V4 MTP block")
        entries[f"mtp.0.{part}"] = gguf_entry(path, kind, t.shape, t.offset, t.nbytes)
    return entries


# --- the config ------------------------------------------------------------------------------------


def _config(path: Path, header: GGUFHeader, read: MetaReader) -> dict[str, object]:
    tensors, meta = header.tensors, header.metadata
    stored_layers = read.int_or("block_count", None)
    layers = stored_layers - read.int_or("nextn_predict_layers", 0)
    hidden = read.int_or("embedding_length", None)
    heads = read.int_or("attention.head_count", None)
    head_dim = read.int_or("attention.key_length", None)
    if layers <= 0 or not hidden or not heads or not head_dim:
        raise load_failed(
            path, f"implausible sizes: {layers} layers, width {hidden}, {heads} heads of {head_dim}"
        )
    if read.int_or("attention.head_count_kv", 1) != 1:
        raise load_failed(path, "DeepSeek-V4 has one shared key/value head; the file says otherwise")
    if read.int_or("attention.value_length", head_dim) != head_dim:
        raise load_failed(path, "keys and values of different widths are not DeepSeek-V4's attention")
    rotary = read.int_or("rope.dimension_count", None)
    if not 0 < rotary <= head_dim:
        raise load_failed(path, f"rope over {rotary} of {head_dim} head dimensions is not supported")
    gating = read.get("expert_gating_func")
    if gating != _SQRT_SOFTPLUS:
        raise load_failed(
            path, f"expert gating function {gating!r} is not DeepSeek-V4's sqrt(softplus) ({_SQRT_SOFTPLUS})"
        )
    if read.get("expert_weights_norm") is False:
        raise load_failed(path, "experts' weights not renormalised: not DeepSeek-V4's router")
    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2 or embed.shape[1] != hidden:
        raise load_failed(path, "it has no token_embd.weight of the model's width")
    hashed = read.int_or("hash_layer_count", 0)
    config: dict[str, object] = {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v4",
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "partial_rotary_factor": rotary / head_dim,
        "q_lora_rank": read.int_or("attention.q_lora_rank", None),
        "o_groups": read.int_or("attention.output_group_count", None),
        "o_lora_rank": read.int_or("attention.output_lora_rank", None),
        "sliding_window": read.int_or("attention.sliding_window", None),
        "hc_mult": read.int_or("hyper_connection.count", None),
        "hc_sinkhorn_iters": read.int_or("hyper_connection.sinkhorn_iterations", None),
        "hc_eps": read.float_or("hyper_connection.epsilon", 1e-6),
        "rms_norm_eps": read.float_or("attention.layer_norm_rms_epsilon", 1e-6),
        "n_routed_experts": read.int_or("expert_count", None),
        "num_experts_per_tok": read.int_or("expert_used_count", None),
        "n_shared_experts": read.int_or("expert_shared_count", 1),
        "moe_intermediate_size": _one_per_layer(path, read, "expert_feed_forward_length", int),
        "routed_scaling_factor": read.float_or("expert_weights_scale", 1.0),
        "swiglu_limit": _swiglu_limit(path, read),
        "scoring_func": "sqrtsoftplus",
        "layer_types": _layer_types(path, read, layers),
        "mlp_layer_types": ["hash_moe"] * min(hashed, layers) + ["moe"] * max(0, layers - hashed),
        "compress_rates": {CSA: 4, HCA: 128},
        "index_n_heads": read.int_or("attention.indexer.head_count", 64),
        "index_head_dim": read.int_or("attention.indexer.key_length", 128),
        "index_topk": read.int_or("attention.indexer.top_k", 512),
        "rope_theta": read.float_or("rope.freq_base", 10000.0),
        "compress_rope_theta": read.float_or("attention.compress_rope_freq_base", 160000.0),
        "rope_scaling": _rope_scaling(path, meta, read),
        "max_position_embeddings": read.int_or("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        GGUF_EXPERTS_KEY: True,
    }
    config.update(special_token_ids(meta))
    return config


def _one_per_layer(path: Path, read: MetaReader, key: str, kind: type) -> object:
    """A key llama.cpp may store once or per layer; DeepSeek-V4 has one value for all layers."""
    value = read.get(key)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise load_failed(path, f"metadata '{read.arch}.{key}' differs between layers ({value})")
        value = value[0]
    if kind is int and (type(value) is not int or value <= 0):
        raise load_failed(path, f"metadata '{read.arch}.{key}' is missing or not a positive integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise load_failed(path, f"metadata '{read.arch}.{key}' is missing or not a number")
    return value


def _swiglu_limit(path: Path, read: MetaReader) -> float:
    limit = float(_one_per_layer(path, read, "swiglu_clamp_exp", float))  # type: ignore[arg-type]
    if read.get("swiglu_clamp_shexp") is not None:
        shared = float(_one_per_layer(path, read, "swiglu_clamp_shexp", float))  # type: ignore[arg-type]
        if shared != limit:
            raise load_failed(
                path, f"the shared expert's SwiGLU clamp ({shared}) differs from the experts' ({limit})"
            )
    if limit <= 0:
        raise load_failed(path, f"SwiGLU clamp {limit} is not positive")
    return limit


def _layer_types(path: Path, read: MetaReader, layers: int) -> list[str]:
    ratios = read.get("attention.compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers:
        raise load_failed(
            path, f"metadata '{read.arch}.attention.compress_ratios' must list all {layers} layers"
        )
    bad = [r for r in ratios[:layers] if r not in _KIND_OF_RATIO]
    if bad:
        raise load_failed(path, f"compression ratio {bad[0]!r} is not DeepSeek-V4's (0, 4 or 128)")
    return [_KIND_OF_RATIO[r] for r in ratios[:layers]]


def _rope_scaling(path: Path, meta: dict[str, object], read: MetaReader) -> dict[str, object] | None:
    """YaRN for the compressed layers, as the official config's flat `rope_scaling` says it."""
    kind = read.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise load_failed(path, f"rope scaling '{kind}' is not supported; DeepSeek-V4 uses YaRN")
    return {
        "type": "yarn",
        "factor": read.float_or("rope.scaling.factor", 1.0),
        "original_max_position_embeddings": read.int_or("rope.scaling.original_context_length", None),
        "beta_fast": read.float_or("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": read.float_or("rope.scaling.yarn_beta_slow", 1.0),
    }


# --- the tensors -----------------------------------------------------------------------------------


def _entries(path: Path, header: GGUFHeader, layers: int, stored_layers: int) -> dict[str, TensorEntry]:
    """The model's parameter name -> where its bytes are, for every tensor of the trunk; tensors of
    the multi-token-prediction layers after it are skipped, any other stray refused."""
    entries: dict[str, TensorEntry] = {}
    for name, t in header.tensors.items():
        if IGNORED_TENSORS.match(name):
            continue
        model_name = _GLOBAL.get(name)
        if model_name is None:
            in_layer = _ANY_LAYER.match(name)
            if in_layer is not None and layers <= int(in_layer.group(1)) < stored_layers:
                continue  # an MTP layer (`blk.<n>.nextn.*` and its attention / MoE): not loaded
            match = _LAYER_TENSOR.match(name)
            part = _LAYER.get((match.group(2), match.group(3))) if match else None
            if match is None or part is None or int(match.group(1)) >= layers:
                raise load_failed(path, f"tensor '{name}' has no counterpart in a DeepSeek-V4 model")
            model_name = f"model.layers.{int(match.group(1))}.{part}"
        is_table = model_name.endswith(_HASH_TABLE) and int(t.qtype) == _I32.type_id
        kind = _I32 if is_table else stored_type(path, t)
        entries[model_name] = gguf_entry(path, kind, t.shape, t.offset, t.nbytes)
    return entries


# --- names back ------------------------------------------------------------------------------------

_MODEL_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def stored_name(model_name: str) -> str:
    """The GGUF tensor a parameter of the model comes from, as the user would look for it in the
    file (a missing tensor's message names it); the model's name where nothing maps it."""
    for gguf_name, ours in _GLOBAL.items():
        if ours == model_name:
            return gguf_name
    match = _MODEL_LAYER.match(model_name)
    if match is None:
        return model_name
    for (part, suffix), ours in _LAYER.items():
        if ours == match.group(2):
            return f"blk.{match.group(1)}.{part}.{suffix}"
    return model_name
