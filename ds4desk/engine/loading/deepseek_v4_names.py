"""DeepSeek-V4's checkpoint name layouts, mapped onto the names our model uses (transformers'
DeepseekV4ForCausalLM state-dict names).

Three layouts are in circulation, told apart by their names (recognise_layout):

- DeepSeek's official release: the reference code's short names (`embed.weight`,
  `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, `mtp.K.e_proj.weight`, ...),
  big matrices as FP8 with a `.scale` tensor beside them, routed experts as packed FP4, one tensor
  per expert.
- What transformers' `save_pretrained` writes by default (it converts back to the names it loads
  from): the official layer names under `model.` (`model.layers.N.attn.attn_sink`), plus
  `model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_fn` and `head.weight`.
- transformers' module names (`save_pretrained(save_original_format=False)`): our own names, with
  FP8 scales spelled `X.weight_scale_inv`.

Every model tensor becomes one TensorEntry that says where its bytes are and how to decode them
(`key`: the stored name); nothing is read. MTP blocks (`mtp.K.*`) are mapped like layers, plus
their own projections, norms and head, and kept under `mtp.K.` (the model builds them when the
checkpoint holds them, see mtp_layer_kinds).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from functools import partial
from typing import Any

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.formats import FP4_DTYPES
from ds4desk.engine.loading.quant_checks import check_quantized
from ds4desk.engine.loading.source import NameLayout, TensorEntry

# The layer kinds (models/deepseek_v4/config.py spells them alike).
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"

ARCHITECTURE = "DeepseekV4ForCausalLM"

# The layouts, named as a user would recognise them (error messages say which one was recognised).
OFFICIAL = "DeepSeek official"
SAVE_PRETRAINED = "transformers save_pretrained"
MODULE_NAMES = "transformers module-name"

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

# An MTP block is a layer (LAYER, within `mtp.K.`) plus what turns the main model's streams and
# the next token's embedding into its input, and its own final norm and stream head.
MTP_EXTRA: dict[str, str] = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}

# `layers.N.rest` or `mtp.K.rest` (official) and `model.layers.N.rest` or `mtp.K.rest` (ours).
_BLOCK_RE = re.compile(r"(layers|mtp)\.(\d+)\.(.+)")
_OURS_RE = re.compile(r"(model\.layers|mtp)\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
SCALE_SUFFIX = ".scale"

# save_pretrained's names outside the layers -> the official ones (the layers only lose `model.`).
_SAVED_TOP_LEVEL: dict[str, str] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "lm_head.weight": "head.weight",  # a mix some re-uploads carry
}
# Within a layer: save_pretrained undoes transformers' load-time renames one by one, and its
# `.norm.` -> `.kv_norm.` rule (meant for the compressors' norms) turns the attention's own
# `attn.kv_norm` into `attn.norm` on the way back.
_SAVED_LAYER_ALIASES: dict[str, str] = {"attn.norm.weight": "attn.kv_norm.weight"}
_SAVED_LAYER_RE = re.compile(r"model\.layers\.\d+\.(attn\.|ffn\.|attn_norm\.|ffn_norm\.|hc_attn_|hc_ffn_)")

log = logging.getLogger(__name__)


def _fail(detail: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def is_official_layout(tensors: dict[str, Any]) -> bool:
    """True for the reference code's names; the HF layouts have `model.`/`lm_head.` prefixes."""
    return "embed.weight" in tensors or any(name.startswith("layers.") for name in tensors)


def recognise_layout(tensors: dict[str, Any]) -> str:
    """Which of the three name layouts `tensors` (stored names) is in."""
    if is_official_layout(tensors):
        return OFFICIAL
    if "head.weight" in tensors or any(_SAVED_LAYER_RE.match(name) for name in tensors):
        return SAVE_PRETRAINED
    return MODULE_NAMES


def hf_name(official: str) -> str | None:
    """Our name for an official non-expert tensor; None for names we do not map (experts)."""
    if official in TOP_LEVEL:
        return TOP_LEVEL[official]
    match = _BLOCK_RE.fullmatch(official)
    if match is None:
        return None
    kind, index, rest = match.groups()
    if kind == "mtp" and rest in MTP_EXTRA:
        return f"mtp.{index}.{MTP_EXTRA[rest]}"
    if rest not in LAYER:
        return None
    return f"{'model.layers' if kind == 'layers' else 'mtp'}.{index}.{LAYER[rest]}"


def official_name(hf: str) -> str | None:
    """The inverse of hf_name (make-tiny writes official folders with it)."""
    for official, ours in TOP_LEVEL.items():
        if ours == hf:
            return official
    match = _OURS_RE.fullmatch(hf)
    if match is None:
        return None
    kind, index, rest = match.groups()
    block = "layers" if kind == "model.layers" else "mtp"
    tables = (LAYER, MTP_EXTRA) if block == "mtp" else (LAYER,)
    for table in tables:
        for official, ours in table.items():
            if ours == rest:
                return f"{block}.{index}.{official}"
    return None


