"""DeepSeek-V4 baseline on one GPU: ds4desk against transformers' DeepseekV4ForCausalLM, same weights.

    python3 bench/gpu_deepseek_v4.py [--prompts 1024 4096] [--new-tokens 64] [--repeats 3] [--out DIR]

A synthetic config with DeepSeek-V4-Flash's per-layer shapes (hidden 4096, 64 heads of 512, 8
experts with 6 active, layers sliding / CSA / HCA / CSA, the first hash-routed, bf16) gets random
weights, written once as a Hugging Face folder; both engines load that folder. Prefill is the
prompt's forward, decode the following tokens, medians after a warm-up. This is the eager baseline
that the GPU speed work improves.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds4desk.engine import Engine, GenerateRequest, LoadRequest
from ds4desk.engine.make_tiny import TINY_CONFIG, random_state, write_tokenizer

FLASH_SHAPES = {
    **TINY_CONFIG,
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "partial_rotary_factor": 64 / 512,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 8,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "max_position_embeddings": 65536,
}


# Kept in float32 as the official checkpoints keep them (both engines compute them in float32).
FLOAT32_PARTS = ("_hc.", "hc_head", "sinks", "position_bias")


def keeps_float32(name: str) -> bool:
    return any(part in name for part in FLOAT32_PARTS)


def write_model(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    state = random_state(FLASH_SHAPES, seed=0)
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() and not keeps_float32(k) else v
        for k, v in state.items()
    }
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), {"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps({**FLASH_SHAPES, "torch_dtype": "bfloat16"}))
    write_tokenizer(folder, FLASH_SHAPES["vocab_size"])
    return sum(v.numel() for v in state.values())


def prompt(count: int) -> list[int]:
    return [(i * 7919 + 13) % 120000 + 100 for i in range(count)]


def bench_ds4desk(
    folder: Path, cache: Path, count: int, new: int, repeats: int, graphs: bool = True, chunk: int = 0
) -> tuple[float, float]:
    """(prefill, decode) tok/s through the Engine, at the automatic chunk unless one is given."""
    engine = Engine()
    try:
        request = LoadRequest(
            str(folder),
            "cuda",
            "bfloat16",
            context=count + new + 8,
            chunk=chunk,
            cuda_graphs=graphs,
            speculative="off",  # a token a step, as the peers decode
        )
        loaded = engine.load(request)
        assert loaded.ok, loaded.error
        runs = []
        for _ in range(repeats + 1):
            result = engine.generate(
                GenerateRequest(prompt_tokens=prompt(count), max_new_tokens=new, stop_tokens=[])
            )
            assert result.ok, result.error
            runs.append((result.stats.prefill_tok_s, result.stats.decode_tok_s))
    finally:
        engine.close()
    runs = runs[1:]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bench_transformers(folder: Path, count: int, new: int, repeats: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        if keeps_float32(name):
            param.data = param.data.float()
    model = model.to("cuda").eval()
    ids = torch.tensor([prompt(count)], device="cuda")
    runs = []
    for _ in range(repeats + 1):
        # Autocast: transformers 5.17 keeps V4's norms in float32 and then feeds their float32 output
        # to bf16 projections, which fails without it.
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids)
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            total_s = time.perf_counter() - start
        assert out.shape[1] == count + new
        runs.append((count / prefill_s, (new - 1) / max(total_s - prefill_s, 1e-9)))
    del model
    torch.cuda.empty_cache()
    runs = runs[1:]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ds4v4-"))
    parameters = write_model(work / "model")
    rows = []
    for count in args.prompts:
        for name, run in (
            (
                "ds4desk",
                lambda c=count: bench_ds4desk(
                    work / "model", work / "cache", c, args.new_tokens, args.repeats
                ),
            ),
            (
                "transformers",
                lambda c=count: bench_transformers(work / "model", c, args.new_tokens, args.repeats),
            ),
        ):
            try:
                prefill, decode = run()
            except Exception as exc:  # one engine failing must not lose the other's numbers
                print(f"{name} at {count}: {type(exc).__name__}: {exc}")
                prefill = decode = float("nan")
            rows.append(
                {"engine": name, "prompt_tokens": count, "prefill_tok_s": prefill, "decode_tok_s": decode}
            )
            print(json.dumps(rows[-1]), flush=True)

    print(
        f"\nDeepSeek-V4 Flash-shaped, 4 layers, {parameters / 1e9:.2f}B parameters, bf16, "
        f"{torch.cuda.get_device_name()}; ratios against transformers"
    )
    print(f"{'engine':13} {'prompt':>6} {'prefill tok/s':>14} {'x':>6} {'decode tok/s':>13} {'x':>6}")
    for row in rows:
        base = next(
            r for r in rows if r["engine"] == "transformers" and r["prompt_tokens"] == row["prompt_tokens"]
        )
        print(
            f"{row['engine']:13} {row['prompt_tokens']:6} {row['prefill_tok_s']:14.1f} "
            f"{row['prefill_tok_s'] / base['prefill_tok_s']:6.2f} {row['decode_tok_s']:13.1f} "
            f"{row['decode_tok_s'] / base['decode_tok_s']:6.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (args.out / f"gpu_deepseek_v4_{stamp}.json").write_text(
        json.dumps(
            {
                "date": stamp,
                "machine": platform.platform(),
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "parameters": parameters,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
