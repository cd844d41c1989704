"""Full-size DeepSeek-V4-Flash geometry split over two GPUs: prefill at 1k and 8k, decode, time to
first token and memory per GPU, beside the floors. Random weights made on the GPUs (FP8 linears,
packed FP4 experts: v4_synthetic), run through the engine's Runtime (chunked prefill, per-shard
decode graphs).

    python bench/flash_two_gpus.py [--chunks 2048,4096] [--new 128] [--out bench/results/flash_two_gpus.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as v4_prefill_attention
from ds4desk.engine.kernels.quant import fp4
from ds4desk.engine.models.deepseek_v4.synthetic import build_quantized, flash_config
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.split import explicit_plan

DEVICES = ("cuda:0", "cuda:1")


def sync(devices: tuple[str, ...] = DEVICES) -> None:
    for device in devices:
        torch.cuda.synchronize(device)


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy on cuda:0 (read + write counted)."""
    src = torch.empty(1 << 32, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync()
    return 2 * 5 * src.numel() / (time.perf_counter() - start)


def matrix_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    a @ a
    sync()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    sync()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start)


def decode_bytes(model) -> int:  # type: ignore[no-untyped-def]
    """Weight bytes one decode token reads: everything but the routed experts, plus k of them per
    layer (packed values and exponents), plus the head; one embedding row is negligible."""
    cfg = model.config
    total = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            total += size * cfg.experts_per_token // cfg.num_experts
        elif "embed_tokens" not in name and "tid2eid" not in name:
            total += size
    return total


def active_flops_per_token(model) -> float:  # type: ignore[no-untyped-def]
    """2 x the multiply-adds of the weights one token uses (attention scores excluded: at 8k
    tokens with a 128 window and top-512 picks they are a few per cent)."""
    cfg = model.config
    total = 0
    for name, param in model.named_parameters():
        if param.dtype == torch.uint8 and name.endswith("_scale"):
            continue
        if name.endswith(("weight_scale_inv", "tid2eid")) or "embed_tokens" in name or param.dim() < 2:
            continue
        count = param.numel() * (2 if param.dtype == torch.uint8 else 1)  # two FP4 values a byte
        if ".experts." in name:
            count = count * cfg.experts_per_token // cfg.num_experts
        total += count
    return 2.0 * total


def run(runtime: Runtime, prompt: list[int], new: int) -> dict[str, float]:
    outcome = runtime.generate(
        prompt, SamplingParams(), new, set(), on_token=lambda _t: None, should_cancel=lambda: False
    )
    stats = outcome.stats
    return {
        "prompt": len(prompt),
        "prefill_tok_s": stats.prefill_tok_s,
        "ttft_ms": stats.time_to_first_token_s * 1000,
        "decode_tok_s": stats.decode_tok_s,
        "generated": stats.generated_tokens,
    }


def profile(model, prompt: list[int], devices: tuple[str, ...] = DEVICES, deep: int = 0) -> None:  # type: ignore[no-untyped-def]
    """torch.profiler tables (CUDA time per op, on `devices`) for one 4k prefill and 16 decode steps,
    then one eager decode step's kernels in launch order (the first layers). `deep`: then the eager
    step at position 8 against the one after a prompt of `deep` tokens (prompt[:deep]), kernel time
    by name: what grows with the context. Programmatic dependent launch is off here: with it a
    kernel's measured time includes its wait for the one before."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with launch.PDL.force(False):
        runtime = Runtime(model, torch.device("cuda:0"), context=8192, chunk=4096, graphs=True)
        try:
            run(runtime, prompt[:256], 4)  # warm-up
            for what, ids, new in (
                ("prefill 4096", prompt[:4096], 1),
                ("8 prompt tokens + 16 decode steps", prompt[:8], 17),
            ):
                with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    run(runtime, ids, new)
                    sync(devices)
                table = prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=28, max_name_column_width=70
                )
                print(f"== {what}\n{table}", flush=True)
            kernels = _step_kernels(model, prompt[8], 8, 512, devices)
            print(f"== one eager decode step: {len(kernels)} kernels; the first 240 in order (us)")
            for event in kernels[:240]:
                print(f"{event.time_range.elapsed_us():8.1f}  {event.name[:90]}")
            if deep:
                shallow = _by_name(kernels)
                run(runtime, prompt[:deep], 1)  # the cache and the compressed entries of `deep` tokens
                far = _by_name(_step_kernels(model, prompt[deep], deep, runtime.context, devices))
                where = f"at {deep} (span {runtime.context})"
                print(f"== eager decode step at position 8 (span 512) and {where}: us by kernel")
                print(f"{'at 8':>9} {'at ' + str(deep):>10} {'calls':>6}  kernel")
                for name in sorted(far, key=lambda n: far[n][0] - shallow.get(n, (0.0, 0))[0], reverse=True):
                    near_us = shallow.get(name, (0.0, 0))[0]
                    print(f"{near_us:9.1f} {far[name][0]:10.1f} {far[name][1]:6d}  {name[:90]}")
                near_total, far_total = (sum(v[0] for v in d.values()) for d in (shallow, far))
                print(f"{near_total:9.1f} {far_total:10.1f}  total")
        finally:
            runtime.close()


def _step_kernels(model, token: int, pos: int, span: int, devices: tuple[str, ...]) -> list:  # type: ignore[no-untyped-def]
    """One eager decode step at `pos` under the profiler: its CUDA kernels' events in launch order."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    first = torch.device(devices[0])
    with torch.inference_mode(), profiler(activities=[ProfilerActivity.CUDA]) as prof:
        model.decode_graphable(torch.tensor([token], device=first), torch.tensor([pos], device=first), span)
        sync(devices)
    return sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )


