"""Speculative decoding on a GPU: what a verify step of k drafted tokens costs against one plain
decode step, the tokens/s that gives at a chosen acceptance, and greedy identity in bf16.

    python3 bench/speculative_gpu.py [--vocab DIR] [--work DIR] [--out bench/results] [--v4]

`--vocab`: the tokenizer folder `bench/gpu_speed.py prepare` writes (without it, only `--v4` runs).

On the dense 1.07B model of bench/gpu_speed.py (random bf16 weights, written here). A plain step
replays the captured CUDA graph (as `ds4desk generate` decodes); a verify step of k + 1 tokens
replays its own captured graph (graphs.GraphedDecode.verify, as speculative/decode.py runs it), and
is also timed as the eager forward it replaces. All are timed at position 512 with CUDA events, the
median of 50 after a warm-up. From plain and graphed verify: tokens/s at an acceptance a, k drafts
a step = (1 + a·k) / verify(k), against 1 / plain.

`--v4` first times the same steps on bench/gpu_deepseek_v4.py's synthetic DeepSeek-V4.

Then four answers of 256 tokens to a prompt that repeats itself: speculation off, prompt lookup,
the model as its own draft (every draft accepted: the ceiling) and a small draft of the same vocab
(2 layers of the same shapes, other random weights: few drafts agree, so its figure is the
mechanism's overhead, not its gain), with their tokens compared; a difference is counted with the
target's top-2 logit margin where it happened (bf16 near-ties).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_speed import random_dense_state, write_hf

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn, repeats: int = 50) -> float:
    """Median seconds of fn() by CUDA events, after a warm-up."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def step_costs(folder: Path) -> dict:
    """A plain graphed step, and for k = 1..8 the graphed verify of k + 1 tokens and the eager forward
    it replaces, each call from the same cache length."""
    from ds4desk.engine.loader import load_model
    from ds4desk.engine.loading.detect import read_source
    from ds4desk.engine.runtime import Runtime

    device = torch.device("cuda")
    loaded = load_model(read_source(folder), device, torch.bfloat16)
    runtime = Runtime(loaded.model, device, context=1024, chunk=512, graphs=True)
    model = runtime.model
    ids = torch.randint(100, 40000, (600,), device=device)
    with torch.inference_mode():
        model.forward(ids[:512], 0, "none")
        token = ids[512:513]
        plain = timed(lambda: runtime._decode(token, 512))
        graphs = runtime.graphs
        assert graphs is not None
        verify, eager = {}, {}
        for k in range(1, 9):
            block = ids[512 : 512 + k + 1]

            def forward(block: torch.Tensor = block) -> None:
                model.set_length(512)  # a family that tracks its length on the host starts over
                model.forward(block, 512, "all")

            eager[k] = timed(forward)
            verify[k] = timed(lambda block=block: graphs.verify(block, 512))
        assert len(graphs._verify_graphs) == 8, "a verify step ran eagerly"
    runtime.close()
    return {"plain_s": plain, "verify_s": verify, "verify_eager_s": eager}


def report(name: str, costs: dict) -> dict:
    """Print step_costs' figures; returns tokens/s at acceptance 0.6, 0.8 and 1.0 per k."""
    plain = costs["plain_s"]
    print(f"{name}: plain graphed step {plain * 1e6:.1f} us ({1 / plain:.1f} tok/s)")
    rates = {}
    for k, seconds in costs["verify_s"].items():
        rates[k] = {a: (1 + a * k) / seconds for a in (0.6, 0.8, 1.0)}
        print(
            f"verify k={k}: {seconds * 1e6:8.1f} us = {seconds / plain:5.2f}x a plain step "
            f"(eager {costs['verify_eager_s'][k] * 1e6:8.1f} us); tok/s at "
            + ", ".join(f"a={a}: {r:7.1f} ({r * plain:4.2f}x)" for a, r in rates[k].items())
        )
    return rates


SMALL_DRAFT_LAYERS = 2


