"""Kernel time by name inside a model's graphed decode step and graphed verify step.

    python3 bench/profile_verify.py --work DIR [--vocab DIR] [--k 4] [--top 22]

The synthetic DeepSeek-V4 of bench/gpu_deepseek_v4.py (written to DIR/v4 once), or with `--vocab`
(the tokenizer folder `bench/gpu_speed.py prepare` writes) the dense 1.07B model of
bench/gpu_speed.py (DIR/dense); 512 tokens prefilled; torch.profiler over 20 replays of each graph
(CUPTI reports the kernels a graph launches). Prints, per step, the kernel time and kernel count a
call and the kernels with the most time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gpu_deepseek_v4
from bench.gpu_speed import random_dense_state, write_hf
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.runtime import Runtime

CALLS = 20


def kernel_table(name: str, step: Callable[[], object], top: int) -> None:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] = total.get(event.name, 0.0) + event.device_time
            count[event.name] = count.get(event.name, 0) + 1
    print(
        f"== {name}: kernel time a call {sum(total.values()) / CALLS:.1f} us, "
        f"kernels a call {sum(count.values()) / CALLS:.0f}"
    )
    for kernel, us in sorted(total.items(), key=lambda item: -item[1])[:top]:
        print(f"{us / CALLS:8.1f} us {count[kernel] / CALLS:5.1f}x  {kernel[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--vocab", type=Path, help="profile the dense 1.07B model with this tokenizer")
    parser.add_argument("--k", type=int, default=4, help="drafted tokens of the verify step")
    parser.add_argument("--top", type=int, default=22, help="kernels listed a step")
    args = parser.parse_args()
    folder = args.work / ("v4" if args.vocab is None else "dense")
    if not (folder / "config.json").exists():
        if args.vocab is None:
            gpu_deepseek_v4.write_model(folder)
        else:
            write_hf(folder, random_dense_state(), args.vocab)
    device = torch.device("cuda")
    loaded = load_model(read_source(folder), device, torch.bfloat16)
    runtime = Runtime(loaded.model, device, context=1024, chunk=512, graphs=True)
    graphs = runtime.graphs
    assert graphs is not None
    ids = torch.randint(100, 40000, (600,), device=device)
    with torch.inference_mode():
        runtime.model.forward(ids[:512], 0, "none")
        token, block = ids[512:513], ids[512 : 513 + args.k]
        for _ in range(5):  # captures and warm-up
            runtime._decode(token, 512)
            graphs.verify(block, 512)
        torch.cuda.synchronize()
        kernel_table("plain step", lambda: runtime._decode(token, 512), args.top)
        kernel_table(f"verify k={args.k}", lambda: graphs.verify(block, 512), args.top)
    runtime.close()


if __name__ == "__main__":
    main()
