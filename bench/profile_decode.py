"""Where a decode step's time goes on the GPU (the dense model of bench/gpu_speed.py).

    python3 bench/profile_decode.py --model DIR [--depth 512] [--prefill 4096] [--weights q4]

Prints: the time of one replayed graph step with nothing else around it (the GPU's share), the
time of a full Runtime decode step (graph + sampling + the host's share), and torch.profiler's
kernel table for the same step run eagerly, so each kernel's GPU time can be read off. --prefill N
adds the kernel table of one N-token prefill (one chunk).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.loader import fill, load_model, plan_load
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.runtime import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--depth", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=0, help="also profile a prefill of this many tokens")
    parser.add_argument(
        "--weights", default="as-stored", choices=("as-stored", "q8", "q4"), help="quantized on load"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    source = read_source(args.model)
    context = max(args.depth + 300, args.prefill)
    if args.weights == "as-stored":
        model = load_model(source, device, torch.bfloat16).model
    else:
        model = fill(plan_load(source, device, torch.bfloat16, context, weights=args.weights)).model
    runtime = Runtime(model, device, context=context, chunk=max(4096, args.prefill), graphs=True)
    graphs = runtime.graphs
    assert graphs is not None
    ids = [(i * 7919 + 13) % 49000 + 100 for i in range(args.depth)]
    with torch.inference_mode():
        runtime.prefill_logits(ids)
        token = torch.tensor([5], device=device)
        steps = 200
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            graphs.step(token, args.depth + i)
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - start) / steps * 1e3
        out = runtime.generate(
            ids, SamplingParams(temperature=0.0), 256, set(), lambda _t: None, lambda: False
        )
        step_ms = 1e3 / out.stats.decode_tok_s
        print(f"graph replay only: {replay_ms:.3f} ms/step; full decode step: {step_ms:.3f} ms/step")

        pos = torch.tensor([args.depth], device=device)
        span = graphs.spans[0] if args.depth < graphs.spans[0] else graphs.spans[-1]
        for _ in range(3):
            model.decode_graphable(token, pos, span)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                model.decode_graphable(token, pos, span)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in events) / 10
    kernels = sum(e.count for e in events) / 10
    print(f"eager step: {gpu_us:.0f} us of kernel time in {kernels:.0f} kernels per step")
    if args.prefill:
        prompt = [(i * 7919 + 13) % 49000 + 100 for i in range(args.prefill)]
        with torch.inference_mode():
            runtime.prefill_logits(prompt)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    runtime.prefill_logits(prompt)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        prefill_ms = sum(e.self_device_time_total for e in events) / 3e3
        print(f"prefill of {args.prefill}: {prefill_ms:.2f} ms of kernels")


if __name__ == "__main__":
    main()