def stored_name(layout: str, ours: str) -> str:
    """How `layout` spells the model's tensor `ours` (for the message about a missing one). Stacked
    experts are stored one matrix per expert: the name of expert 0's first one stands for them."""
    if layout == MODULE_NAMES:
        return ours
    stacked = re.fullmatch(r"(model\.layers|mtp)\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", ours)
    if stacked is not None:
        kind, index, which = stacked.groups()
        block = "layers" if kind == "model.layers" else "mtp"
        first = "w1" if which == "gate_up_proj" else "w2"
        official: str | None = f"{block}.{index}.ffn.experts.0.{first}.weight"
    else:
        official = official_name(ours)
    return ours if official is None else _spelled(layout, official)


def name_layout(layout: str) -> NameLayout:
    """`layout` for a ModelSource: its name and how it spells each of the model's tensors."""
    return NameLayout(layout, partial(stored_name, layout))


def _as_official(raw: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """save_pretrained's names turned into the official ones; each entry keeps its stored name."""
    out: dict[str, TensorEntry] = {}
    for key, entry in raw.items():
        if key in _SAVED_TOP_LEVEL:
            official = _SAVED_TOP_LEVEL[key]
        elif block := _BLOCK_RE.fullmatch(key.removeprefix("model.")):
            kind, index, rest = block.groups()
            official = f"{kind}.{index}.{_SAVED_LAYER_ALIASES.get(rest, rest)}"
        else:
            official = key  # head.weight, mtp.K.*, or a name the official mapping will refuse
        if official in out:
            raise _fail(
                f"{SAVE_PRETRAINED} checkpoint: '{key}' and '{out[official].key}' are the same tensor"
            )
        out[official] = _renamed(entry, entry.key or key)
    return out


def _renamed(entry: TensorEntry, key: str) -> TensorEntry:
    return TensorEntry(entry.file, entry.dtype, entry.shape, entry.begin, entry.end, key=key)


def layout_tensors(raw: dict[str, TensorEntry]) -> tuple[str, dict[str, TensorEntry]]:
    """The recognised layout and the model's tensors (by our names) from the headers `raw`."""
    layout = recognise_layout(raw)
    if layout == OFFICIAL:
        return layout, official_tensors(raw)
    if layout == SAVE_PRETRAINED:
        return layout, official_tensors(_as_official(raw), SAVE_PRETRAINED)
    return layout, pair_hf_scales(raw)  # FP8 kept in the HF layout


def _with_scale(name: str, key: str, raw: dict[str, TensorEntry], used: set[str]) -> TensorEntry:
    """The entry for tensor `key` (official spelling; the model's `name`), paired with `key.scale`
    if present. Entries keep the name they are stored under (`key` unless renamed before)."""
    stored = raw[key]
    used.add(key)
    file_key = stored.key or key
    scale_key = key.removesuffix(".weight") + SCALE_SUFFIX
    scale = raw.get(scale_key)
    if scale is None:
        if stored.dtype == "F8_E4M3":
            raise _fail(f"{stored.file.name}: FP8 tensor {file_key} has no {scale_key} beside it")
        return _renamed(stored, file_key)
    used.add(scale_key)
    scale = _renamed(scale, scale.key or scale_key)
    if stored.dtype in FP4_DTYPES and len(stored.shape) == 2:
        encoding, shape = "fp4_block32", (stored.shape[0], stored.shape[1] * 2)
    else:
        encoding, shape = "fp8_block128", stored.shape
    entry = TensorEntry(
        stored.file,
        stored.dtype,
        shape,
        stored.begin,
        stored.end,
        key=file_key,
        encoding=encoding,
        scale=scale,
    )
    check_quantized(name, entry)
    return entry


def _experts(
    block: str,
    experts: dict[int, dict[str, str]],
    raw: dict[str, TensorEntry],
    used: set[str],
    layout: str,
) -> dict[str, TensorEntry]:
    """HF keeps a block's routed experts as two stacked tensors: gate_up_proj [E, 2I, D] (each
    expert's w1 rows, then its w3 rows) and down_proj [E, D, I]. `block`: `layers.N` or `mtp.K`."""
    count = max(experts) + 1
    missing = sorted(set(range(count)) - set(experts))
    if missing:
        raise _fail(f"{layout} checkpoint: {block} has no tensors for expert {missing[0]}")
    kind, index = block.split(".")
    prefix = f"{'model.layers' if kind == 'layers' else 'mtp'}.{index}.mlp.experts."
    result: dict[str, TensorEntry] = {}
    for target, kinds in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        name = prefix + target
        parts: list[TensorEntry] = []
        for e in range(count):
            for which in kinds:
                key = experts[e].get(which)
                if key is None:
                    lacking = _spelled(layout, f"{block}.ffn.experts.{e}.{which}.weight")
                    raise _fail(f"{layout} checkpoint: {lacking} is missing")
                parts.append(_with_scale(name, key, raw, used))
        first = parts[0]
        if any(p.shape != first.shape for p in parts):
            odd = next(p for p in parts if p.shape != first.shape)
            raise _fail(
                f"{layout} checkpoint: {odd.key} has shape {list(odd.shape)}, "
                f"but {first.key} has {list(first.shape)}"
            )
        rows, cols = first.shape
        shape = (count, rows * len(kinds), cols)
        result[name] = TensorEntry(
            first.file, first.dtype, shape, first.begin, first.end, key=first.key,
            encoding=first.encoding, scale=first.scale, parts=tuple(parts),
        )  # fmt: skip
    return result


def _spelled(layout: str, official: str) -> str:
    """How `layout` spells the tensor the official release calls `official`."""
    if layout != SAVE_PRETRAINED:
        return official
    saved = {v: k for k, v in _SAVED_TOP_LEVEL.items() if k != "lm_head.weight"}
    if official in saved:
        return saved[official]
    match = _BLOCK_RE.fullmatch(official)
    if match is None:
        return official  # head.weight
    block, index, rest = match.groups()
    rest = {v: k for k, v in _SAVED_LAYER_ALIASES.items()}.get(rest, rest)
    return f"{'model.layers' if block == 'layers' else block}.{index}.{rest}"


def official_tensors(raw: dict[str, TensorEntry], layout: str = OFFICIAL) -> dict[str, TensorEntry]:
    """The model's tensors (by our names) from the headers of a checkpoint in the official names
    (`layout` says which layout they came from, for messages). Any unknown name is an error, so a
    checkpoint of a different model is not half-loaded silently."""
    tensors: dict[str, TensorEntry] = {}
    used: set[str] = set()
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for key in raw:
        if key.endswith(SCALE_SUFFIX):
            continue
        match = _BLOCK_RE.fullmatch(key)
        expert = _EXPERT_RE.fullmatch(match.group(3)) if match else None
        if match is not None and expert is not None:
            experts[f"{match.group(1)}.{match.group(2)}"][int(expert.group(1))][expert.group(2)] = key
            continue
        name = hf_name(key)
        if name is None:
            stored = raw[key].key or key
            raise _fail(f"{layout} checkpoint: unknown tensor '{stored}' in {raw[key].file.name}")
        tensors[name] = _with_scale(name, key, raw, used)
    for block, per_expert in experts.items():
        tensors.update(_experts(block, per_expert, raw, used, layout))
    mtp = sum(name.startswith("mtp.") for name in tensors)
    if mtp:
        log.info("keeping %d MTP tensors for speculative decoding", mtp)
    stray = sorted(k for k in raw if k.endswith(SCALE_SUFFIX) and k not in used)
    if stray:
        stored = raw[stray[0]].key or stray[0]
        raise _fail(f"{layout} checkpoint: scale tensor '{stored}' has no weight beside it")
    return tensors


def mtp_layer_kinds(tensors: dict[str, TensorEntry]) -> list[tuple[str, str]]:
    """(attention kind, FFN kind) of each MTP block the checkpoint holds (our names), read from
    which tensors it has: an indexer makes it CSA, a compressor alone HCA, neither sliding; a
    token-id table makes its MoE hash-routed. Empty when it holds none."""
    indices = sorted({int(m.group(1)) for name in tensors if (m := re.match(r"mtp\.(\d+)\.", name))})
    if indices != list(range(len(indices))):
        raise _fail(f"the checkpoint's MTP blocks are numbered {indices}; expected 0..{len(indices) - 1}")
    kinds = []
    for index in indices:
        compressor = f"mtp.{index}.self_attn.compressor."
        if compressor + "indexer.kv_proj.weight" in tensors:
            attention = CSA
        elif compressor + "kv_proj.weight" in tensors:
            attention = HCA
        else:
            attention = SLIDING
        kinds.append((attention, HASH_MOE if f"mtp.{index}.mlp.gate.tid2eid" in tensors else MOE))
    return kinds


def with_mtp(config: dict[str, Any], tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    """`config` saying which MTP blocks the checkpoint holds (`mtp_layer_types`,
    `mtp_mlp_layer_types`), so the model builds exactly those and the loader fills them."""
    kinds = mtp_layer_kinds(tensors)
    return {
        **config,
        "mtp_layer_types": [attention for attention, _ in kinds],
        "mtp_mlp_layer_types": [ffn for _, ffn in kinds],
    }


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
