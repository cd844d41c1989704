"""Tiny GGUF files written with the gguf package's writer, for import and tokenizer tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 64, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS

# A small SentencePiece-style vocabulary: specials, 256 byte-fallback tokens, then scored pieces.
SP_PIECES = [
    "▁", "e", "t", "h", "l", "o", "a", "n", "i", "r", "w", "d", "s", "c", "é",
    "▁t", "he", "▁the", "in", "▁a", "er", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or",
    "▁wor", "ld", "▁world", "▁in", "an", "▁an", "ca", "fé", "▁ca",
]  # fmt: skip
SP_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + SP_PIECES
SP_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES)
SP_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))]


def gguf_rows_from_hf(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """HF q/k rows in GGUF's interleaved rope order: GGUF row 2i+j of a head is HF row j*d/2+i."""
    d = weight.shape[0] // n_heads
    out = np.empty_like(weight)
    for h in range(n_heads):
        for i in range(d // 2):
            for j in range(2):
                out[h * d + 2 * i + j] = weight[h * d + j * (d // 2) + i]
    return out


def hf_weights(seed: int = 0, vocab: int = len(SP_TOKENS)) -> dict[str, np.ndarray]:
    """Random weights under GGUF names, in HF row order (before the rope reordering)."""
    rng = np.random.default_rng(seed)
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, HIDDEN),
        "output_norm.weight": (HIDDEN,),
    }
    for layer in range(LAYERS):
        for part, shape in (
            ("attn_q", (HEADS * HEAD_DIM, HIDDEN)),
            ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)),
            ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)),
            ("attn_output", (HIDDEN, HEADS * HEAD_DIM)),
            ("ffn_gate", (FFN, HIDDEN)),
            ("ffn_up", (FFN, HIDDEN)),
            ("ffn_down", (HIDDEN, FFN)),
            ("attn_norm", (HIDDEN,)),
            ("ffn_norm", (HIDDEN,)),
        ):
            shapes[f"blk.{layer}.{part}.weight"] = shape
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    weights: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
    quantized: dict[str, GGMLQuantizationType] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    metadata: dict[str, Any] | None = None,
    add_space_prefix: bool = True,
    chat_template: str | None = None,
) -> Path:
    """A tiny llama GGUF with the SentencePiece vocabulary above; q/k rows stored as llama.cpp does."""
    weights = dict(weights if weights is not None else hf_weights())
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", LAYERS)
    w.add_uint32(f"{arch}.context_length", 128)
    w.add_uint32(f"{arch}.embedding_length", HIDDEN)
    w.add_uint32(f"{arch}.feed_forward_length", FFN)
    w.add_uint32(f"{arch}.attention.head_count", HEADS)
    w.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    w.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.add_tokenizer_model("llama")
    w.add_token_list(SP_TOKENS)
    w.add_token_types(SP_TYPES)
    w.add_token_scores(SP_SCORES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(add_space_prefix)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, value in weights.items():
        if name in drop:
            continue
        if ".attn_q." in name:
            value = gguf_rows_from_hf(value, HEADS)
        elif ".attn_k." in name:
            value = gguf_rows_from_hf(value, KV_HEADS)
        qtype = (quantized or {}).get(name)
        if qtype is None:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
    for name, (data, qtype) in (raw_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_divisors(
    theta: float, head_dim: int, factor: float, low: float, high: float, ctx: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs for Llama 3.1-style scaling."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
