"""Turn a Llama-architecture .gguf file into a Hugging Face style folder in the cache.

The rest of the engine only knows HF folders (config.json + safetensors + tokenizer.json), so a GGUF
is converted once: weights dequantized to float32 under HF names, a config.json and a tokenizer.json
rebuilt from the GGUF metadata. The folder name carries a key derived from the file, so the next
start finds it and skips the work; it appears only once complete (written aside, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.gguf_header import GGUFHeader, GGUFTensor, read_gguf_header
from ds4desk.engine.loading.gguf_tokenizer import build_tokenizer

# Bump when the produced folder changes, so old cache entries are not reused.
IMPORTER_VERSION = 1
KEY_PREFIX_BYTES = 1 << 20
STALE_PARTIAL_S = 24 * 3600

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors some llama GGUFs carry that hold nothing the HF layout needs: precomputed rope tables, and
# rope_freqs (Llama 3 frequency factors, turned into config.rope_scaling instead).
_IGNORED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass(slots=True, frozen=True)
class _PlannedTensor:
    hf_name: str
    source: GGUFTensor
    rope_heads: int = 0  # >0: undo GGUF's rope row order for this many heads


def _fail(path: Path, problem: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, f"cannot import {path.name}: {problem}")


def cache_key(path: Path) -> str:
    """Short hash of (size, mtime, first MiB): cheap, and changes whenever the file is replaced."""
    st = path.stat()
    digest = hashlib.sha256(f"v{IMPORTER_VERSION}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(KEY_PREFIX_BYTES))
    return digest.hexdigest()[:16]


def imported_folder(path: Path, cache_dir: Path) -> Path:
    return Path(cache_dir) / f"{Path(path).stem}-{cache_key(Path(path))}"


def import_gguf(path: Path, cache_dir: Path, progress: Callable[[str], None] | None = None) -> Path:
    """The HF folder for this GGUF, converting it on first use; LOAD_FAILED naming the file on any problem."""
    path = Path(path)
    try:
        final = imported_folder(path, cache_dir)
    except OSError as exc:
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"cannot read {path}: {exc.strerror or exc}") from exc
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final  # a finished import: folders only appear under this name once complete

    header = read_gguf_header(path)  # validates the whole header and every tensor's byte range
    config, plan = _plan(path, header)
    built = build_tokenizer(header.metadata)

    cache_dir = Path(cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(cache_dir, final.name)
        partial = cache_dir / f".{final.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        partial.mkdir()
    except OSError as exc:
        raise _fail(path, f"cannot write to the model cache {cache_dir} ({exc.strerror or exc})") from exc
    try:
        _write_json(partial / "config.json", config)
        _write_json(partial / "generation_config.json", _generation_config(header.metadata))
        _write_json(partial / "tokenizer_config.json", _tokenizer_config(header.metadata, config))
        built.tokenizer.save(str(partial / "tokenizer.json"))
        if built.notes:
            _write_json(partial / "ds4desk_import_notes.json", {"notes": built.notes})
        _write_weights(path, partial / "model.safetensors", plan, progress)
        try:
            os.rename(partial, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process finished the same import first
    except EngineFailure:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise _fail(
            path, f"writing the converted model to {cache_dir} failed ({exc.strerror or exc})"
        ) from exc
    except Exception as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise _fail(path, f"{type(exc).__name__}: {exc}") from exc
    return final


def _remove_stale_partials(cache_dir: Path, name: str) -> None:
    # Left behind by a crash mid-import; a young one may belong to an import running right now.
    for old in cache_dir.glob(f".{name}.partial-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


# --- metadata -> config.json ---------------------------------------------------------------------


def _meta_int(path: Path, meta: dict[str, object], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if type(value) is not int or value < 0:
        raise _fail(path, f"metadata '{key}' is missing or not a non-negative integer (got {value!r})")
    return value


def _meta_float(path: Path, meta: dict[str, object], key: str, default: float) -> float:
    value = meta.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise _fail(path, f"metadata '{key}' is not a number (got {value!r})")
    # GGUF stores these as float32: print the shortest float32 spelling (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _plan(path: Path, header: GGUFHeader) -> tuple[dict[str, object], list[_PlannedTensor]]:
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"{path.name} is a GGUF for the '{arch}' architecture; ds4desk imports only "
            "Llama-architecture GGUF files (Llama, SmolLM, Mistral 7B, ...)",
        )
    if meta.get("llama.expert_count", 0):
        raise _fail(path, "it is a mixture-of-experts (Mixtral-style) model, which ds4desk does not import")
    n_layers = _meta_int(path, meta, "llama.block_count")
    hidden = _meta_int(path, meta, "llama.embedding_length")
    n_heads = _meta_int(path, meta, "llama.attention.head_count")
    n_kv = _meta_int(path, meta, "llama.attention.head_count_kv", n_heads)
    if n_layers == 0 or hidden == 0 or n_heads == 0 or n_kv == 0 or n_heads % n_kv:
        raise _fail(path, f"implausible sizes: {n_layers} layers, width {hidden}, {n_heads}/{n_kv} heads")
    head_dim = _meta_int(path, meta, "llama.attention.key_length", hidden // n_heads)
    rope_dim = _meta_int(path, meta, "llama.rope.dimension_count", head_dim)
    if head_dim % 2 or rope_dim != head_dim:
        raise _fail(path, f"rope over {rope_dim} of {head_dim} head dimensions is not supported")
    rope_theta = _meta_float(path, meta, "llama.rope.freq_base", 10000.0)

    tensors = header.tensors
    if "token_embd.weight" not in tensors:
        raise _fail(path, "it has no token_embd.weight tensor")
    embed = tensors["token_embd.weight"]
    if len(embed.shape) != 2:
        raise _fail(path, f"token_embd.weight has shape {list(embed.shape)}")
    vocab_size = embed.shape[0]

    plan: list[_PlannedTensor] = []
    has_bias = False
    for name, t in tensors.items():
        if _IGNORED.match(name):
            continue
        if name in _GLOBAL_NAMES:
            plan.append(_PlannedTensor(_GLOBAL_NAMES[name], t))
            continue
        m = _LAYER_TENSOR.match(name)
        if not m or m.group(2) not in _LAYER_NAMES or int(m.group(1)) >= n_layers:
            raise _fail(path, f"tensor '{name}' has no counterpart in a Llama model")
        layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
        has_bias |= kind == "bias" and part.startswith("attn_")
        if kind == "bias" and not part.startswith("attn_"):
            raise _fail(path, f"tensor '{name}': MLP biases are not supported")
        heads = {"attn_q": n_heads, "attn_k": n_kv}.get(part, 0)
        if heads and t.shape[0] != heads * head_dim:
            raise _fail(path, f"tensor '{name}' has {t.shape[0]} rows, expected {heads} heads x {head_dim}")
        plan.append(_PlannedTensor(f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}", t, heads))

    have = {p.hf_name for p in plan}
    needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{hf}.weight" for i in range(n_layers) for hf in _LAYER_NAMES.values()
    ]
    missing = [n for n in needed if n not in have]
    if missing:
        raise _fail(path, f"{len(missing)} tensors are missing, e.g. {missing[0]}")
    _check_dequantizable(path, {p.source.qtype for p in plan})

    ffn = _meta_int(path, meta, "llama.feed_forward_length", tensors["blk.0.ffn_up.weight"].shape[0])
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _meta_float(path, meta, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(path, header, rope_theta, head_dim),
        "max_position_embeddings": _meta_int(path, meta, "llama.context_length", 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": has_bias,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if type(value) is int:
            config[hf] = value
    config["ds4desk_import"] = {
        "source": path.name,
        "name": meta.get("general.name"),
        "importer_version": IMPORTER_VERSION,
        "quantization": sorted({p.source.qtype.name for p in plan}),
    }
    plan.sort(key=lambda p: p.hf_name)
    return config, plan


def _check_dequantizable(path: Path, qtypes: set[GGMLQuantizationType]) -> None:
    # Find an unsupported type now, before minutes of converting the tensors in front of it.
    for qtype in qtypes:
        _block, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            raise _fail(
                path, f"it uses the {qtype.name} tensor type, which ds4desk cannot dequantize"
            ) from None
        except Exception as exc:
            raise _fail(path, f"the {qtype.name} tensor type cannot be read ({exc})") from exc


def _rope_scaling(path: Path, header: GGUFHeader, theta: float, head_dim: int) -> dict[str, object] | None:
    meta = header.metadata
    kind = meta.get("llama.rope.scaling.type", "none")
    factor = meta.get("llama.rope.scaling.factor")
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

    HF describes the same thing with four numbers (the "llama3" rope type): frequencies with a
    wavelength under original_ctx/high_freq_factor are kept, those over original_ctx/low_freq_factor
    are divided by `factor`, and the band between is interpolated. We recover the numbers and
    check that they reproduce the stored divisors exactly, refusing the file otherwise.
    """
    if freqs.qtype != GGMLQuantizationType.F32 or freqs.shape != (head_dim // 2,):
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


def _token(meta: dict[str, object], key: str) -> str | None:
    tokens = meta.get("tokenizer.ggml.tokens")
    idx = meta.get(f"tokenizer.ggml.{key}")
    if isinstance(tokens, list) and type(idx) is int and 0 <= idx < len(tokens):
        return tokens[idx]
    return None


def _tokenizer_config(meta: dict[str, object], config: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", False) is True,
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False) is True,
    }
    for key, hf in (
        ("bos_token_id", "bos_token"),
        ("eos_token_id", "eos_token"),
        ("unknown_token_id", "unk_token"),
        ("padding_token_id", "pad_token"),
    ):
        token = _token(meta, key)
        if token is not None:
            out[hf] = token
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        out["chat_template"] = template
    return out


