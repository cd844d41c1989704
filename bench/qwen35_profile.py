"""Where a Qwen3.5 prefill's GPU time goes: torch.profiler's CUDA table for one 4,096-token prefill of
bench/qwen35_gpu.py's model (Qwen3.5-9B's per-layer shapes, 8 layers, random bf16 weights).

    python3 bench/qwen35_profile.py [--work DIR] [--tokens 4096] [--rows 30]

The model is written to --work (default /tmp/q35/qwen35-hf) and loaded as the benchmark loads it:
CUDA graphs, the Qwen3.5 kernels, one prefill chunk of the whole prompt. Two warm-up prefills, then
the profiled one, with programmatic dependent launch off (with it a kernel's time includes its wait
for the one before). Prints the table sorted by CUDA time; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import qwen35_gpu  # a sibling script: the model's shapes and weights

from ds4desk.engine.kernels import launch
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.runtime import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/q35"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return
    device = torch.device("cuda")
    cfg = qwen35_gpu.QWEN35_9B_LAYERS
    folder = args.work / "qwen35-hf"
    with torch.inference_mode():
        qwen35_gpu.write_folder(folder, cfg, qwen35_gpu.random_state(cfg, device), None)
        model = load_model(read_source(folder), device, torch.bfloat16).model
        runtime = Runtime(model, device, context=args.tokens + 64, chunk=args.tokens, graphs=True)
        prompt = qwen35_gpu.prompt_ids(args.tokens, cfg["vocab_size"])
        for _ in range(2):
            runtime.prefill_logits(prompt)
        torch.cuda.synchronize()
        with launch.PDL.force(False), profile(activities=[ProfilerActivity.CUDA]) as prof:
            runtime.prefill_logits(prompt)
            torch.cuda.synchronize()
        runtime.close()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=80))


if __name__ == "__main__":
    main()
