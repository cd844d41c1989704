"""Tiny Qwen3.5 GGUFs (dense `qwen35`, MoE `qwen35moe`) written the way llama.cpp's converter writes
them, from a transformers model: the test's own writer, on gguf-py's GGUFWriter and gguf-py's names.

What the converter does to the tensors, and so what this writer does (ds4desk's loader must undo or
follow each):
- norms Qwen3.5 centres on 0 are stored as 1 + w (not the linear layers' output norm);
- A_log is stored as -exp(A_log), dt_bias as `ssm_dt.bias`, the convolution squeezed to [C, K];
- with more value heads than key heads, every per-value-head row/channel/column is reordered from
  grouped by key head to tiled over the key heads;
- MoE experts stacked [E, rows, cols] (gate and up apart, or together in `ffn_gate_up_exps`), the
  shared expert's gate as a vector.
Weights may be quantized with gguf-py; the writer then returns the weights transformers must hold
to compute exactly what the file holds (dequantized, mapped back to the Hugging Face layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, GGUFWriter, Keys
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.engine.models.qwen3_5.tiny import FULL, LINEAR, SPECIAL, TINY, TINY_MOE

T = MODEL_TENSOR
# TINY with what llama.cpp needs and what GGUF blocks need: key and value heads of one width (llama.cpp
# sizes both by ssm.state_size), and every row a whole number of 32-value blocks.
GGUF_TINY: dict[str, Any] = {
    **TINY,
    "head_dim": 32,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "intermediate_size": 96,
}
GGUF_TINY_MOE: dict[str, Any] = {
    **TINY_MOE,
    "head_dim": 32,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "shared_expert_intermediate_size": 64,
}
# A mix of block types and float types over the kinds of weight (norms, the convolution, the rate and
# the router stay float32, as llama.cpp's quantizer leaves them).
MIXED: dict[MODEL_TENSOR, Q] = {
    T.TOKEN_EMBD: Q.Q8_0,
    T.OUTPUT: Q.Q8_0,
    T.ATTN_Q: Q.Q8_0,
    T.ATTN_K: Q.Q4_0,
    T.ATTN_V: Q.Q5_1,
    T.ATTN_OUT: Q.Q4_1,
    T.ATTN_QKV: Q.Q8_0,
    T.ATTN_GATE: Q.Q5_0,
    T.SSM_BETA: Q.Q8_0,
    T.SSM_ALPHA: Q.F16,
    T.SSM_OUT: Q.Q4_0,
    T.FFN_GATE: Q.Q4_0,
    T.FFN_UP: Q.Q8_0,
    T.FFN_DOWN: Q.Q8_0,
    T.FFN_GATE_EXP: Q.Q8_0,
    T.FFN_UP_EXP: Q.Q4_0,
    T.FFN_GATE_UP_EXP: Q.Q8_0,
    T.FFN_DOWN_EXP: Q.Q8_0,
    T.FFN_GATE_SHEXP: Q.Q8_0,
    T.FFN_UP_SHEXP: Q.Q8_0,
    T.FFN_DOWN_SHEXP: Q.Q4_0,
}
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3
ROPE_SECTIONS = [2, 1, 1, 0]  # llama.cpp requires them; text positions make every section equal


def make_hf(moe: bool, seed: int = 0, head_scale: float = 4.0, **overrides: Any) -> torch.nn.Module:
    """A random transformers Qwen3.5 (GGUF_TINY or GGUF_TINY_MOE, with `overrides`), its head scaled
    so the logits have clear winners (a teacher-forced top-1 comparison then measures the model, not
    ties)."""
    from tests.engine.models.qwen3_5.tiny import make_hf_model, make_hf_moe_model

    if moe:
        extra = {k: v for k, v in GGUF_TINY_MOE.items() if TINY_MOE.get(k) != v}
        model = make_hf_moe_model(seed, **extra, **overrides)
    else:
        extra = {k: v for k, v in GGUF_TINY.items() if TINY.get(k) != v}
        model = make_hf_model(seed, **extra, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def _name(tensor: MODEL_TENSOR, layer: int | None = None, suffix: str | None = "weight") -> str:
    base = TENSOR_NAMES[tensor]
    base = base.format(bid=layer) if layer is not None else base
    return f"{base}.{suffix}" if suffix else base


def _tiled(key_heads: int, per_key: int, width: int) -> np.ndarray:
    """The converter's value-head order: stored item i is Hugging Face item order[i] (grouped by key
    head -> tiled over the key heads)."""
    return (
        np.arange(key_heads * per_key * width).reshape(key_heads, per_key, width).transpose(1, 0, 2).ravel()
    )


@dataclass(slots=True)
class _Stored:
    """One tensor the file holds: its GGUF name and kind, values in the file's layout, and how a
    (dequantized) copy of them maps back onto the Hugging Face weights."""

    name: str
    kind: MODEL_TENSOR
    values: np.ndarray
    back: Callable[[np.ndarray], None]


@dataclass(slots=True)
class WrittenGguf:
    path: Path
    # The Hugging Face state dict whose values are exactly what the file holds.
    effective: dict[str, torch.Tensor] = field(default_factory=dict)
    types: dict[str, Q] = field(default_factory=dict)  # GGUF name -> stored type


def write_qwen35_gguf(
    path: Path,
    hf: torch.nn.Module,
    types: dict[MODEL_TENSOR, Q] | None = None,
    *,
    fused_gate_up: bool = False,
    drop: tuple[str, ...] = (),
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    mtp_layers: int = 0,
    recurrent_flags: bool = False,
) -> WrittenGguf:
    """`hf` (GGUF_TINY or GGUF_TINY_MOE shaped) as llama.cpp's converter writes it, each tensor of a
    kind in `types` stored in that type (else float32). `drop`: GGUF names left out; `raw`: extra
    tensors (name -> values or bytes, type) written as given; `mtp_layers`: multi-token-prediction
    blocks counted in block_count after the trunk (their tensors, if any, come through `raw`);
    `recurrent_flags`: the layer kinds as per-layer flags (`attention.recurrent_layers`) rather than a
    full-attention interval."""
    cfg = hf.config
    moe = getattr(cfg, "num_experts", 0) > 0
    arch_enum = MODEL_ARCH.QWEN35MOE if moe else MODEL_ARCH.QWEN35
    arch = MODEL_ARCH_NAMES[arch_enum]
    known = set(MODEL_TENSORS[arch_enum])
    state = {k: v.detach().float().clone() for k, v in hf.state_dict().items()}
    out = WrittenGguf(path, effective={k: v.clone() for k, v in state.items()})
    stored = _stored_tensors(cfg, state, out.effective, moe, fused_gate_up)
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, arch, cfg, moe, mtp_layers, recurrent_flags)
    for item in stored:
        assert item.kind in known, f"{item.name}: llama.cpp has no {item.kind.name} in {arch}"
        if item.name in drop:
            continue
        qtype = (types or {}).get(item.kind, Q.F32)
        values = item.values.astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(item.name, values)
            item.back(values)
        elif qtype == Q.F16:
            half = values.astype(np.float16)
            writer.add_tensor(item.name, half)
            item.back(half.astype(np.float32))
        else:
            blocks = quantize(values, qtype)
            writer.add_tensor(item.name, blocks, raw_dtype=qtype)
            item.back(dequantize(blocks, qtype).reshape(values.shape))
        out.types[item.name] = qtype
    if "lm_head.weight" in out.effective and cfg.tie_word_embeddings:  # one tensor, stored once
        out.effective["lm_head.weight"] = out.effective["model.embed_tokens.weight"]
    for name, (data, qtype) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _metadata(w: GGUFWriter, arch: str, cfg: Any, moe: bool, mtp_layers: int, flags: bool) -> None:
    llm, attn, ssm = Keys.LLM, Keys.Attention, Keys.SSM
    if flags:  # llama.cpp's per-layer key; MTP layers are not recurrent
        recurrent = [kind == LINEAR for kind in cfg.layer_types] + [False] * mtp_layers
        w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    else:
        interval = cfg.layer_types.index(FULL) + 1
        kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(cfg.num_hidden_layers)]
        assert kinds == list(cfg.layer_types), "layer kinds without an interval need recurrent_flags"
        w.add_uint32(llm.FULL_ATTENTION_INTERVAL.format(arch=arch), interval)
    w.add_uint32(llm.BLOCK_COUNT.format(arch=arch), cfg.num_hidden_layers + mtp_layers)
    if mtp_layers:
        w.add_uint32(llm.NEXTN_PREDICT_LAYERS.format(arch=arch), mtp_layers)
    w.add_uint32(llm.CONTEXT_LENGTH.format(arch=arch), cfg.max_position_embeddings)
    w.add_uint32(llm.EMBEDDING_LENGTH.format(arch=arch), cfg.hidden_size)
    w.add_uint32(attn.HEAD_COUNT.format(arch=arch), cfg.num_attention_heads)
    w.add_uint32(attn.HEAD_COUNT_KV.format(arch=arch), cfg.num_key_value_heads)
    w.add_uint32(attn.KEY_LENGTH.format(arch=arch), cfg.head_dim)
    w.add_uint32(attn.VALUE_LENGTH.format(arch=arch), cfg.head_dim)
    w.add_float32(attn.LAYERNORM_RMS_EPS.format(arch=arch), cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_float32(Keys.Rope.FREQ_BASE.format(arch=arch), rope["rope_theta"])
    w.add_uint32(
        Keys.Rope.DIMENSION_COUNT.format(arch=arch), int(cfg.head_dim * rope["partial_rotary_factor"])
    )
    w.add_array(Keys.Rope.DIMENSION_SECTIONS.format(arch=arch), ROPE_SECTIONS)
    w.add_uint32(ssm.CONV_KERNEL.format(arch=arch), cfg.linear_conv_kernel_dim)
    w.add_uint32(ssm.STATE_SIZE.format(arch=arch), cfg.linear_key_head_dim)
    w.add_uint32(ssm.GROUP_COUNT.format(arch=arch), cfg.linear_num_key_heads)
    w.add_uint32(ssm.TIME_STEP_RANK.format(arch=arch), cfg.linear_num_value_heads)
    w.add_uint32(ssm.INNER_SIZE.format(arch=arch), cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    if moe:
        w.add_uint32(llm.EXPERT_COUNT.format(arch=arch), cfg.num_experts)
        w.add_uint32(llm.EXPERT_USED_COUNT.format(arch=arch), cfg.num_experts_per_tok)
        w.add_uint32(llm.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch), cfg.moe_intermediate_size)
        w.add_uint32(
            llm.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch), cfg.shared_expert_intermediate_size
        )
    else:
        w.add_uint32(llm.FEED_FORWARD_LENGTH.format(arch=arch), cfg.intermediate_size)
    _tokenizer(w, cfg.vocab_size)


def tokens(vocab_size: int) -> list[str]:
    """Qwen's specials, the 256 byte-level symbols, one merged pair, then padding to the vocabulary."""
    from tokenizers import pre_tokenizers

    out = [*SPECIAL, *sorted(pre_tokenizers.ByteLevel.alphabet()), "ĠĠ"]
    return out + [f"[PAD{i}]" for i in range(len(out), vocab_size)]


