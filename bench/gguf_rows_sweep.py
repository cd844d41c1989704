"""Sweep the settings of the Q8_0_ROWS one-row GEMV (ds4desk/engine/kernels/quant/gguf_rows_triton.py)
in the decode step's fused forms on the 1.07B benchmark model's shapes: q/k/v (3,072 rows) and
gate | up (16,384 rows) behind the RMSNorm, the down projection behind SiLU(gate) · up with the
residual add, o with the residual add. Each (BLOCK_N, BLOCK_K, warps) is timed with the programs
computing their input themselves and (norm, SiLU) with an input kernel before them.

    PYTHONPATH=. python3 bench/gguf_rows_sweep.py > rows_sweep.jsonl

Timings as bench/gguf_gemv.py's (a CUDA graph of 40 calls over weight copies larger than L2). One
JSON line a shape: the default setting's time and the five best. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.gguf_gemv import L2_BYTES, graph_time, packed_weight
from ds4desk.engine.formats import Q8_0_ROWS, gguf_packed_bytes
from ds4desk.engine.kernels.quant import gguf_tiles
from ds4desk.engine.kernels.quant import gguf_triton as gt

ROWS = Q8_0_ROWS.type_id
# (shape, rows, cols, fused form, settings tried)
CASES = [
    ("qkv", 3072, 2048, "norm", list(itertools.product((2, 4, 8), (2048,), (2, 4)))),
    ("gate_up", 16384, 2048, "norm", list(itertools.product((8, 16, 32), (1024, 2048), (2, 4)))),
    ("down", 2048, 8192, "silu_add", list(itertools.product((2, 4, 8), (1024, 2048), (4, 8)))),
    ("o", 2048, 2048, "add", list(itertools.product((2, 4, 8), (2048,), (2, 4)))),
]


def sweep(label: str, rows: int, cols: int, form: str, configs: list[tuple[int, int, int]]) -> dict:
    copies = max(2, -(-L2_BYTES // gguf_packed_bytes(ROWS, (rows, cols))))
    weights = [packed_weight(Q8_0_ROWS.name, rows, cols, i) for i in range(copies)]
    x = torch.randn(1, 2 * cols, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(cols, device="cuda", dtype=torch.bfloat16) + 0.5
    out = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
    residual = torch.zeros(1, rows, device="cuda", dtype=torch.bfloat16)

    def call(i: int) -> None:
        if form == "norm":
            gt.norm_gemv(x[:, :cols], norm, weights[i], ROWS, cols, 1e-5, out)
        elif form == "add":
            gt.gemv_add_(residual, x[:, :cols], weights[i], ROWS, cols)
        else:
            gt.gemv_add_(residual, x, weights[i], ROWS, cols, silu=True)

    kept = gguf_tiles.ROWS_OWN_INPUT_MAX_ROWS
    tried = []
    for config, own in itertools.product(configs, (True, False) if form != "add" else (True,)):
        gguf_tiles.ROWS_OVERRIDE = config
        gguf_tiles.ROWS_OWN_INPUT_MAX_ROWS = 1 << 30 if own else 0
        tried.append((graph_time(call, copies) * 1e6, config, own))
    gguf_tiles.ROWS_OVERRIDE, gguf_tiles.ROWS_OWN_INPUT_MAX_ROWS = None, kept
    tried.sort()
    return {
        "shape": label,
        "form": form,
        "default": gguf_tiles.rows_config(rows, cols),
        "default_us": graph_time(call, copies) * 1e6,
        "best": [{"us": round(us, 2), "config": c, "own_input": own} for us, c, own in tried[:5]],
    }


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the GGUF GEMV kernels run on NVIDIA GPUs"}))
        return 0
    print(json.dumps({"device": torch.cuda.get_device_name()}))
    for case in CASES:
        print(json.dumps(sweep(*case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
