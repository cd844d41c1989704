"""The Qwen3.5 convolution kernel's rows a program and warps, swept at Qwen3.5-9B's shapes.

    python3 bench/qwen35_conv_sweep.py [--rows 4096]

Launches kernels/qwen3_5/causal_conv_triton.py's `conv_heads_kernel` directly on bf16 inputs of
Qwen3.5-9B's linear layers (16 key heads, 32 value heads, 128 wide, 4 taps): for each setting one
launch, then the mean of 50 between CUDA events (bench/gguf_gemv.py's event_time), and the bytes it
moves (inputs read once, the float32 outputs written once) over that time. The setting in use is
causal_conv.BLOCK_T at 4 warps.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4desk.engine.kernels.qwen3_5 import causal_conv
from ds4desk.engine.kernels.qwen3_5.causal_conv_triton import conv_heads_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_gemv import event_time  # a sibling script

KEY_HEADS, HEADS, DK, DV, TAPS = 16, 32, 128, 128, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return
    rows, channels = args.rows, 2 * KEY_HEADS * DK + HEADS * DV
    inputs = torch.randn(rows, channels, device="cuda").bfloat16()
    window = torch.randn(channels, TAPS - 1, device="cuda").bfloat16()
    weight = (torch.rand(channels, TAPS, device="cuda") - 0.5).bfloat16()
    q = torch.empty(rows, KEY_HEADS, DK, device="cuda")
    k = torch.empty_like(q)
    v = torch.empty(rows, HEADS, DV, device="cuda")
    moved = inputs.numel() * 2 + (q.numel() + k.numel() + v.numel()) * 4
    print(f"{rows} rows: {moved / 1e6:.1f} MB moved a launch; in use: {causal_conv.BLOCK_T} rows, 4 warps")
    for block in (8, 16, 32, 64):
        for warps in (2, 4, 8):

            def run(block: int = block, warps: int = warps) -> None:
                conv_heads_kernel[(-(-rows // block), KEY_HEADS)](
                    inputs, window, weight, q, k, v, rows, inputs.stride(0), window.stride(0),
                    weight.stride(0), DK**-0.5, 1e-6, KEY_HEADS=KEY_HEADS, HEADS=HEADS, DK=DK, DV=DV,
                    BLOCK_DK=DK, BLOCK_DV=DV, K=TAPS, BLOCK_T=block, num_warps=warps,
                )  # fmt: skip

            us = event_time(run, reps=50) * 1e6
            print(f"rows {block:3d}, warps {warps}: {us:8.1f} µs, {moved / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
