"""A GGUF file as a loadable model, in place: no converted copy anywhere.

The header (gguf_header.py) has already checked every tensor's byte range. From the metadata this
module builds the config.json a Hugging Face folder of the same model would carry, and maps every
GGUF tensor to the parameter name the family uses, keeping where its bytes are and their GGML type.
The loader then copies blocks from the memory-mapped file straight into the model: weights in a
quantized type stay in it (models/packed.py), float ones are read as floats.

Two things differ from the Hugging Face layout and are undone per tensor while copying:
- llama.cpp's converter stores a Llama model's q/k rows in the order its rope rotates them (adjacent
  pairs); `rope_heads` says to reorder them back (rows of blocks, so packed weights reorder too).
- Gemma's converter stores RMSNorm weights as (1 + w); `shift` = -1 gives back w.
Qwen3.5 (`qwen35`, `qwen35moe`: hybrid layers, stacked experts) maps its own way: gguf_qwen35.py;
DeepSeek-V4 (`deepseek4`) too: gguf_deepseek4.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.gguf_deepseek4 import DEEPSEEK4_ARCH, deepseek4_model
from ds4desk.engine.loading.gguf_header import GGUFHeader, GGUFTensor, read_gguf_header
from ds4desk.engine.loading.gguf_meta import (
    IGNORED_TENSORS,
    MetaReader,
    gguf_entry,
    load_failed,
    special_token_ids,
    stored_type,
)
from ds4desk.engine.loading.gguf_qwen35 import QWEN35_ARCHES, qwen35_model
from ds4desk.engine.loading.gguf_tokenizer import build_tokenizer
from ds4desk.engine.loading.source import ModelSource, NameLayout, TensorEntry, TokenizerSpec

# GGML types whose values are plain floats (or integers): read as values, never kept packed.
FLOAT_TYPE_NAMES = frozenset({"F32", "F16", "BF16", "I32"})

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# Tensors some GGUFs carry that hold nothing the model needs: precomputed rope tables, and
# rope_freqs (Llama 3 frequency factors, turned into config rope_scaling instead).

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_QK_NORMS,
}


@dataclass(slots=True, frozen=True)
class _Arch:
    """How one `general.architecture` maps onto a family."""

    hf_architecture: str
    model_type: str
    layer_names: dict[str, str]  # GGUF layer tensor part -> the family's module path in a layer
    rope_in_pairs: bool = False  # q/k rows stored in rope's pair order (llama.cpp's llama converter)
    norm_shift: float = 0.0  # added to every RMSNorm weight while loading (Gemma stores 1 + w)


_ARCHES: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", "llama", {**_PROJECTIONS, **_LLAMA_NORMS}, rope_in_pairs=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", {**_PROJECTIONS, **_LLAMA_NORMS}),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", {**_PROJECTIONS, **_LLAMA_NORMS, **_QK_NORMS}),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", {**_PROJECTIONS, **_GEMMA_NORMS}, norm_shift=-1.0),
}
# Gemma 3 alternates five sliding-window layers with one global layer; GGUF does not store it.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


_fail = load_failed


def gguf_source(path: Path) -> ModelSource:
    """The loadable model in the GGUF file at `path`; LOAD_FAILED naming the file on any problem."""
    path = Path(path)
    header = read_gguf_header(path)
    meta = header.metadata
    arch_name = meta.get("general.architecture")
    arch = _ARCHES.get(arch_name) if isinstance(arch_name, str) else None
    if arch is None and arch_name not in QWEN35_ARCHES and arch_name != DEEPSEEK4_ARCH:
        known = ", ".join([*_ARCHES, *QWEN35_ARCHES, DEEPSEEK4_ARCH])
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"{path.name} is a GGUF for the '{arch_name}' architecture; ds4desk runs GGUF files of: {known}",
        )
    assert isinstance(arch_name, str)
    read = MetaReader(path, meta, arch_name)
    layout: NameLayout | None = None
    if arch is None:  # Qwen3.5's hybrid layers and DeepSeek-V4 map differently (their own modules)
        mapped = (
            deepseek4_model(path, header, read)
            if arch_name == DEEPSEEK4_ARCH
            else qwen35_model(path, header, read)
        )
        config, tensors, layout, architecture = (
            mapped.config,
            mapped.tensors,
            mapped.layout,
            mapped.architecture,
        )
    else:
        if read.int_or("expert_count", 0):
            raise _fail(path, "it is a mixture-of-experts model, which ds4desk does not run from GGUF")
        config = _config(path, header, arch_name, arch, read)
        tensors = _entries(path, header, arch, config)
        architecture = arch.hf_architecture
    built = build_tokenizer(meta)
    return ModelSource(
        folder=path.parent,
        origin=path,
        config=config,
        architecture=architecture,
        tensors=tensors,
        chat_template=_chat_template(meta),
        tokenizer=TokenizerSpec(
            tokenizer=built.tokenizer,
            special_tokens=_special_tokens(meta),
            add_bos_token=meta.get("tokenizer.ggml.add_bos_token", False) is True,
            stop_ids=_stop_ids(meta),
            notes=tuple(built.notes),
        ),
        layout=layout,
    )


def _config(
    path: Path, header: GGUFHeader, arch_name: str, arch: _Arch, read: MetaReader
) -> dict[str, object]:
    tensors = header.tensors
    layers = read.int_or("block_count", None)
    hidden = read.int_or("embedding_length", None)
    heads = read.int_or("attention.head_count", None)
    kv_heads = read.int_or("attention.head_count_kv", heads)
    if not layers or not hidden or not heads or not kv_heads or heads % kv_heads:
        raise _fail(path, f"implausible sizes: {layers} layers, width {hidden}, {heads}/{kv_heads} heads")
    head_dim = read.int_or("attention.key_length", hidden // heads)
    if read.int_or("attention.value_length", head_dim) != head_dim:
        raise _fail(path, "keys and values of different widths are not supported")
    rope_dim = read.int_or("rope.dimension_count", head_dim)
    if head_dim % 2 or rope_dim != head_dim:
        raise _fail(path, f"rope over {rope_dim} of {head_dim} head dimensions is not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2 or embed.shape[1] != hidden:
        raise _fail(path, "it has no token_embd.weight of the model's width")
    up = tensors.get("blk.0.ffn_up.weight")
    ffn = read.int_or("feed_forward_length", up.shape[0] if up is not None else None)
    theta = read.float_or("rope.freq_base", 10000.0)
    config: dict[str, object] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": read.float_or("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(path, header, arch_name, theta, head_dim),
        "max_position_embeddings": read.int_or("context_length", 4096),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if arch_name == "gemma3":
        window = read.int_or("attention.sliding_window", None)
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            # No key stores it: head_dim for 270M to 12B; 27B (62 layers, head_dim 128) scales by
            # hidden / heads = 168, as its published config says.
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
            "sliding_window": window,
            "layer_types": [
                "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                for i in range(layers)
            ],
            "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_THETA,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
    else:
        config["hidden_act"] = "silu"
    meta = header.metadata
    config.update(special_token_ids(meta))
    return config


def _rope_scaling(
    path: Path, header: GGUFHeader, arch_name: str, theta: float, head_dim: int
) -> dict[str, object] | None:
    meta = header.metadata
    kind = meta.get(f"{arch_name}.rope.scaling.type", "none")
    factor = meta.get(f"{arch_name}.rope.scaling.factor")
    freqs = header.tensors.get("rope_freqs.weight")
    if freqs is not None:
        return _llama3_scaling(path, header, freqs, theta, head_dim)
    if kind in ("none", None) or factor in (None, 0, 1.0):
        return None
    if kind == "linear" and isinstance(factor, float | int):
        return {"rope_type": "linear", "factor": float(factor)}
    raise _fail(path, f"rope scaling '{kind}' is not supported")


def _llama3_scaling(
    path: Path, header: GGUFHeader, freqs: GGUFTensor, theta: float, head_dim: int
) -> dict[str, object]:
    """Llama 3.1+ stores its long-context rope as per-frequency divisors (rope_freqs).

    Hugging Face describes the same thing with four numbers (the "llama3" rope type): frequencies
    with a wavelength under original_ctx/high_freq_factor are kept, those over
    original_ctx/low_freq_factor are divided by `factor`, and the band between is interpolated. The
    numbers are recovered and checked against the stored divisors; the file is refused otherwise.
    """
    if freqs.qtype.name != "F32" or freqs.shape != (head_dim // 2,):
        raise _fail(
            path, f"rope_freqs.weight has an unexpected layout ({freqs.qtype.name} {list(freqs.shape)})"
        )
    with path.open("rb") as f:
        f.seek(freqs.offset)
        divisors = np.frombuffer(f.read(freqs.nbytes), dtype="<f4").astype(np.float64)
    meta = header.metadata
    factor = float(meta.get("llama.rope.scaling.factor") or divisors.max())
    original = meta.get("llama.rope.scaling.original_context_length") or 8192
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):  # the values published models use
        smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
        expected = 1.0 / ((1.0 - smooth) / factor + smooth)
        if np.allclose(expected, divisors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(original),
            }
    raise _fail(path, "its rope frequency factors (rope_freqs) do not follow the Llama 3 scheme")


def _entries(
    path: Path, header: GGUFHeader, arch: _Arch, config: dict[str, object]
) -> dict[str, TensorEntry]:
    layers = config["num_hidden_layers"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    assert isinstance(layers, int) and isinstance(heads, int) and isinstance(kv_heads, int)
    assert isinstance(head_dim, int)
    entries: dict[str, TensorEntry] = {}
    for name, t in header.tensors.items():
        if IGNORED_TENSORS.match(name):
            continue
        kind = stored_type(path, t)
        hf_name = _GLOBAL_NAMES.get(name)
        rope_heads, shift = 0, 0.0
        if hf_name is None:
            match = _LAYER_TENSOR.match(name)
            part = match.group(2) if match else None
            if match is None or part not in arch.layer_names or int(match.group(1)) >= layers:
                raise _fail(path, f"tensor '{name}' has no counterpart in a {arch.hf_architecture} model")
            hf_name = f"model.layers.{int(match.group(1))}.{arch.layer_names[part]}.{match.group(3)}"
            if arch.rope_in_pairs and part in ("attn_q", "attn_k"):
                rope_heads = heads if part == "attn_q" else kv_heads
                if t.shape[0] != rope_heads * head_dim:
                    raise _fail(
                        path, f"tensor '{name}' has {t.shape[0]} rows, expected {rope_heads} x {head_dim}"
                    )
            if part.endswith("norm"):
                shift = arch.norm_shift
        elif name == "output_norm.weight":
            shift = arch.norm_shift
        entries[hf_name] = gguf_entry(
            path, kind, t.shape, t.offset, t.nbytes, shift=shift, rope_heads=rope_heads
        )
    return entries


def packed_types(source: ModelSource) -> dict[str, int]:
    """Parameter name -> GGML type of every 2-D weight (3-D: experts stacked, as DeepSeek-V4 keeps
    them) the file stores in a quantized type: what the family keeps packed (models/packed.py). A
    family that cannot keep one packed builds it as a float parameter, and the loader dequantizes it
    while copying."""
    return {
        name: entry.gguf_type
        for name, entry in source.tensors.items()
        if entry.encoding == "gguf"
        and entry.dtype not in FLOAT_TYPE_NAMES
        and len(entry.shape) in (2, 3)
        and entry.columns is None
    }


def _token(meta: dict[str, object], key: str) -> str | None:
    tokens = meta.get("tokenizer.ggml.tokens")
    index = meta.get(f"tokenizer.ggml.{key}")
    if isinstance(tokens, list) and type(index) is int and 0 <= index < len(tokens):
        token = tokens[index]
        return token if isinstance(token, str) else None
    return None


def _special_tokens(meta: dict[str, object]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, name in (
        ("bos_token_id", "bos_token"),
        ("eos_token_id", "eos_token"),
        ("unknown_token_id", "unk_token"),
        ("padding_token_id", "pad_token"),
    ):
        token = _token(meta, key)
        if token is not None:
            out[name] = token
    return out


def _stop_ids(meta: dict[str, object]) -> tuple[int, ...]:
    # Llama 3 style GGUFs name an end-of-turn (eot) / end-of-message (eom) token besides eos;
    # generation must stop on any of them.
    stops: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if type(value) is int and value not in stops:
            stops.append(value)
    return tuple(stops)


def _chat_template(meta: dict[str, object]) -> str | None:
    template = meta.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template.strip() else None


# --- writing GGUF names (benchmarks write the same weights for llama.cpp) ---------------------------


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF name of a parameter name: the inverse of the mapping above."""
    for gguf_name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    part = next(g for g, hf in _ARCHES[arch].layer_names.items() if hf == module)
    return f"blk.{layer}.{part}.{kind}"


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `rope_row_order`: Hugging Face's rotate-half q/k rows in GGUF's pair order."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def rope_row_order(rows: int, n_heads: int) -> np.ndarray:
    """Which stored row each Hugging Face q/k row is.

    ggml's llama rope rotates adjacent pairs of a head's dimensions, (x[2i], x[2i+1]), by angle
    pos * theta_i; Hugging Face's rotate-half rotates (x[i], x[i + d/2]) by the same angle. The two
    are the same computation when stored row 2i is row i and stored row 2i+1 is row i + d/2, which is
    how the rows were stored. So within each head the rows are the stored even rows, then the odd."""
    head_dim = rows // n_heads
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
