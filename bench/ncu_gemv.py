"""Launch the one-row GGUF GEMVs of the 1.07B benchmark model (bench/gguf_gemv.py) once each
between cudaProfilerStart and cudaProfilerStop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --kernel-name regex:gemv1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
        python3 bench/ncu_gemv.py

The shapes, in order: Q4_K gate | up paired (16,384 x 2,048, writing the down's input), Q4_K and
Q6_K down (2,048 x 8,192), Q4_K q (2,048 x 2,048), Q8_0 gate/up (8,192 x 2,048). Each is compiled
and run once before the profiled range. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_gemv

from ds4desk.engine.kernels.quant import gguf_triton as gt

# (type, rows, cols, form): "pair" is norm_gemv_silu over a gate | up pair, "plain" gemv.
CASES = [
    ("Q4_K", 16384, 2048, "pair"),
    ("Q4_K", 2048, 8192, "plain"),
    ("Q6_K", 2048, 8192, "plain"),
    ("Q4_K", 2048, 2048, "plain"),
    ("Q8_0", 8192, 2048, "plain"),
]


def launcher(name: str, rows: int, cols: int, form: str) -> Callable[[], object]:
    type_id = gguf_gemv.BY_NAME[name].type_id
    weight = gguf_gemv.packed_weight(name, rows, cols, seed=1)
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
    if form == "plain":
        return lambda: gt.gemv(x, weight, type_id, cols, out)
    down = gguf_gemv.packed_weight(name, 2048, rows // 2, seed=2)
    act = gt.prepared_input(down, type_id, rows // 2)
    norm = torch.ones(cols, device="cuda", dtype=torch.bfloat16)
    return lambda: gt.norm_gemv_silu(x, norm, weight, type_id, cols, 1e-5, out, act, down, type_id)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    runs = []
    for case in CASES:
        run = launcher(*case)
        run()  # compiled and run outside the profiled range
        runs.append((case, run))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case, run in runs:
        print("case", *case, flush=True)
        run()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
