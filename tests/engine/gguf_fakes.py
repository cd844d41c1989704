"""Tiny GGUF files written with the gguf package's writer, for import and tokenizer tests."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    MODEL_TENSORS,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    Keys,
)
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


# --- wide files for every block type, in the architectures ds4desk maps ---------------------------
# K-quant blocks hold 256 values, so every row of these files is a multiple of 256 wide. Tensor and
# metadata names come from gguf-py's constants (llama.cpp's own naming), not from ds4desk.


@dataclass(slots=True, frozen=True)
class WideSizes:
    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    layers: int = 2


# Per architecture: the layer tensors llama.cpp's converter writes, beyond the llama set.
_EXTRA_LAYER_TENSORS: dict[str, tuple[MODEL_TENSOR, ...]] = {
    "llama": (),
    "qwen2": (),
    "qwen3": (MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM),
    "gemma3": (
        MODEL_TENSOR.ATTN_Q_NORM,
        MODEL_TENSOR.ATTN_K_NORM,
        MODEL_TENSOR.ATTN_POST_NORM,
        MODEL_TENSOR.FFN_POST_NORM,
    ),
}
_ARCH_ENUM = {
    "llama": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "gemma3": MODEL_ARCH.GEMMA3,
}


def _tensor_name(tensor: MODEL_TENSOR, layer: int | None = None, kind: str = "weight") -> str:
    base = TENSOR_NAMES[tensor]
    return f"{base.format(bid=layer) if layer is not None else base}.{kind}"


def wide_weights(
    arch: str, sizes: WideSizes, seed: int = 0, vocab: int = len(SP_TOKENS)
) -> dict[str, np.ndarray]:
    """Random weights under the GGUF names of `arch`, in Hugging Face row order, scaled so the
    activations stay O(1) (1/sqrt(fan-in) weights) and the logits in the tens. Norm weights are the
    values a file stores: near 1 in every architecture (for Gemma that is 1 + w with w near 0)."""
    if arch not in _EXTRA_LAYER_TENSORS:
        raise ValueError(f"no wide fake for {arch}")
    rng = np.random.default_rng(seed)
    s = sizes
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm(width: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(width)).astype(np.float32)

    # Only tensors llama.cpp lists for the architecture: the fake cannot invent a name.
    known = set(MODEL_TENSORS[_ARCH_ENUM[arch]])
    out = {
        _tensor_name(MODEL_TENSOR.TOKEN_EMBD): (0.5 * rng.standard_normal((vocab, s.hidden))).astype(
            np.float32
        ),
        _tensor_name(MODEL_TENSOR.OUTPUT_NORM): norm(s.hidden),
    }
    for layer in range(s.layers):
        shapes = {
            MODEL_TENSOR.ATTN_Q: (q_rows, s.hidden),
            MODEL_TENSOR.ATTN_K: (kv_rows, s.hidden),
            MODEL_TENSOR.ATTN_V: (kv_rows, s.hidden),
            MODEL_TENSOR.ATTN_OUT: (s.hidden, q_rows),
            MODEL_TENSOR.FFN_GATE: (s.ffn, s.hidden),
            MODEL_TENSOR.FFN_UP: (s.ffn, s.hidden),
            MODEL_TENSOR.FFN_DOWN: (s.hidden, s.ffn),
        }
        assert known >= {*shapes, *_EXTRA_LAYER_TENSORS[arch]}, arch
        for tensor, shape in shapes.items():
            out[_tensor_name(tensor, layer)] = matrix(*shape)
        for tensor in (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.FFN_NORM):
            out[_tensor_name(tensor, layer)] = norm(s.hidden)
        for tensor in _EXTRA_LAYER_TENSORS[arch]:
            qk = tensor in (MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM)
            out[_tensor_name(tensor, layer)] = norm(s.head_dim if qk else s.hidden)
        if arch == "qwen2":  # Qwen2 has q/k/v biases
            for tensor, rows in (
                (MODEL_TENSOR.ATTN_Q, q_rows),
                (MODEL_TENSOR.ATTN_K, kv_rows),
                (MODEL_TENSOR.ATTN_V, kv_rows),
            ):
                out[_tensor_name(tensor, layer, "bias")] = (0.5 * rng.standard_normal(rows)).astype(
                    np.float32
                )
    return out


def write_wide_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    sizes: WideSizes,
    *,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
) -> Path:
    """A float32 GGUF of `arch` as llama.cpp's converter writes one: its metadata keys, its tensor
    names, and (llama only) q/k rows in rope's pair order. `weights` are in Hugging Face row order."""
    w = GGUFWriter(str(path), MODEL_ARCH_NAMES[_ARCH_ENUM[arch]])
    llm = Keys.LLM
    w.add_uint32(llm.BLOCK_COUNT.format(arch=arch), sizes.layers)
    w.add_uint32(llm.CONTEXT_LENGTH.format(arch=arch), 128)
    w.add_uint32(llm.EMBEDDING_LENGTH.format(arch=arch), sizes.hidden)
    w.add_uint32(llm.FEED_FORWARD_LENGTH.format(arch=arch), sizes.ffn)
    w.add_uint32(Keys.Attention.HEAD_COUNT.format(arch=arch), sizes.heads)
    w.add_uint32(Keys.Attention.HEAD_COUNT_KV.format(arch=arch), sizes.kv_heads)
    w.add_uint32(Keys.Attention.KEY_LENGTH.format(arch=arch), sizes.head_dim)
    w.add_uint32(Keys.Attention.VALUE_LENGTH.format(arch=arch), sizes.head_dim)
    w.add_uint32(Keys.Rope.DIMENSION_COUNT.format(arch=arch), sizes.head_dim)
    w.add_float32(Keys.Rope.FREQ_BASE.format(arch=arch), rope_theta)
    w.add_float32(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch), 1e-6)
    if sliding_window is not None:
        w.add_uint32(Keys.Attention.SLIDING_WINDOW.format(arch=arch), sliding_window)
    w.add_tokenizer_model("llama")
    w.add_token_list(SP_TOKENS)
    w.add_token_types(SP_TYPES)
    w.add_token_scores(SP_SCORES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, value in weights.items():
        if arch == "llama" and name.endswith(".weight") and (".attn_q." in name or ".attn_k." in name):
            value = gguf_rows_from_hf(value, sizes.heads if ".attn_q." in name else sizes.kv_heads)
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize_with_llama_cpp(source: Path, target: Path, ftype: str, *, pure: bool = True) -> Path:
    """`source` quantized by llama.cpp (llama-cpp-python) to `ftype` (a LLAMA_FTYPE_MOSTLY_* suffix:
    "Q4_K", "Q4_K_M", ...): `pure` puts every 2-D tensor in that one type, as far as llama.cpp
    agrees; otherwise llama.cpp picks per tensor as its quantize tool does. RuntimeError on failure."""
    import llama_cpp  # optional: the callers skip when it is missing

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.pure = pure
    params.nthread = 2  # the machine's share
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source.name} to {ftype} (code {code})")
    return target
