"""The memory a GGUF's weights take once loaded, against the file's tensor bytes.

    .venv/bin/python bench/gguf_weight_bytes.py FILE.gguf [...] [--deepseek4-tiny DIR] [--dtype bf16]

Each file is loaded on the CPU as the app loads it (weights in place: packed ones as the file's
blocks, the rest as floats of --dtype). Per file: the bytes of every parameter held, the file's
tensor bytes, their ratio, and the parameters held as blocks against those held as floats.
--deepseek4-tiny DIR first writes the DeepSeek-V4 test files there (a tiny random V4 converted by
llama.cpp's convert_hf_to_gguf.py and requantized by its quantizer: default, Q8_0, Q2_K, Q4_K_M;
needs llama-cpp-python and the converter tree, as the tests do). Prints one JSON line a file.
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


def _kind(name: str) -> str:
    """A parameter's name without its layer number: one entry for every layer's."""
    parts = name.split(".")
    return ".".join(part for part in parts if not part.isdigit())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--deepseek4-tiny", type=Path, help="write the DeepSeek-V4 test files here first")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    files = list(args.files)
    if args.deepseek4_tiny is not None:
        from tests.engine.loading import deepseek4_files

        files += list(deepseek4_files.tiny_files(args.deepseek4_tiny).values())
    for path in files:
        print(json.dumps(weight_bytes(path, DTYPES[args.dtype])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
