"""Qwen3.5 on one GPU: ds4desk against transformers and llama.cpp on a synthetic 8-layer Qwen3.5.

    # on the GPU machine, in one process
    python3 bench/qwen35_gpu.py [--llama-bench PATH] [--gguf-type bf16|f16] [--vocab DIR]
        [--work DIR] [--skip NAME,...] [--out bench/results]
    # a CPU smoke run of the whole flow with tiny shapes
    .venv/bin/python bench/qwen35_gpu.py --device cpu --tiny

The model has the per-layer shapes of Qwen3.5-9B's text model (transformers' Qwen3_5TextConfig
defaults, "Qwen3.5-9B style": hidden 4096, MLP 12288, vocab 248320 untied; full attention with 16
query heads of 256, 4 KV heads, RoPE on a quarter of each head, theta 1e7; Gated DeltaNet with 16
key heads and 32 value heads of 128, a 4-tap convolution) but 8 layers, every fourth full attention:
6 linear, 2 full. Its weights are random bf16, written once as a Hugging Face folder (ds4desk and
transformers load it) and, with --llama-bench, as a GGUF in llama.cpp's `qwen35` layout with the
same values (--gguf-type bf16: exactly them; f16: rounded), which llama.cpp's `llama-bench` and
ds4desk (the "ds4desk-gguf" row) run.

Measured, per engine where it applies: decode tok/s of NEW_TOKENS after a 512-token prompt, prefill
tok/s of a 4096-token prompt (ds4desk at each prefill chunk size, the best kept), the time to first
token of a 4096-token prompt, and a follow-up turn (the 4k prompt, its answer and a short question)
from the snapshot saved after the answer against the same turn cold. Also the chunked delta rule
alone at 4096 tokens (its share of the prefill; on its kernels and in torch ops, and how far apart
their results are) and, as a check that the file and the engines agree,
the relative difference of ds4desk's last logits from transformers' and from ds4desk's own on the
GGUF. ds4desk rows: "ds4desk" (CUDA graphs, the Triton kernels where they run: Qwen3.5's decode
step, chunked delta rule and gated norm, the one-row GEMVs with the norms and residual adds folded in),
"ds4desk-nokernels" (graphs, those kernels off: what they pay), "ds4desk-eager" (no graphs),
"ds4desk-gguf" (the GGUF file in place). transformers is skipped cleanly where it has no Qwen3.5 (before 5.2).

No tokenizer is needed (prompts are token ids): the folder gets a byte-level one, or --vocab DIR's
tokenizer.json where given. Prints a table; writes one JSON under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf_vocab import add_byte_level_vocab  # a sibling script: bench/ is the script's folder

from ds4desk.engine.api import SamplingParams, SaveSnapshot
from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.dense import gemv as dense_gemv
from ds4desk.engine.kernels.qwen3_5 import causal_conv, chunked_delta, gated_norm, linear_decode
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.qwen3_5 import delta_rule
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore

LINEAR, FULL = "linear_attention", "full_attention"
LAYERS = 8
QWEN35_9B_LAYERS: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": LAYERS,
    "layer_types": [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(LAYERS)],
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# The same layer pattern at CPU sizes (--tiny): key and value heads of one width (llama.cpp sizes both
# by one GGUF key), more value heads than key heads (the tiled GGUF order matters).
TINY: dict[str, Any] = {
    **QWEN35_9B_LAYERS,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 2048,
}


@dataclass(slots=True, frozen=True)
class Sizes:
    """The prompt lengths and counts of a run (a GPU run's, or --tiny's)."""

    decode_prompt: int = 512
    prefill_prompt: int = 4096
    new_tokens: int = 256
    answer_tokens: int = 64  # the first turn's answer, before the follow-up
    question_tokens: int = 32  # the follow-up's new tokens
    chunks: tuple[int, ...] = (512, 1024, 2048, 4096)
    repeats: int = 3


GPU_SIZES = Sizes()
TINY_SIZES = Sizes(64, 256, 16, 8, 8, (64, 256), 2)


# --- the synthetic model ------------------------------------------------------------------------


def random_state(cfg: dict[str, Any], device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights under transformers' names for a text-only Qwen3.5 (Qwen3_5ForCausalLM),
    drawn on `device` (fast on a GPU), returned on the CPU. Norms near their neutral values, decay
    rates spread as transformers initialises them, projections N(0, 0.02)."""
    meta = device.type == "meta"  # shapes only (parameter_count)
    gen = None if meta else torch.Generator(device=device).manual_seed(seed)
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_channels = 2 * kh * kd + vh * vd
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        if meta:
            return torch.empty(shape, dtype=torch.bfloat16, device=device)
        return (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        if meta:
            return torch.empty(shape, dtype=torch.bfloat16, device=device)
        values = torch.rand(shape, generator=gen, device=device) * (high - low) + low
        return values.to(torch.bfloat16).cpu()

    state = {
        "model.embed_tokens.weight": normal(cfg["vocab_size"], hidden),
        "model.norm.weight": uniform(-0.1, 0.1, hidden),
        "lm_head.weight": normal(cfg["vocab_size"], hidden),
    }
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": uniform(-0.1, 0.1, hidden),
            p + "post_attention_layernorm.weight": uniform(-0.1, 0.1, hidden),
            p + "mlp.gate_proj.weight": normal(ffn, hidden),
            p + "mlp.up_proj.weight": normal(ffn, hidden),
            p + "mlp.down_proj.weight": normal(hidden, ffn),
        }
        if kind == LINEAR:
            a = p + "linear_attn."
            state |= {
                a + "in_proj_qkv.weight": normal(conv_channels, hidden),
                a + "in_proj_z.weight": normal(vh * vd, hidden),
                a + "in_proj_b.weight": normal(vh, hidden),
                a + "in_proj_a.weight": normal(vh, hidden),
                a + "out_proj.weight": normal(hidden, vh * vd),
                a + "conv1d.weight": uniform(-0.5, 0.5, conv_channels, 1, cfg["linear_conv_kernel_dim"]),
                a + "dt_bias": uniform(0.5, 1.5, vh),
                a + "A_log": uniform(0.0, 2.7, vh),  # log of U(1, 16): transformers' spread
                a + "norm.weight": uniform(0.9, 1.1, vd),
            }
        else:
            a = p + "self_attn."
            state |= {
                a + "q_proj.weight": normal(2 * heads * head_dim, hidden),  # query and gate
                a + "k_proj.weight": normal(kv_heads * head_dim, hidden),
                a + "v_proj.weight": normal(kv_heads * head_dim, hidden),
                a + "o_proj.weight": normal(hidden, heads * head_dim),
                a + "q_norm.weight": uniform(-0.1, 0.1, head_dim),
                a + "k_norm.weight": uniform(-0.1, 0.1, head_dim),
            }
    return state


