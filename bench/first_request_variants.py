"""What a first request pays after a load, by what runs between the load and it.

    python3 bench/first_request_variants.py VARIANT [--synthetic qwen35] [--work DIR] [--tokens 3000]

One process, one variant: load the synthetic model of bench/first_answer.py on CUDA with the load's
warm-up, then (VARIANT) nothing (`base`), a full garbage collection (`gc`), a 16-token request
(`tiny`), two seconds idle (`sleep`) or a 1,000-token request (`short`), then the same --tokens
prompt twice. Prints one JSON line: each request's time to first token and the prefill's host time
(GenerateStats.prefill_s: launches run ahead of the GPU, so host stalls show there), in ms.
docs/BENCHMARKS.md, "Qwen3.5's first answer", ran each variant in a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from first_answer import SYNTHETIC, prompt_ids, synthetic_folder, vocab_of

VARIANTS = ("base", "gc", "tiny", "sleep", "short")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--synthetic", choices=SYNTHETIC, default="qwen35")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ds4desk-first-answer"))
    parser.add_argument("--tokens", type=int, default=3000)
    args = parser.parse_args()
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    model = str(synthetic_folder(args.synthetic, args.work))
    vocab = vocab_of(model)
    ids = prompt_ids(args.tokens, vocab)
    engine = Engine()
    try:
        request = LoadRequest(path=model, device="cuda", dtype="bfloat16", context=args.tokens + 200)
        loaded = engine.load(request)
        if not loaded.ok:
            raise SystemExit(f"load failed: {loaded.error}")

        def ask(prompt: list[int], new: int = 16) -> tuple[float, float]:
            result = engine.generate(
                GenerateRequest(prompt_tokens=prompt, max_new_tokens=new, stop_tokens=[], use_snapshots=False)
            )
            if not result.ok:
                raise SystemExit(f"generate failed: {result.error}")
            return round(result.stats.time_to_first_token_s * 1e3, 2), round(result.stats.prefill_s * 1e3, 2)

        out: dict[str, object] = {"variant": args.variant, "tokens": args.tokens}
        if args.variant == "gc":
            gc.collect()
        elif args.variant == "tiny":
            out["tiny"] = ask(ids[:16], 1)
        elif args.variant == "sleep":
            time.sleep(2)
        elif args.variant == "short":
            out["short"] = ask(ids[:1000], 1)
        out["first"] = ask(ids)
        out["second"] = ask(ids)
    finally:
        engine.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