def _by_name(kernels: list) -> dict[str, tuple[float, int]]:  # type: ignore[type-arg]
    """{kernel name: (us in all, calls)} of a step's kernel events."""
    found: dict[str, tuple[float, int]] = {}
    for event in kernels:
        us, calls = found.get(event.name, (0.0, 0))
        found[event.name] = (us + event.time_range.elapsed_us(), calls + 1)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", default="2048,4096")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--split", default="22,21")
    parser.add_argument("--out", type=Path, default=Path("bench/results/flash_two_gpus.json"))
    parser.add_argument("--profile", action="store_true", help="where a 4k prefill and a decode step spend")
    parser.add_argument("--grouped-block", help="the FP4 prefill kernel's BLOCK_M,N,K,warps,stages")
    parser.add_argument("--attention-config", help="the prefill attention kernel's launch settings (JSON)")
    args = parser.parse_args()
    if args.grouped_block:
        fp4.GROUPED_BLOCK = tuple(int(v) for v in args.grouped_block.split(","))
    if args.attention_config:
        v4_prefill_attention.LAUNCH_CONFIG = json.loads(args.attention_config)

    config = flash_config()
    counts = tuple(int(c) for c in args.split.split(","))
    plan = explicit_plan(DEVICES, counts, config.num_layers)
    started = time.perf_counter()
    model = build_quantized(config, torch.device("cuda:0"), plan, seed=0)
    sync()
    build_s = time.perf_counter() - started
    weights = {d: torch.cuda.memory_allocated(d) for d in DEVICES}
    params = sum(
        p.numel() * (2 if p.dtype == torch.uint8 and not n.endswith("_scale") else 1)
        for n, p in model.named_parameters()
    )
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"2 x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "host": platform.node(),
        "split": counts,
        "parameters": params,
        "build_s": build_s,
        "weights_gib": {d: weights[d] / 2**30 for d in DEVICES},
        "grouped_block": list(fp4.GROUPED_BLOCK),
        "prefill_attention_config": v4_prefill_attention.LAUNCH_CONFIG,
    }
    bandwidth, rate = copy_bandwidth(), matrix_rate()
    per_token = decode_bytes(model)
    flops = active_flops_per_token(model)
    result |= {
        "copy_gb_s": bandwidth / 1e9,
        "bf16_tflop_s": rate / 1e12,
        "decode_bytes_per_token": per_token,
        "decode_floor_tok_s": bandwidth / per_token,
        "prefill_flops_per_token": flops,
        "prefill_floor_tok_s": rate / flops,
    }
    print(json.dumps(result, indent=1), flush=True)

    gen = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (1024, 8192)}
    if args.profile:
        profile(model, prompts[8192][:4096])
        return
    runs = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        runtime = Runtime(
            model, torch.device("cuda:0"), context=8192 + args.new + 8, chunk=chunk, graphs=True
        )
        try:
            assert runtime.graphs is not None, "the per-shard graphs were not captured"
            run(runtime, prompts[1024][:64], 8)  # warm-up: kernels compiled, allocator primed
            for prompt in prompts.values():
                for _ in range(2):  # the second is reported
                    measured = run(runtime, prompt, args.new)
                measured |= {"chunk": chunk, "graphs": True}
                measured["peak_gib"] = {d: torch.cuda.max_memory_allocated(d) / 2**30 for d in DEVICES}
                runs.append(measured)
                print(json.dumps(measured), flush=True)
        finally:
            runtime.close()
    runtime = Runtime(model, torch.device("cuda:0"), context=2048, chunk=1024, graphs=False)
    try:
        eager = run(runtime, prompts[1024], 16) | {"chunk": 1024, "graphs": False}
    finally:
        runtime.close()
    print(json.dumps(eager), flush=True)
    runs.append(eager)
    result["runs"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