def parameter_count(cfg: dict[str, Any]) -> int:
    return sum(t.numel() for t in random_state(cfg, torch.device("meta")).values())


def write_folder(
    folder: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor], vocab: Path | None
) -> None:
    from safetensors.torch import save_file

    from ds4desk.engine.make_tiny import write_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if vocab is not None:
        shutil.copy(vocab / "tokenizer.json", folder / "tokenizer.json")
    else:
        write_tokenizer(folder, cfg["vocab_size"])


# --- the same weights as a GGUF in llama.cpp's qwen35 layout -----------------------------------------


def _tiled(key_heads: int, per_key: int, width: int) -> np.ndarray:
    """llama.cpp's order of per-value-head items: stored item i is Hugging Face item order[i] (grouped
    by key head -> tiled over the key heads)."""
    grouped = np.arange(key_heads * per_key * width).reshape(key_heads, per_key, width)
    return grouped.transpose(1, 0, 2).ravel()


def write_gguf(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor], kind: str) -> None:
    """`state` as llama.cpp's converter lays a Qwen3.5 out: centred norms stored as 1 + w, -exp(A_log),
    the convolution squeezed, every per-value-head row, channel and column tiled over the key heads;
    matrices in `kind` (bf16: the same values; f16), vectors and the convolution in float32."""
    import gguf
    from gguf import MODEL_TENSOR as T
    from gguf import TENSOR_NAMES

    arch = "qwen35"
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    heads_order = _tiled(kh, vh // kh, vd)
    scalar_order = _tiled(kh, vh // kh, 1)
    qkv_order = np.concatenate([np.arange(2 * kh * kd), 2 * kh * kd + heads_order])
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_metadata(writer, arch, cfg, kind)
    matrix_type = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.F16

    def put(
        hf: str, tensor: Any, layer: int | None = None, suffix: str | None = "weight", **how: Any
    ) -> None:
        name = TENSOR_NAMES[tensor].format(bid=layer) if layer is not None else TENSOR_NAMES[tensor]
        name = f"{name}.{suffix}" if suffix else name
        values = state[hf]
        if how.get("squeeze"):
            values = values[:, 0, :]
        if "rows" in how:
            values = values[torch.from_numpy(how["rows"])]
        if "cols" in how:
            values = values[:, torch.from_numpy(how["cols"])]
        if how.get("shift"):
            values = values.float() + 1.0
        if how.get("rate"):
            values = -values.float().exp()
        if values.dim() == 1 or how.get("squeeze"):
            writer.add_tensor(name, values.float().contiguous().numpy())
        elif kind == "bf16":
            raw = values.contiguous().view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, values.to(torch.float16).contiguous().numpy())

    put("model.embed_tokens.weight", T.TOKEN_EMBD)
    put("model.norm.weight", T.OUTPUT_NORM, shift=True)
    put("lm_head.weight", T.OUTPUT)
    for i, layer_kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        put(f"{p}.input_layernorm.weight", T.ATTN_NORM, i, shift=True)
        put(f"{p}.post_attention_layernorm.weight", T.ATTN_POST_NORM, i, shift=True)
        if layer_kind == FULL:
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
        for module, tensor in (("gate_proj", T.FFN_GATE), ("up_proj", T.FFN_UP), ("down_proj", T.FFN_DOWN)):
            put(f"{p}.mlp.{module}.weight", tensor, i)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_metadata(w: Any, arch: str, cfg: dict[str, Any], kind: str) -> None:
    import gguf
    from gguf import Keys

    llm, attn, ssm, rope = Keys.LLM, Keys.Attention, Keys.SSM, Keys.Rope
    w.add_name("ds4desk-bench-qwen35-9b-8-layers")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if kind == "bf16" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_uint32(llm.FULL_ATTENTION_INTERVAL.format(arch=arch), cfg["layer_types"].index(FULL) + 1)
    w.add_uint32(llm.BLOCK_COUNT.format(arch=arch), cfg["num_hidden_layers"])
    w.add_uint32(llm.CONTEXT_LENGTH.format(arch=arch), cfg["max_position_embeddings"])
    w.add_uint32(llm.EMBEDDING_LENGTH.format(arch=arch), cfg["hidden_size"])
    w.add_uint32(llm.FEED_FORWARD_LENGTH.format(arch=arch), cfg["intermediate_size"])
    w.add_uint32(attn.HEAD_COUNT.format(arch=arch), cfg["num_attention_heads"])
    w.add_uint32(attn.HEAD_COUNT_KV.format(arch=arch), cfg["num_key_value_heads"])
    w.add_uint32(attn.KEY_LENGTH.format(arch=arch), cfg["head_dim"])
    w.add_uint32(attn.VALUE_LENGTH.format(arch=arch), cfg["head_dim"])
    w.add_float32(attn.LAYERNORM_RMS_EPS.format(arch=arch), cfg["rms_norm_eps"])
    params = cfg["rope_parameters"]
    w.add_float32(rope.FREQ_BASE.format(arch=arch), params["rope_theta"])
    w.add_uint32(
        rope.DIMENSION_COUNT.format(arch=arch), int(cfg["head_dim"] * params["partial_rotary_factor"])
    )
    # llama.cpp requires multimodal rope sections; text positions turn every section alike.
    w.add_array(rope.DIMENSION_SECTIONS.format(arch=arch), [11, 11, 10, 0])
    w.add_uint32(ssm.CONV_KERNEL.format(arch=arch), cfg["linear_conv_kernel_dim"])
    w.add_uint32(ssm.STATE_SIZE.format(arch=arch), cfg["linear_key_head_dim"])
    w.add_uint32(ssm.GROUP_COUNT.format(arch=arch), cfg["linear_num_key_heads"])
    w.add_uint32(ssm.TIME_STEP_RANK.format(arch=arch), cfg["linear_num_value_heads"])
    w.add_uint32(
        ssm.INNER_SIZE.format(arch=arch), cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    )
    # A byte-level vocabulary padded to the model's size (llama.cpp needs one token per row).
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    add_byte_level_vocab(w, cfg["vocab_size"], special, arch, eos_id=2)
    w.add_pad_token_id(0)


# --- measuring ------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of `fn` after one warm-up run, the device drained around each run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt_ids(count: int, vocab: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + 13 + salt) % (vocab - 200) + 100 for i in range(count)]


GREEDY = SamplingParams(temperature=0.0)


def _generate(runtime: Runtime, ids: list[int], new: int, **more: Any) -> Any:
    out = runtime.generate(ids, GREEDY, new, set(), lambda _t: None, lambda: False, **more)
    assert len(out.tokens) == new, f"asked {new} tokens, got {len(out.tokens)}"
    return out


def bench_ds4desk(
    path: Path,
    name: str,
    device: torch.device,
    sizes: Sizes,
    vocab: int,
    graphs: bool,
    kernels: bool,
    full: bool,
) -> dict[str, Any]:
    """One ds4desk configuration on `path` (a folder or a GGUF). `full`: the prefill sweep, TTFT and
    the snapshot follow-up as well as decode."""
    off = None if kernels else False
    switches = {
        linear_decode.SWITCH: off,
        gated_norm.SWITCH: off,
        chunked_delta.SWITCH: off,
        causal_conv.SWITCH: off,
        dense_gemv.SWITCH: off,
    }
    row: dict[str, Any] = {"engine": name, "graphs": graphs, "qwen35_kernels": kernels}
    with launch.force(switches), torch.inference_mode():
        model = load_model(read_source(path), device, torch.bfloat16).model
        context = sizes.prefill_prompt + sizes.answer_tokens + sizes.question_tokens + 64
        runtime = Runtime(model, device, context=context, chunk=max(sizes.chunks), graphs=graphs)
        row["kernels_on"] = {
            "linear_decode": linear_decode.enabled(device),
            "gated_norm": gated_norm.enabled(device),
            "causal_conv": causal_conv.enabled(device),
            "dense_gemv": dense_gemv.enabled(device),
        }
        short = prompt_ids(sizes.decode_prompt, vocab)
        decodes = [
            _generate(runtime, short, sizes.new_tokens).stats.decode_tok_s for _ in range(sizes.repeats)
        ]
        row[f"decode_{sizes.decode_prompt}_tok_s"] = statistics.median(decodes)
        row["last_logits"] = runtime.prefill_logits(short).float().cpu()
        if full:
            long = prompt_ids(sizes.prefill_prompt, vocab)
            sweep = {}
            for chunk in sizes.chunks:
                runtime.chunk = chunk
                sweep[chunk] = sizes.prefill_prompt / timed(lambda: runtime.prefill_logits(long), device)
            best = max(sweep, key=lambda c: sweep[c])
            runtime.chunk = best
            row[f"prefill_{sizes.prefill_prompt}_tok_s"] = sweep[best]
            row["prefill_chunk"] = best
            row["prefill_by_chunk_tok_s"] = sweep
            ttfts = [_generate(runtime, long, 1).stats.time_to_first_token_s for _ in range(sizes.repeats)]
            row[f"ttft_{sizes.prefill_prompt}_s"] = statistics.median(ttfts)
            row |= follow_up(runtime, long, sizes, vocab, model.dtype)
        runtime.close()
    model = runtime = None  # the weights and state go before the next row loads
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def follow_up(
    runtime: Runtime, prompt: list[int], sizes: Sizes, vocab: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The 4k prompt answered with a snapshot saved after the answer, then the next turn (the prompt,
    the answer, a short question) from that snapshot and cold, alternating."""
    store = SnapshotStore(ModelIdentity("qwen35-bench", str(dtype).removeprefix("torch."), runtime.context))
    first = _generate(
        runtime, prompt, sizes.answer_tokens, snapshots=store, use_snapshots=True, save=SaveSnapshot()
    )
    question = prompt_ids(sizes.question_tokens, vocab, salt=7)
    turn = [*prompt, *first.tokens, *question]
    warm, cold, reused = [], [], 0
    for _ in range(sizes.repeats):
        again = _generate(runtime, turn, 1, snapshots=store, use_snapshots=True)
        warm.append(again.stats.time_to_first_token_s)
        reused = again.stats.reused_tokens
        cold.append(_generate(runtime, turn, 1, use_snapshots=False).stats.time_to_first_token_s)
    warm_s, cold_s = statistics.median(warm), statistics.median(cold)
    return {
        "follow_up_prompt_tokens": len(turn),
        "follow_up_reused_tokens": reused,
        "follow_up_ttft_snapshot_s": warm_s,
        "follow_up_ttft_cold_s": cold_s,
        "follow_up_ratio": warm_s / cold_s,
    }


def transformers_available() -> str | None:
    """None where transformers can run Qwen3.5, else why not."""
    try:
        import transformers
    except Exception as exc:
        return f"transformers not importable: {exc}"
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        return f"transformers {transformers.__version__} has no Qwen3.5 (qwen3_5)"
    return None


def bench_transformers(folder: Path, device: torch.device, sizes: Sizes, vocab: int) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    row: dict[str, Any] = {"engine": "transformers", "version": transformers.__version__}
    # transformers runs Gated DeltaNet through flash-linear-attention and causal-conv1d where they are
    # installed, else through its torch fallback: say which this run had.
    for module in ("fla", "causal_conv1d"):
        try:
            __import__(module)
            row[f"has_{module}"] = True
        except Exception:
            row[f"has_{module}"] = False
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids(sizes.decode_prompt, vocab)], device=device)
        prefill_s = timed(lambda: model(ids, logits_to_keep=1), device, sizes.repeats)
        row["last_logits"] = model(ids, logits_to_keep=1).logits[0, -1].float().cpu()

        def generate() -> None:
            new = sizes.new_tokens
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

        total_s = timed(generate, device, max(1, sizes.repeats - 1))
        row[f"decode_{sizes.decode_prompt}_tok_s"] = (sizes.new_tokens - 1) / max(total_s - prefill_s, 1e-9)
        long = torch.tensor([prompt_ids(sizes.prefill_prompt, vocab)], device=device)
        long_s = timed(lambda: model(long, logits_to_keep=1), device, sizes.repeats)
        row[f"prefill_{sizes.prefill_prompt}_tok_s"] = sizes.prefill_prompt / long_s
        row[f"ttft_{sizes.prefill_prompt}_s"] = long_s
    model.to("meta")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_llama_cpp(binary: Path, gguf_path: Path, sizes: Sizes) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": "llama.cpp"}

    def run(*args: str) -> list[dict[str, Any]]:
        cmd = [str(binary), "-m", str(gguf_path), "-ngl", "99", "-fa", "1", "-r", "3", "-o", "json", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    # Prefill at llama.cpp's default micro-batch and at larger ones; the best is its figure.
    batch = str(sizes.prefill_prompt)
    ubatches = ",".join(str(u) for u in sorted({min(512, sizes.prefill_prompt), sizes.prefill_prompt}))
    by_ubatch = {}
    for test in run("-p", str(sizes.prefill_prompt), "-n", "0", "-b", batch, "-ub", ubatches):
        by_ubatch[test["n_ubatch"]] = test["avg_ts"]
    best = max(by_ubatch, key=lambda u: by_ubatch[u])
    row[f"prefill_{sizes.prefill_prompt}_tok_s"] = by_ubatch[best]
    row["prefill_by_ubatch_tok_s"] = by_ubatch
    row[f"ttft_{sizes.prefill_prompt}_s"] = sizes.prefill_prompt / by_ubatch[best]  # prefill time only
    for test in run("-p", "0", "-n", str(sizes.new_tokens), "-d", str(sizes.decode_prompt)):
        row[f"decode_{test['n_depth']}_tok_s"] = test["avg_ts"]
    return row


def delta_rule_share(cfg: dict[str, Any], device: torch.device, tokens: int) -> dict[str, float]:
    """The chunked delta rule alone over `tokens` positions of one linear layer, as the bf16 model
    runs it (its kernels where they run) and in torch ops (the kernels off), and times the linear
    layers: its part of a prefill. Also how far the kernels' result is from the torch ops'."""
    gen = torch.Generator(device=device).manual_seed(1)
    heads, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device)

    q = delta_rule.unit_rows(rand(heads, tokens, dk)) * dk**-0.5
    k = delta_rule.unit_rows(rand(heads, tokens, dk))
    v, g = rand(heads, tokens, dv), -torch.rand(heads, tokens, generator=gen, device=device)
    beta = torch.rand(heads, tokens, generator=gen, device=device)
    state = torch.zeros(heads, dk, dv, device=device)
    layers = cfg["layer_types"].count(LINEAR)
    result: dict[str, float] = {}
    outputs = []
    for name, kernels in (("", None), ("torch_", False)):
        with launch.force({chunked_delta.SWITCH: kernels}), torch.inference_mode():

            def run() -> torch.Tensor:
                return delta_rule.chunked(q, k, v, g, beta, state.zero_(), torch.bfloat16)

            seconds = timed(run, device)
            outputs.append(run())
        result[f"delta_rule_{name}layer_s"] = seconds
        result[f"delta_rule_{name}all_layers_s"] = seconds * layers
    result["delta_rule_kernels_rel_diff"] = relative_difference(*outputs)
    return result


def conv_share(cfg: dict[str, Any], device: torch.device, tokens: int) -> dict[str, float]:
    """The linear layers' input stage (causal convolution, silu, the heads the delta rule reads) over
    `tokens` rows of one layer in bf16, on its kernel and as the eager ops, times the linear layers,
    and how far the two results are apart."""
    gen = torch.Generator(device=device).manual_seed(2)
    heads = (
        cfg["linear_num_key_heads"],
        cfg["linear_key_head_dim"],
        cfg["linear_num_value_heads"],
        cfg["linear_value_head_dim"],
    )
    channels = 2 * heads[0] * heads[1] + heads[2] * heads[3]
    taps = cfg["linear_conv_kernel_dim"]
    inputs = torch.randn(tokens, channels, generator=gen, device=device).bfloat16()
    window = torch.randn(channels, taps - 1, generator=gen, device=device).bfloat16()
    weight = torch.rand(channels, taps, generator=gen, device=device).bfloat16() - 0.5
    layers = cfg["layer_types"].count(LINEAR)
    result: dict[str, float] = {}
    outputs = []
    for name, kernel in (("", None), ("torch_", False)):
        with causal_conv.SWITCH.force(kernel), torch.inference_mode():

            def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return causal_conv.conv_heads(inputs, window, weight, *heads)

            seconds = timed(run, device)
            outputs.append(torch.cat([t.flatten() for t in run()]))
        result[f"conv_{name}layer_s"] = seconds
        result[f"conv_{name}all_layers_s"] = seconds * layers
    result["conv_kernel_rel_diff"] = relative_difference(*outputs)
    return result


def relative_difference(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


# --- the run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cpu":
        # The smoke run's small ops gain nothing from more threads, and on a busy machine they wait
        # for one another (tens of times slower measured with two).
        torch.set_num_threads(1)
    cfg, sizes = (TINY, TINY_SIZES) if args.tiny else (QWEN35_9B_LAYERS, GPU_SIZES)
    work = args.work or Path(tempfile.mkdtemp(prefix="ds4qwen35-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "machine": platform.platform(),
        "model": "Qwen3.5-9B per-layer shapes, 8 layers (6 linear, 2 full), bf16"
        if not args.tiny
        else "tiny",
        "config": cfg,
        "sizes": {k: getattr(sizes, k) for k in Sizes.__slots__},
    }
    started = time.perf_counter()
    folder, gguf_path = work / "qwen35-hf", work / f"qwen35-{args.gguf_type}.gguf"
    wants_gguf = args.llama_bench is not None or args.device == "cpu" or "ds4desk-gguf" not in args.skip
    # Files a run before left in --work (same shapes, same seed) are used again: a run split over
    # several calls (--skip) writes the model once.
    written = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    if written != cfg or (wants_gguf and not gguf_path.is_file()):
        state = random_state(cfg, device)
        write_folder(folder, cfg, state, args.vocab)
        if wants_gguf:
            write_gguf(gguf_path, cfg, state, args.gguf_type)
        del state
        print(f"wrote the model in {time.perf_counter() - started:.0f} s", flush=True)
    result["parameters"] = parameter_count(cfg)

    vocab, graphs = cfg["vocab_size"], device.type == "cuda"
    engines: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("ds4desk", lambda: bench_ds4desk(folder, "ds4desk", device, sizes, vocab, graphs, True, True)),
        (
            "ds4desk-nokernels",
            lambda: bench_ds4desk(folder, "ds4desk-nokernels", device, sizes, vocab, graphs, False, True),
        ),
        (
            "ds4desk-eager",
            lambda: bench_ds4desk(folder, "ds4desk-eager", device, sizes, vocab, False, True, False),
        ),
    ]
    if wants_gguf:
        engines.append(
            (
                "ds4desk-gguf",
                lambda: bench_ds4desk(gguf_path, "ds4desk-gguf", device, sizes, vocab, graphs, True, True),
            )
        )
    why_not = transformers_available()
    if why_not is None:
        engines.append(("transformers", lambda: bench_transformers(folder, device, sizes, vocab)))
    else:
        result["transformers_skipped"] = why_not
        print(f"transformers skipped: {why_not}")
    if args.llama_bench is not None:
        engines.append(("llama.cpp", lambda: bench_llama_cpp(args.llama_bench, gguf_path, sizes)))
    rows: list[dict[str, Any]] = []
    logits: dict[str, torch.Tensor] = {}
    for name, bench in engines:
        if name in args.skip or (name == "ds4desk-eager" and not graphs):
            continue
        began = time.perf_counter()
        try:
            row = bench()
        except Exception as exc:  # one engine failing must not lose the others' numbers
            row = {"engine": name, "error": f"{type(exc).__name__}: {exc}"}
        row["elapsed_s"] = time.perf_counter() - began  # loading and capture included (planning runs)
        if "last_logits" in row:
            logits[name] = row.pop("last_logits")
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    if "ds4desk" in logits:
        for other in ("transformers", "ds4desk-gguf"):
            if other in logits:
                result[f"logits_rel_diff_ds4desk_vs_{other}"] = relative_difference(
                    logits["ds4desk"], logits[other]
                )
    if "delta_rule" not in args.skip:
        result["chunked_delta_rule"] = delta_rule_share(cfg, device, sizes.prefill_prompt)
    if "conv" not in args.skip:
        result["causal_conv"] = conv_share(cfg, device, sizes.prefill_prompt)
    result["rows"] = rows
    print_table(result, sizes)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"qwen35_gpu_{'tiny_' if args.tiny else ''}{args.device}_{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path}")
    return result


def print_table(result: dict[str, Any], sizes: Sizes) -> None:
    d, p = sizes.decode_prompt, sizes.prefill_prompt
    keys = [
        f"decode_{d}_tok_s",
        f"prefill_{p}_tok_s",
        f"ttft_{p}_s",
        "follow_up_ttft_snapshot_s",
        "follow_up_ratio",
    ]
    labels = [f"decode@{d} tok/s", f"prefill {p} tok/s", f"TTFT {p} s", "follow-up s", "snap/cold"]
    print(f"\n{result['model']} on {result['device']}")
    print(f"{'engine':20}" + "".join(f"{label:>18}" for label in labels))
    rows = result["rows"]
    for row in rows:
        if "error" in row:
            print(f"{row['engine']:20}  error: {row['error'][:150]}")
            continue
        print(f"{row['engine']:20}" + "".join(f"{row.get(k, float('nan')):18.4g}" for k in keys))
    ours = next((r for r in rows if r["engine"] == "ds4desk" and "error" not in r), None)
    if ours is None:
        return
    goals = {"llama.cpp": (1.3, 2.0), "transformers": (10.0, None)}
    for row in rows:
        if row is ours or "error" in row or not row["engine"].startswith(("llama", "transformers")):
            continue
        decode = ours.get(keys[0], float("nan")) / row.get(keys[0], float("nan"))
        prefill = ours.get(keys[1], float("nan")) / row.get(keys[1], float("nan"))
        want_decode, want_prefill = goals.get(row["engine"], (None, None))
        line = f"ds4desk / {row['engine']}: decode x{decode:.2f}"
        line += f" (goal {want_decode})" if want_decode else ""
        line += f", prefill x{prefill:.2f}" + (f" (goal {want_prefill})" if want_prefill else "")
        print(line)
    if "follow_up_ratio" in ours:
        print(f"follow-up from a snapshot: {100 * ours['follow_up_ratio']:.1f}% of cold (goal < 10%)")
    share = result.get("chunked_delta_rule")
    if share and ours.get(keys[1]):
        prefill_s = p / ours[keys[1]]
        print(
            f"chunked delta rule at {p} tokens: {share['delta_rule_all_layers_s'] * 1e3:.1f} ms over the "
            f"linear layers, {100 * share['delta_rule_all_layers_s'] / prefill_s:.0f}% of ds4desk's prefill; "
            f"in torch ops {share['delta_rule_torch_all_layers_s'] * 1e3:.1f} ms"
        )
    conv = result.get("causal_conv")
    if conv:
        print(
            f"convolution to heads at {p} tokens: {conv['conv_all_layers_s'] * 1e3:.2f} ms over the linear "
            f"layers; as the eager ops {conv['conv_torch_all_layers_s'] * 1e3:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and prompts (a CPU smoke run)")
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench (a CUDA build)")
    parser.add_argument("--gguf-type", choices=("bf16", "f16"), default="bf16")
    parser.add_argument("--vocab", type=Path, help="a folder with a tokenizer.json for the model folder")
    parser.add_argument(
        "--skip",
        default="",
        type=lambda text: set(filter(None, text.split(","))),
        help="rows to leave out: ds4desk-nokernels, ds4desk-eager, ds4desk-gguf, transformers, llama.cpp, "
        "delta_rule, conv",
    )
    parser.add_argument("--work", type=Path, help="where to write the model (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
