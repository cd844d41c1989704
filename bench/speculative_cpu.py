"""Speculative decoding on the CPU: decode speed with and without it, on prompts that quote their
input back, and whether the tokens stay the same.

    .venv/bin/python bench/speculative_cpu.py [--model PATH] [--modes off,lookup] [--max-tokens 192]
        [--prompts bench/prompts/quote_back.json] [--repeats 2] [--rounds 1]
    .venv/bin/python bench/speculative_cpu.py --verify-cost

`--verify-cost`: what one forward of T = 1, 2, 4, 8, 12, 16 tokens (a verify step) costs at
position 200, on the one-call C layer and on the torch steps (best of 12, in this process), then
exits.

The embedded SmolLM2-135M Q4_1 by default, greedy, every prompt of the set through its chat
template. Each mode runs in its own fresh process (two engines' thread pools in one process slow
each other down on two cores); a mode's figure is its generated tokens over its decode seconds,
summed over the prompts, the median of `--repeats` passes after one warm-up pass. Every mode's
tokens are compared with the first mode's, prompt by prompt. Prints a table and writes JSON under
bench/results/.

`--rounds N` runs the modes' processes N times in turn (off, lookup, off, lookup, ...) and reports
each round's ratio and their median as well: on a machine other programs load, a round's two modes
ran minutes apart at most, so a load that comes and goes moves both. `--threads 1` runs the
modes' engines on one thread: then tok/CPU-s (generated tokens over the engine's CPU seconds from
the first token to the last) counts the work, not the time other programs held the core, and is
the steadier figure on a busy machine (with two threads it also counts threads spinning at the
phases' barriers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def run_mode(model: str, mode: str, prompts: list[dict], max_tokens: int, repeats: int) -> dict:
    """In this process: every prompt `repeats` + 1 times; the tokens and per-pass totals."""
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(path=model, device="cpu", context=4096, speculative=mode))
        assert loaded.ok, loaded.error
        passes = []
        tokens: dict[str, list[int]] = {}
        for _ in range(repeats + 1):
            generated = decode_s = decode_cpu_s = drafted = accepted = 0
            for prompt in prompts:
                first: list[float] = []

                def on_token(_token: int, first: list[float] = first) -> None:
                    if not first:  # the prefill's token: decode starts here
                        first.append(time.process_time())

                result = engine.generate(
                    GenerateRequest(
                        messages=prompt["messages"],
                        max_new_tokens=max_tokens,
                        use_snapshots=False,
                        speculative=mode,
                        on_token=on_token,
                    )
                )
                decode_cpu_s += time.process_time() - first[0] if first else 0.0
                assert result.ok, result.error
                tokens[prompt["name"]] = list(result.tokens)
                generated += max(len(result.tokens) - 1, 0)  # the first token comes from the prefill
                decode_s += result.stats.decode_s
                drafted += result.stats.drafted_tokens
                accepted += result.stats.accepted_tokens
            passes.append(
                {
                    "generated": generated,
                    "decode_s": decode_s,
                    "decode_cpu_s": decode_cpu_s,
                    "drafted": drafted,
                    "accepted": accepted,
                }
            )
        timed = passes[1:]  # the first pass warms the allocator, caches and thread pool
        return {
            "mode": mode,
            "decode_tok_s": statistics.median(p["generated"] / p["decode_s"] for p in timed),
            "decode_tok_cpu_s": statistics.median(p["generated"] / p["decode_cpu_s"] for p in timed),
            "passes": timed,
            "tokens": tokens,
        }
    finally:
        engine.close()


def verify_cost(model: str) -> None:
    import torch

    from ds4desk.engine.loader import load_model
    from ds4desk.engine.loading.detect import read_source
    from ds4desk.engine.models import cpu_decode

    loaded = load_model(read_source(Path(model)), torch.device("cpu"), torch.float32).model
    loaded.allocate_cache(512)
    ids = torch.arange(100, 400) % loaded.vocab_size
    with torch.inference_mode():
        loaded.forward(ids[:200], 0, "none")
        for fused, name in ((True, "one-call C layer"), (False, "torch steps")):
            cpu_decode.enabled = fused
            costs = []
            for count in (1, 2, 4, 8, 12, 16):
                best = float("inf")
                for _ in range(12):
                    start = time.perf_counter()
                    loaded.forward(ids[200 : 200 + count], 200, "all")
                    best = min(best, time.perf_counter() - start)
                costs.append(f"T={count}: {best * 1e3:.1f} ms")
            print(f"{name:17} " + ", ".join(costs))


def in_child(
    model: str, mode: str, prompts_path: Path, max_tokens: int, repeats: int, threads: int | None
) -> dict:
    job = json.dumps(
        {
            "model": model,
            "mode": mode,
            "prompts": str(prompts_path),
            "max_tokens": max_tokens,
            "repeats": repeats,
        }
    )
    env = dict(os.environ) | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    child = subprocess.run(
        [sys.executable, __file__, "--worker", job], capture_output=True, text=True, timeout=3600, env=env
    )
    if child.returncode != 0:
        raise SystemExit(f"{mode} failed ({child.returncode}): {child.stderr[-800:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        job = json.loads(sys.argv[2])
        prompts = json.loads(Path(job["prompts"]).read_text())["prompts"]
        print(json.dumps(run_mode(job["model"], job["mode"], prompts, job["max_tokens"], job["repeats"])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model path (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--modes", default="off,lookup")
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts" / "quote_back.json")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the modes' processes")
    parser.add_argument("--verify-cost", action="store_true")
    args = parser.parse_args()

    from ds4desk.engine.loading.default_model import default_model_path

    model = args.model or str(default_model_path())
    if args.verify_cost:
        verify_cost(model)
        return
    modes = args.modes.split(",")
    rounds = [
        [in_child(model, mode, args.prompts, args.max_tokens, args.repeats, args.threads) for mode in modes]
        for _ in range(args.rounds)
    ]
    runs = rounds[0]
    base = runs[0]
    print(
        f"{'mode':10} {'decode tok/s':>12} {'x ' + base['mode']:>8} {'tok/CPU-s':>10} {'x':>6} "
        f"{'accepted':>10} {'same tokens':>12}"
    )
    for index, round_runs in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {index + 1}")
        for run in round_runs:
            same = sum(run["tokens"][name] == base["tokens"][name] for name in base["tokens"])
            drafted = sum(p["drafted"] for p in run["passes"])
            accepted = sum(p["accepted"] for p in run["passes"])
            run["same_tokens_prompts"] = same
            run["acceptance_rate"] = accepted / drafted if drafted else 0.0
            run["ratio"] = run["decode_tok_s"] / round_runs[0]["decode_tok_s"]
            run["cpu_ratio"] = run["decode_tok_cpu_s"] / round_runs[0]["decode_tok_cpu_s"]
            print(
                f"{run['mode']:10} {run['decode_tok_s']:12.1f} {run['ratio']:8.2f} "
                f"{run['decode_tok_cpu_s']:10.1f} {run['cpu_ratio']:6.2f} "
                f"{run['acceptance_rate']:10.2f} {same:>5} of {len(base['tokens'])}"
            )
    medians = {mode: statistics.median(r[i]["ratio"] for r in rounds) for i, mode in enumerate(modes)}
    cpu_medians = {mode: statistics.median(r[i]["cpu_ratio"] for r in rounds) for i, mode in enumerate(modes)}
    if len(rounds) > 1:
        print("median ratio over rounds: " + ", ".join(f"{m} {v:.2f}" for m, v in medians.items()))
        print("median CPU-time ratio:    " + ", ".join(f"{m} {v:.2f}" for m, v in cpu_medians.items()))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"speculative_cpu_{stamp}.json"
    RESULTS.mkdir(exist_ok=True)
    meta = {"date": stamp, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    meta |= {"model": model, "max_tokens": args.max_tokens, "prompts": str(args.prompts.name)}
    meta |= {"rounds": len(rounds), "median_ratio": medians, "median_cpu_ratio": cpu_medians}
    meta |= {"threads": args.threads}
    out.write_text(json.dumps({**meta, "runs": runs, "later_rounds": rounds[1:]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
