"""The memory a GGUF's weights take once loaded, against the file's tensor bytes.

    .venv/bin/python bench/gguf_weight_bytes.py FILE.gguf [...] [--deepseek4-tiny DIR] [--dtype bf16]

Each file is loaded on the CPU as the app loads it (weights in place: packed ones as the file's
blocks, the rest as floats of --dtype). Per file: the bytes of every parameter held, the file's
tensor bytes, their ratio, and the parameters held as blocks against those held as floats.
--deepseek4-tiny DIR first writes the DeepSeek-V4 test files there (a tiny random V4 converted by
llama.cpp's convert_hf_to_gguf.py and requantized by its quantizer: default, Q8_0, Q2_K, Q4_K_M;
needs llama-cpp-python and the converter tree, as the tests do). --flash counts, on the meta device
(no memory), the values of DeepSeek-V4-Flash's weights that a GGUF storing every 2-D weight in a
block type keeps in its blocks, by kind, and their bytes as bf16 and as Q8_0. Prints one JSON line a
file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_header import read_gguf_header

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def weight_bytes(path: Path, dtype: torch.dtype) -> dict[str, object]:
    model = load_model(read_source(path), torch.device("cpu"), dtype).model
    params = {id(p): (name, p) for name, p in model.named_parameters()}.values()
    blocks = sum(p.numel() for _, p in params if p.dtype == torch.uint8)
    held = sum(p.numel() * p.element_size() for _, p in params)
    stored = sum(t.nbytes for t in read_gguf_header(path).tensors.values())
    return {
        "file": path.name,
        "held_mb": held / 1e6,
        "file_tensor_mb": stored / 1e6,
        "ratio": held / stored,
        "blocks_mb": blocks / 1e6,
        "floats_mb": (held - blocks) / 1e6,
        "float_parameters": sorted({_kind(name) for name, p in params if p.dtype != torch.uint8}),
    }


def flash_blocks() -> dict[str, object]:
    """What a Flash GGUF with every 2-D weight quantized keeps in blocks (the model's own rule)."""
    from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
    from ds4desk.engine.models.deepseek_v4.synthetic import flash_config
    from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear

    config = flash_config()
    with torch.device("meta"):
        floats = DeepseekV4Model(config, torch.bfloat16)
        every = {name: 8 for name, p in floats.named_parameters() if p.dim() == 2}  # GGML's Q8_0
        model = DeepseekV4Model(config, torch.bfloat16, packed=every)
    kinds: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            kinds[_kind(name)] = kinds.get(_kind(name), 0) + module.out_features * module.in_features
        elif isinstance(module, PackedEmbedding):
            kinds[_kind(name)] = module.num_embeddings * module.embedding_dim
    values = sum(kinds.values())
    return {
        "file": "DeepSeek-V4-Flash (meta)",
        "block_values": values,
        "bf16_gb": 2 * values / 1e9,
        "q8_0_gb": values * 34 / 32 / 1e9,
        "values_by_kind": kinds,
    }


def _kind(name: str) -> str:
    """A parameter's name without its layer number: one entry for every layer's."""
    parts = name.split(".")
    return ".".join(part for part in parts if not part.isdigit())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--deepseek4-tiny", type=Path, help="write the DeepSeek-V4 test files here first")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--flash", action="store_true", help="count Flash's weights kept in blocks")
    args = parser.parse_args()
    if args.flash:
        print(json.dumps(flash_blocks()), flush=True)
    files = list(args.files)
    if args.deepseek4_tiny is not None:
        from tests.engine.loading import deepseek4_files

        files += list(deepseek4_files.tiny_files(args.deepseek4_tiny).values())
    for path in files:
        print(json.dumps(weight_bytes(path, DTYPES[args.dtype])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