def _generation_config(meta: dict[str, object]) -> dict[str, object]:
    # Llama 3 style GGUFs name an end-of-turn (eot) / end-of-message (eom) token besides eos;
    # generation must stop on any of them.
    stops: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if type(value) is int and value not in stops:
            stops.append(value)
    out: dict[str, object] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if type(bos) is int:
        out["bos_token_id"] = bos
    if stops:
        out["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return out


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- weights -------------------------------------------------------------------------------------


def gguf_tensor_name(hf_name: str) -> str:
    """The llama GGUF name of an HF tensor name: the inverse of the import's renaming (benchmarks
    write the same weights for llama.cpp)."""
    for gguf_name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    part = next(g for g, hf in _LAYER_NAMES.items() if hf == module)
    return f"blk.{layer}.{part}.{kind}"


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of unpermute_rope_rows: HF's rotate-half Q/K rows in GGUF's adjacent-pair order."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder Q/K projection rows from GGUF's rope layout to the HF (rotate-half) layout.

    ggml's llama rope rotates adjacent pairs of a head's dimensions, (x[2i], x[2i+1]), by angle
    pos * theta_i; HF's rotate-half rotates (x[i], x[i + d/2]) by the same angle. The two are the
    same computation when GGUF row 2i is HF row i and GGUF row 2i+1 is HF row i + d/2, which is
    how the rows were stored. So within each head, HF's rows are GGUF's even rows, then its odd rows.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    per_head = weight.reshape(n_heads, head_dim, *weight.shape[1:])
    return np.ascontiguousarray(per_head[:, order].reshape(weight.shape))


def _dequantize_tensor(src: BinaryIO, t: GGUFTensor) -> np.ndarray:
    src.seek(t.offset)
    raw = src.read(t.nbytes)
    if len(raw) != t.nbytes:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED, f"tensor '{t.name}' could not be read: the file changed or shrank"
        )
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, t.shape[-1] // block * type_size)
    values = dequantize(rows, t.qtype)
    return np.asarray(values, dtype="<f4").reshape(t.shape)


def _write_weights(
    path: Path, out: Path, plan: list[_PlannedTensor], progress: Callable[[str], None] | None
) -> None:
    """Write the safetensors file one tensor at a time, so memory holds one tensor, not the model."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": path.name}}
    offset = 0
    for p in plan:
        nbytes = math.prod(p.source.shape) * 4
        header[p.hf_name] = {
            "dtype": "F32",
            "shape": list(p.source.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the spec pads the header so the data section starts 8-aligned
    with path.open("rb") as src, out.open("wb") as dst:
        dst.write(len(blob).to_bytes(8, "little"))
        dst.write(blob)
        for i, p in enumerate(plan):
            if progress is not None:
                progress(f"converting {p.source.name} ({i + 1}/{len(plan)})")
            values = _dequantize_tensor(src, p.source)
            if p.rope_heads:
                values = unpermute_rope_rows(values, p.rope_heads)
            dst.write(np.ascontiguousarray(values, dtype="<f4").tobytes())
        dst.flush()
        os.fsync(dst.fileno())
