"""Where a DeepSeek-V4 prefill's time goes on the GPU (the synthetic model of bench/gpu_deepseek_v4.py).

    python3 bench/profile_v4_prefill.py [--prompt 4096] [--chunks 512 1024 2048 4096] [--out DIR]

Prints the prefill rate of one prompt at each chunk size (median of five, eager; prefill does not
use the decode graphs), then, at the fastest chunk, the inclusive time of each part of a layer
(each part timed between two synchronisations, so the parts add up to a little more than the
whole) and torch.profiler's kernel table. Writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gpu_deepseek_v4 as v4
from ds4desk.engine.loading.detect import inspect_model
from ds4desk.engine.models import deepseek_v4
from ds4desk.engine.models.registry import load_model
from ds4desk.engine.runtime import Runtime

# The model's methods timed as parts (inclusive: _attention contains _compressed_keys, which
# contains _compress and _index_select).
PARTS = ("_hc_site", "_attention", "_compressed_keys", "_compress", "_index_select", "_moe", "_hc_head")


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def part_times(runtime: Runtime, ids: list[int]) -> dict[str, float]:
    """Milliseconds per part over one prefill, each call fenced by synchronisations."""
    totals: dict[str, float] = defaultdict(float)
    originals: dict[str, Any] = {name: getattr(deepseek_v4.DeepseekV4Model, name) for name in PARTS}

    def fence(name: str, method: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = method(*args, **kwargs)
            torch.cuda.synchronize()
            totals[name] += (time.perf_counter() - start) * 1e3
            return out

        return wrapped

    try:
        for name, method in originals.items():
            setattr(deepseek_v4.DeepseekV4Model, name, fence(name, method))
        runtime.prefill_logits(ids)
        totals.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        runtime.prefill_logits(ids)
        torch.cuda.synchronize()
        totals["whole (fenced)"] = (time.perf_counter() - start) * 1e3
    finally:
        for name, method in originals.items():
            setattr(deepseek_v4.DeepseekV4Model, name, method)
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--model", type=Path, help="an existing synthetic model folder (default: write one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    folder = args.model
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="ds4v4-")) / "model"
        v4.write_model(folder)
    device = torch.device("cuda")
    model = load_model(inspect_model(folder, folder.parent / "cache"), device, torch.bfloat16).model
    runtime = Runtime(model, device, context=args.prompt + 8, chunk=args.chunks[0], graphs=False)
    ids = v4.prompt(args.prompt)
    rates: dict[int, float] = {}
    with torch.inference_mode():
        for chunk in args.chunks:
            runtime.chunk = chunk
            rates[chunk] = args.prompt / timed(lambda: runtime.prefill_logits(ids))
            print(f"chunk {chunk:5}: {rates[chunk]:10.0f} tok/s", flush=True)
        best = max(rates, key=lambda c: rates[c])
        runtime.chunk = best
        parts = part_times(runtime, ids)
        print(f"\nparts of one {args.prompt}-token prefill at chunk {best} (ms, inclusive):")
        for name, ms in parts.items():
            print(f"  {name:18} {ms:9.2f}")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            runtime.prefill_logits(ids)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    print(table)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"one prefill: {kernel_ms:.2f} ms of kernels in {sum(e.count for e in events)} kernels")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "date": stamp,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "prompt": args.prompt,
        "prefill_tok_s_by_chunk": rates,
        "parts_ms": parts,
        "kernel_ms": kernel_ms,
    }
    (args.out / f"profile_v4_prefill_{stamp}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"profile_v4_prefill_{stamp}.txt").write_text(table)


if __name__ == "__main__":
    main()
