"""Where a Qwen3.5 prefill's GPU time goes: torch.profiler's CUDA table for one 4,096-token prefill of
bench/qwen35_gpu.py's model (Qwen3.5-9B's per-layer shapes, 8 layers, random bf16 weights).

    python3 bench/qwen35_profile.py [--work DIR] [--tokens 4096] [--rows 30] [--follow-up N]

The model is written to --work (default /tmp/q35/qwen35-hf) and loaded as the benchmark loads it:
CUDA graphs, the Qwen3.5 kernels, one prefill chunk of the whole prompt. Two warm-up prefills, then
the profiled one, with programmatic dependent launch off (with it a kernel's time includes its wait
for the one before). Prints the table sorted by CUDA time; needs a CUDA GPU.

--follow-up N profiles the benchmark's follow-up turn instead: the prompt answered with 64 tokens and
a snapshot saved after them, then the prompt, the answer and N new tokens from that snapshot to the
first token. It prints the turns' times to the first token, then for one of them the host's time,
the GPU's busy time, and both tables (by host time, by GPU time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import qwen35_gpu  # a sibling script: the model's shapes and weights

from ds4desk.engine.api import SaveSnapshot
from ds4desk.engine.kernels import launch
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/q35"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--follow-up", type=int, metavar="N", help="instead: the follow-up turn (above)")
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
        context = args.tokens + 64 + (args.follow_up or 0) + 64
        runtime = Runtime(model, device, context=context, chunk=args.tokens, graphs=True)
        prompt = qwen35_gpu.prompt_ids(args.tokens, cfg["vocab_size"])
        if args.follow_up is not None:
            follow_up(runtime, prompt, args.follow_up, cfg["vocab_size"], args.rows)
            runtime.close()
            return
        for _ in range(2):
            runtime.prefill_logits(prompt)
        torch.cuda.synchronize()
        with launch.PDL.force(False), profile(activities=[ProfilerActivity.CUDA]) as prof:
            runtime.prefill_logits(prompt)
            torch.cuda.synchronize()
        runtime.close()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=80))


def follow_up(runtime: Runtime, prompt: list[int], new: int, vocab: int, rows: int) -> None:
    """The benchmark's follow-up turn (qwen35_gpu.follow_up), timed a few times, then profiled once."""
    store = SnapshotStore(ModelIdentity("qwen35-profile", "bfloat16", runtime.context))
    first = qwen35_gpu._generate(
        runtime, prompt, 64, snapshots=store, use_snapshots=True, save=SaveSnapshot()
    )
    turn = [*prompt, *first.tokens, *qwen35_gpu.prompt_ids(new, vocab, salt=7)]

    def again() -> float:
        out = qwen35_gpu._generate(runtime, turn, 1, snapshots=store, use_snapshots=True)
        torch.cuda.synchronize()
        return out.stats.time_to_first_token_s

    times = [again() for _ in range(5)]
    print("follow-up times to first token, ms:", " ".join(f"{1e3 * t:.2f}" for t in times))
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with launch.PDL.force(False), profile(activities=activities) as prof:
        profiled = again()
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)  # kernels
    print(f"profiled turn: {1e3 * profiled:.2f} ms to the first token; GPU busy {busy_us / 1e3:.2f} ms")
    for key in ("cpu_time_total", "self_device_time_total"):
        print(events.table(sort_by=key, row_limit=rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
