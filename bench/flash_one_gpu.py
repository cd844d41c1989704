"""DeepSeek-V4-Flash's full geometry on ONE GPU: the routed experts in GGUF block types of 2-3 bits
(a Q2_K-class mix: gate and up Q2_K, down Q3_K by default), FP8 linears elsewhere, about 100 GB of
random weights made on the device (models/deepseek_v4/synthetic.build_gguf_experts), run through the
engine's Runtime (chunked prefill, decode graphs). Reports the build time, weight and peak memory,
prefill of an 8k prompt and its time to first token, decode after 1k and 8k tokens, beside the
floors: the copy bandwidth over the bytes a decode token reads, the bf16 matrix rate over a prompt
token's multiply-adds.

    python3 bench/flash_one_gpu.py [--experts Q2_K,Q2_K,Q3_K] [--layers 43] [--chunk 4096] [--new 64]
    python3 bench/flash_one_gpu.py --model FILE.gguf      # the file bench/flash_gguf.py writes
    .venv/bin/python bench/flash_one_gpu.py --tiny --device cpu    # the script itself, small and quick

`--layers N` keeps Flash's per-layer shapes with fewer layers: a peer whose file must fit a smaller
disk is compared per layer. Writes bench/results/flash_one_gpu_<time>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.formats import GGUF_TYPES
from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.quant import gguf_tiles
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models import packed
from ds4desk.engine.models.deepseek_v4 import moe
from ds4desk.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from ds4desk.engine.models.deepseek_v4.synthetic import FLASH_CONFIG, build_gguf_experts, flash_config
from ds4desk.engine.models.packed import PackedLinear
from ds4desk.engine.runtime import Runtime

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_two_gpus import decode_bytes, profile  # a sibling script

RESULTS = Path(__file__).resolve().parent / "results"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A small model of the same kinds of layers, for --tiny.
TINY = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "layer_types": [SLIDING, CSA, HCA],
    "mlp_layer_types": [HASH_MOE, MOE, MOE],
    "sliding_window": 8,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 8,
}


def geometry(layers: int, tiny: bool) -> dict[str, Any]:
    """Flash's config (transformers' keys), or --tiny's, cut to its first `layers` layers."""
    hf = {**FLASH_CONFIG, **(TINY if tiny else {})}
    return hf | {
        "num_hidden_layers": layers,
        "layer_types": hf["layer_types"][:layers],
        "mlp_layer_types": hf["mlp_layer_types"][:layers],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes per second of a device-to-device copy of `size` bytes (read + write counted)."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    return 2 * 5 * size / (time.perf_counter() - start)


def matrix_rate(device: torch.device, size: int) -> float:
    """bf16 multiply-adds x 2 per second of a square matmul."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    a @ a
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    sync(device)
    return 10 * 2 * size**3 / (time.perf_counter() - start)


def prompt_flops_per_token(model) -> float:  # type: ignore[no-untyped-def]
    """2 x the multiply-adds of the weights one token uses (the k picked experts of each layer's
    routed ones; attention scores left out), from the logical shapes, whatever the storage."""
    cfg = model.config
    # A GGUF's linears held in their blocks: rows x columns, not their bytes.
    blocks = {
        f"{name}.weight": module.out_features * module.in_features
        for name, module in model.named_modules()
        if isinstance(module, PackedLinear)
    }
    total = 0
    for name, param in model.named_parameters():
        if name.endswith(("weight_scale_inv", "tid2eid")) or "embed_tokens" in name or param.dim() < 2:
            continue
        if ".experts." in name:
            rows = param.shape[1]
            cols = cfg.hidden_size if name.endswith(("gate_proj", "up_proj")) else cfg.expert_size
            total += rows * cols * cfg.experts_per_token
        else:
            total += blocks.get(name, param.numel())
    return 2.0 * total


def run(runtime: Runtime, prompt: list[int], new: int) -> dict[str, float]:
    outcome = runtime.generate(prompt, SamplingParams(), new, set(), lambda _t: None, lambda: False)
    stats = outcome.stats
    return {
        "prompt": len(prompt),
        "prefill_tok_s": stats.prefill_tok_s,
        "ttft_ms": stats.time_to_first_token_s * 1000,
        "decode_tok_s": stats.decode_tok_s,
        "generated": stats.generated_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="Q2_K,Q2_K,Q3_K", help="GGML types of gate, up and down")
    parser.add_argument("--layers", type=int, default=FLASH_CONFIG["num_hidden_layers"])
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk")
    parser.add_argument("--new", type=int, default=64, help="tokens decoded after each prompt")
    parser.add_argument("--prompts", default="1024,8192")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same layer kinds")
    parser.add_argument("--model", type=Path, help="instead: load this GGUF (bench/flash_gguf.py writes one)")
    parser.add_argument("--profile", action="store_true", help="then where time goes (4k prefill, decode)")
    parser.add_argument(
        "--profile-deep",
        action="store_true",
        help="with --profile: also an eager decode step after the last prompt against one at position 8",
    )
    parser.add_argument(
        "--file-blocks",
        action="store_true",
        help="keep a GGUF's Q8_0 linears in the file's blocks (packed.DEVICE_ROWS off), to compare",
    )
    parser.add_argument("--experts-tiles", type=Path, help="bench/gguf_experts_gemv.py's result: its tiles")
    parser.add_argument("--grouped-share", type=float, help="moe.GROUPED_MIN_SHARE for this run")
    parser.add_argument(
        "--off", action="append", default=[], help="a kernel switch (launch.switches()) off for the run"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with launch.force(dict.fromkeys(args.off, False)):
        bench(args)


def bench(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    packed.DEVICE_ROWS = not args.file_blocks
    if args.grouped_share is not None:
        moe.GROUPED_MIN_SHARE = args.grouped_share
    if args.experts_tiles is not None:
        swept = json.loads(args.experts_tiles.read_text())
        gguf_tiles.EXPERTS_TILES.update({name: tuple(setting) for name, setting in swept["tiles"].items()})
        one_row = swept.get("one_row_tiles", {})
        gguf_tiles.EXPERTS_ONE_ROW.update({name: tuple(setting) for name, setting in one_row.items()})
    types = dict(zip(PROJECTIONS, args.experts.split(","), strict=True))
    lengths = [int(n) for n in args.prompts.split(",")]
    layers = TINY["num_hidden_layers"] if args.tiny else args.layers
    config = flash_config(**geometry(layers, args.tiny))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    started = time.perf_counter()
    if args.model is not None:  # the file (bench/flash_gguf.py) a peer runs too
        model = load_model(read_source(args.model), device, dtype).model
        config = model.config
        layers = config.num_layers
        names = {kind.type_id: kind.name for kind in GGUF_TYPES.values()}
        types = {p: names.get(t, "float") for p, t in model.model.layers[-1].mlp.experts.type_ids.items()}
    else:
        model = build_gguf_experts(config, device, types, dtype=dtype)
    sync(device)
    build_s = time.perf_counter() - started
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = decode_bytes(model)
    probe = 1 << (32 if device.type == "cuda" else 26)
    bandwidth = copy_bandwidth(device, probe)
    rate = matrix_rate(device, 8192 if device.type == "cuda" else 512)
    flops = prompt_flops_per_token(model)
    result: dict[str, object] = {
        "date": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "model": str(args.model) if args.model else "made on the device",
        "grouped_min_share": moe.GROUPED_MIN_SHARE,
        "device_rows": packed.DEVICE_ROWS,
        "switches_off": args.off,
        "experts_tiles": {name: list(setting) for name, setting in gguf_tiles.EXPERTS_TILES.items()},
        "experts_one_row": {name: list(setting) for name, setting in gguf_tiles.EXPERTS_ONE_ROW.items()},
        "layers": layers,
        "experts": types,
        "build_s": build_s,
        "weight_gib": weight_bytes / 2**30,
        "copy_gb_s": bandwidth / 1e9,
        "bf16_tflop_s": rate / 1e12,
        "decode_bytes_per_token": per_token,
        "decode_floor_tok_s": bandwidth / per_token,
        "prefill_flops_per_token": flops,
        "prefill_floor_tok_s": rate / flops,
    }
    print(json.dumps(result, indent=1), flush=True)

    gen = torch.Generator().manual_seed(1)
    runs = []
    runtime = Runtime(
        model, device, context=max(lengths) + args.new + 8, chunk=args.chunk, graphs=device.type == "cuda"
    )
    try:
        warm_up = torch.randint(0, config.vocab_size, (min(64, *lengths),), generator=gen).tolist()
        run(runtime, warm_up, 8)
        for length in lengths:
            prompt = torch.randint(0, config.vocab_size, (length,), generator=gen).tolist()
            for _ in range(2):  # the second is reported: the first compiles this length's shapes
                measured = run(runtime, prompt, args.new)
            if device.type == "cuda":
                measured["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            runs.append(measured)
            print(json.dumps(measured), flush=True)
    finally:
        runtime.close()
    result["runs"] = runs
    out = args.out or RESULTS / f"flash_one_gpu_{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if args.profile:
        profile(model, prompt, (args.device,), deep=len(prompt) - 1 if args.profile_deep else 0)


if __name__ == "__main__":
    main()
