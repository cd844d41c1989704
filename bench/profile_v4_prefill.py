"""Where a DeepSeek-V4 prefill's time goes on the GPU (the synthetic model of bench/gpu_deepseek_v4.py).

    python3 bench/profile_v4_prefill.py [--prompt 4096] [--chunks 512 1024 2048 4096] [--out DIR]

    python3 bench/profile_v4_prefill.py --mix-sweep   (the tiled hyper-connection mix's tiles)

Prints the prefill rate of one prompt at each chunk size (median of five, eager; prefill does not
use the decode graphs), then, at the fastest chunk, the inclusive time of each part of a layer
(each part timed between two synchronisations, so the parts add up to a little more than the
whole) and torch.profiler's kernel table. Writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gpu_deepseek_v4 as v4
from bench.gpu_speed import timed
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.deepseek_v4 import model as deepseek_v4
from ds4desk.engine.runtime import Runtime

# The model's methods timed as parts (inclusive: _attention contains _compressed_keys, which
# contains _compress and _index_select).
PARTS = ("_hc_site", "_attention", "_compressed_keys", "_compress", "_index_select", "_moe", "_hc_head")


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


def mix_sweep(count: int = 4096, dim: int = 4096, mult: int = 4) -> list[dict[str, Any]]:
    """Time one prefill site (with and without the previous block's expand) at each tile config of
    v4_hc_fused's tiled mix, against the eager site; every config's output is checked first."""
    from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
    from ds4desk.engine.kernels.deepseek_v4 import hc_kernel as v4_hc_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = (2 + mult) * mult

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    gates, comb = v4_hc_kernel.reference(
        3 * rand(count, rows), 0.5 + rand(3).abs(), rand(rows), mult, 20, 1e-6
    )
    streams, y = rand(count, mult, dim).bfloat16(), rand(count, dim).bfloat16()
    fn, scale, base, weight = (
        rand(rows, mult * dim) / (mult * dim) ** 0.5,
        0.5 + rand(3).abs(),
        rand(rows),
        rand(dim),
    )
    args = (fn, scale, base, weight, mult, 20, 1e-6, 1e-6)
    previous = (y, gates[:, mult:], comb)
    results = []

    def site(expand: bool) -> tuple[torch.Tensor, ...]:
        return v4_hc_fused.site(streams, previous if expand else None, *args)

    def eager_site(expand: bool) -> tuple[torch.Tensor, ...]:
        new = v4_hc_fused.reference_expand(streams, *previous) if expand else streams
        h, gates, comb = v4_hc_fused.reference_site(new, *args)
        return new, h, gates[:, mult:], comb

    with torch.inference_mode():
        want = {e: eager_site(e) for e in (False, True)}
        eager_ms = {e: timed(lambda e=e: eager_site(e), 20) * 1e3 for e in (False, True)}
    results.append({"config": "eager", "ms": eager_ms[False], "expand_ms": eager_ms[True]})
    print(f"eager site: {eager_ms[False]:.3f} ms, with expand {eager_ms[True]:.3f} ms", flush=True)
    for tokens, block, warps, stages in (
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 3),
    ):
        v4_hc_fused._TILED_MIX_TOKENS, v4_hc_fused._TILED_MIX_BLOCK = tokens, block
        v4_hc_fused._TILED_MIX_WARPS, v4_hc_fused._TILED_MIX_STAGES = warps, stages
        row: dict[str, Any] = {"config": f"BT {tokens} BD {block} warps {warps} stages {stages}"}
        try:
            with torch.inference_mode():
                for expand in (False, True):
                    got = site(expand)
                    error = max(
                        float((a.float() - b.float()).abs().max())
                        for a, b in zip(got, want[expand], strict=True)
                    )
                    row["max_error_expand" if expand else "max_error"] = error
                    row["expand_ms" if expand else "ms"] = timed(lambda e=expand: site(e), 20) * 1e3
        except Exception as exc:  # a config that does not compile or launch: say why, go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--model", type=Path, help="an existing synthetic model folder (default: write one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--mix-sweep", action="store_true", help="only time the tiled mix's configs")
    args = parser.parse_args()
    if args.mix_sweep:
        mix_sweep()
        return

    folder = args.model
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="ds4v4-")) / "model"
        v4.write_model(folder)
    device = torch.device("cuda")
    model = load_model(read_source(folder), device, torch.bfloat16).model
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
