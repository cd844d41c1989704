"""Time to first token of a follow-up turn, with and without the snapshot of the turn before.

    .venv/bin/python bench/snapshot_ttft.py [--model PATH] [--device cpu] [--tokens 2000] [--repeats 3]

A conversation of about --tokens prompt tokens gets an answer (saved as a snapshot, as the window
does); then the follow-up question runs once restoring that snapshot and once cold (snapshots off),
alternating, and the medians are compared. Writes JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import UTC, datetime
from pathlib import Path

import torch

from ds4desk.engine import Engine, GenerateRequest, LoadRequest, SaveSnapshot

RESULTS = Path(__file__).resolve().parent / "results"
TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, the "
    "state of the lamp and the small repairs of the day. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--token-prompt",
        action="store_true",
        help="a conversation of token ids (models without a real tokenizer)",
    )
    args = parser.parse_args()

    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(args.model, args.device, args.dtype, context=args.tokens + 512))
        assert loaded.ok and loaded.info, loaded.error
        if args.token_prompt:
            vocab = 49152 if args.model is None else 120000
            ids = [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(args.tokens)]
            first = engine.generate(
                GenerateRequest(
                    prompt_tokens=ids, max_new_tokens=32, stop_tokens=[], save_snapshot=SaveSnapshot()
                )
            )
            assert first.ok, first.error
            follow: dict[str, object] = {"prompt_tokens": [*ids, *first.tokens, *range(500, 514)]}
        else:
            chat = [
                {"role": "user", "content": TEXT * (args.tokens // 33) + "Summarise the log in one line."}
            ]
            first = engine.generate(
                GenerateRequest(messages=chat, max_new_tokens=32, save_snapshot=SaveSnapshot())
            )
            assert first.ok, first.error
            chat += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "Which ships?"},
            ]
            follow = {"messages": chat}
        warm, cold = [], []
        for _ in range(args.repeats):
            for use, into in ((True, warm), (False, cold)):
                result = engine.generate(GenerateRequest(**follow, max_new_tokens=1, use_snapshots=use))  # type: ignore[arg-type]
                assert result.ok, result.error
                into.append(result.stats)
    finally:
        engine.close()

    warm_ttft = statistics.median(s.time_to_first_token_s for s in warm)
    cold_ttft = statistics.median(s.time_to_first_token_s for s in cold)
    row = {
        "model": loaded.info.name,
        "device": loaded.info.device,
        "dtype": loaded.info.dtype,
        "prompt_tokens": warm[0].prompt_tokens,
        "reused_tokens": warm[0].reused_tokens,
        "prefill_tokens_with_snapshot": warm[0].prefill_tokens,
        "ttft_with_snapshot_s": warm_ttft,
        "ttft_cold_s": cold_ttft,
        "ratio": warm_ttft / cold_ttft,
    }
    print(json.dumps(row, indent=2))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"snapshot_ttft_{stamp}.json"
    out.write_text(
        json.dumps(
            {"date": stamp, "machine": platform.platform(), "torch": torch.__version__, **row}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