def _tokenizer(w: GGUFWriter, vocab_size: int) -> None:
    listed = tokens(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(listed)
    w.add_token_types([_TOKEN_CONTROL if t in SPECIAL else _TOKEN_NORMAL for t in listed])
    w.add_token_merges(["Ġ Ġ"])
    w.add_eos_token_id(SPECIAL.index("<|im_end|>"))
    w.add_pad_token_id(SPECIAL.index("<|endoftext|>"))
    w.add_bos_token_id(SPECIAL.index("<|endoftext|>"))
    w.add_add_bos_token(False)


def _stored_tensors(
    cfg: Any, state: dict[str, torch.Tensor], effective: dict[str, torch.Tensor], moe: bool, fused: bool
) -> list[_Stored]:
    """Every tensor of the file, in the converter's layout, with the way back to `effective`."""
    key_heads, value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    per_key, value_dim = value_heads // key_heads, cfg.linear_value_head_dim
    key_width = key_heads * cfg.linear_key_head_dim
    heads_order = _tiled(key_heads, per_key, value_dim)  # rows / columns of value heads
    scalar_order = _tiled(key_heads, per_key, 1)  # one value per value head
    qkv_order = np.concatenate([np.arange(2 * key_width), 2 * key_width + heads_order])
    items: list[_Stored] = []

    def put(hf_name: str, kind: MODEL_TENSOR, layer: int | None, suffix: str | None = "weight", **how: Any):
        items.append(_item(hf_name, _name(kind, layer, suffix), kind, state, effective, **how))

    put("model.embed_tokens.weight", T.TOKEN_EMBD, None)
    put("model.norm.weight", T.OUTPUT_NORM, None, shift=True)
    if not cfg.tie_word_embeddings:
        put("lm_head.weight", T.OUTPUT, None)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        put(f"{p}.input_layernorm.weight", T.ATTN_NORM, i, shift=True)
        put(f"{p}.post_attention_layernorm.weight", T.ATTN_POST_NORM, i, shift=True)
        if kind == FULL:
            a = f"{p}.self_attn"
            for module, tensor in (("q_proj", T.ATTN_Q), ("k_proj", T.ATTN_K), ("v_proj", T.ATTN_V)):
                put(f"{a}.{module}.weight", tensor, i)
            put(f"{a}.o_proj.weight", T.ATTN_OUT, i)
            put(f"{a}.q_norm.weight", T.ATTN_Q_NORM, i, shift=True)
            put(f"{a}.k_norm.weight", T.ATTN_K_NORM, i, shift=True)
        else:
            a = f"{p}.linear_attn"
            put(f"{a}.in_proj_qkv.weight", T.ATTN_QKV, i, rows=qkv_order)
            put(f"{a}.in_proj_z.weight", T.ATTN_GATE, i, rows=heads_order)
            put(f"{a}.in_proj_b.weight", T.SSM_BETA, i, rows=scalar_order)
            put(f"{a}.in_proj_a.weight", T.SSM_ALPHA, i, rows=scalar_order)
            put(f"{a}.out_proj.weight", T.SSM_OUT, i, cols=heads_order)
            put(f"{a}.conv1d.weight", T.SSM_CONV1D, i, rows=qkv_order, squeeze=True)
            put(f"{a}.dt_bias", T.SSM_DT, i, "bias", rows=scalar_order)
            put(f"{a}.A_log", T.SSM_A, i, None, rows=scalar_order, rate=True)
            put(f"{a}.norm.weight", T.SSM_NORM, i)
        if not moe:
            for module, tensor in (
                ("gate_proj", T.FFN_GATE),
                ("up_proj", T.FFN_UP),
                ("down_proj", T.FFN_DOWN),
            ):
                put(f"{p}.mlp.{module}.weight", tensor, i)
            continue
        m = f"{p}.mlp"
        put(f"{m}.gate.weight", T.FFN_GATE_INP, i)
        put(f"{m}.shared_expert_gate.weight", T.FFN_GATE_INP_SHEXP, i, squeeze=True)
        for module, tensor in (("gate_proj", T.FFN_GATE_SHEXP), ("up_proj", T.FFN_UP_SHEXP)):
            put(f"{m}.shared_expert.{module}.weight", tensor, i)
        put(f"{m}.shared_expert.down_proj.weight", T.FFN_DOWN_SHEXP, i)
        width = cfg.moe_intermediate_size
        gate_up = f"{m}.experts.gate_up_proj"
        if fused:
            put(gate_up, T.FFN_GATE_UP_EXP, i)
        else:
            put(gate_up, T.FFN_GATE_EXP, i, part=slice(0, width))
            put(gate_up, T.FFN_UP_EXP, i, part=slice(width, 2 * width))
        put(f"{m}.experts.down_proj", T.FFN_DOWN_EXP, i)
    return items


def _item(
    hf_name: str,
    gguf_name: str,
    kind: MODEL_TENSOR,
    state: dict[str, torch.Tensor],
    effective: dict[str, torch.Tensor],
    *,
    rows: np.ndarray | None = None,
    cols: np.ndarray | None = None,
    part: slice | None = None,
    squeeze: bool = False,
    shift: bool = False,
    rate: bool = False,
) -> _Stored:
    hf = state[hf_name].numpy()
    if part is not None:  # gate or up rows of stacked experts [E, 2I, H]
        hf = hf[:, part]
    shape = hf.shape
    values = hf.reshape(shape[0], -1) if squeeze and hf.ndim == 3 else hf
    values = values.reshape(-1) if squeeze and values.shape[0] == 1 else values
    if rows is not None:
        values = values.take(rows, axis=0)
    if cols is not None:
        values = values.take(cols, axis=1)
    if shift:
        values = values + 1.0
    if rate:
        values = -np.exp(values)

    def back(stored: np.ndarray) -> None:
        if rate:
            return  # the model keeps the stored rate; transformers keeps A_log (equal to rounding)
        got = stored - 1.0 if shift else stored
        if cols is not None:
            got = got.take(np.argsort(cols), axis=1)
        if rows is not None:
            got = got.take(np.argsort(rows), axis=0)
        target = effective[hf_name]
        values_back = torch.from_numpy(np.ascontiguousarray(got, dtype=np.float32))
        if part is not None:
            target[:, part] = values_back.reshape(target[:, part].shape)
        else:
            target.copy_(values_back.reshape(shape))

    return _Stored(gguf_name, kind, np.ascontiguousarray(values, dtype=np.float32), back)