def answers(folder: Path, small_draft: Path) -> dict:
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    pattern = [(i * 7919 + 17) % 40000 + 100 for i in range(48)]
    prompt = pattern * 6  # a prompt that repeats itself: lookup finds its n-grams
    out = {}
    runs = (("off", "off", None), ("lookup", "lookup", None), ("draft", "draft", folder))
    for name, mode, draft in (*runs, ("small draft", "draft", small_draft)):
        engine = Engine()
        try:
            load = LoadRequest(
                path=str(folder), device="cuda", dtype="bfloat16", context=1024, draft=draft and str(draft)
            )
            loaded = engine.load(load)
            assert loaded.ok, loaded.error
            request = GenerateRequest(
                prompt_tokens=prompt, max_new_tokens=256, stop_tokens=[], speculative=mode
            )
            engine.generate(request)  # warm-up: graphs, kernels
            result = engine.generate(
                GenerateRequest(prompt_tokens=prompt, max_new_tokens=256, stop_tokens=[], speculative=mode)
            )
            assert result.ok, result.error
            stats = result.stats
            out[name] = {
                "tokens": result.tokens,
                "decode_tok_s": stats.decode_tok_s,
                "drafted": stats.drafted_tokens,
                "accepted": stats.accepted_tokens,
                "speculative": stats.speculative,
            }
            if name == "off":
                loaded = engine._loaded
                assert loaded is not None
                margins = []
                seq = [*prompt, *result.tokens]
                with torch.inference_mode():
                    logits = loaded.runtime.model.forward(
                        torch.tensor(seq, device="cuda")[: len(prompt) + 255], 0, "all"
                    )
                    top2 = logits[len(prompt) - 1 :].float().topk(2, dim=-1).values
                    margins = (top2[:, 0] - top2[:, 1]).tolist()
                out["off"]["margins"] = margins
        finally:
            engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--v4", action="store_true", help="also the step costs of bench/gpu_deepseek_v4.py's synthetic V4"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp())
    v4_costs = None
    if args.v4:
        from bench import gpu_deepseek_v4

        v4_folder = work / "v4"
        if not (v4_folder / "config.json").exists():
            gpu_deepseek_v4.write_model(v4_folder)
        v4_costs = step_costs(v4_folder)
        v4_costs["rates"] = report("V4 synthetic", v4_costs)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"speculative_gpu_{stamp}.json"
    meta = {"date": stamp, "device": torch.cuda.get_device_name(), "model": "dense 1.07B random bf16"}
    if args.vocab is None:
        path.write_text(json.dumps({**meta, "model": None, "deepseek_v4": v4_costs}))
        print(f"wrote {path}")
        return
    folder = work / "dense"
    if not (folder / "config.json").exists():
        write_hf(folder, random_dense_state(), args.vocab)
    small_draft = work / "dense_draft"
    if not (small_draft / "config.json").exists():
        write_hf(small_draft, random_dense_state(1, SMALL_DRAFT_LAYERS), args.vocab, SMALL_DRAFT_LAYERS)
    costs = step_costs(folder)
    rates = report("dense 1.07B", costs)
    runs = answers(folder, small_draft)
    base = runs["off"]["tokens"]
    margins = runs["off"]["margins"]
    for mode, run in runs.items():
        first = next((i for i, (a, b) in enumerate(zip(base, run["tokens"], strict=True)) if a != b), None)
        run["first_difference"] = first
        run["margin_there"] = margins[first] if first is not None else None
        rate = run["accepted"] / run["drafted"] if run["drafted"] else 0.0
        print(
            f"{mode:11} ({run['speculative']}): {run['decode_tok_s']:8.1f} tok/s, accepted {run['accepted']}"
            f" of {run['drafted']} ({rate:.2f}), first difference from off: {first}"
            + (f" (top-2 margin there {margins[first]:.3f})" if first is not None else "")
        )
    for run in runs.values():
        run.pop("margins", None)
    path.write_text(json.dumps({**meta, **costs, "rates": rates, "runs": runs, "deepseek_v4": v4_costs}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
