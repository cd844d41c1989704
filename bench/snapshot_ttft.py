"""Time to first token of a follow-up turn, with and without the snapshot of the turn before.

    .venv/bin/python bench/snapshot_ttft.py [--model PATH | --synthetic dense|v4|qwen35|dense-small|v4-tiny]
        [--device cpu] [--dtype bfloat16] [--tokens 2000] [--repeats 3] [--token-prompt]
        [--variants host,resident,graphed,now] [--work DIR]

A conversation of about --tokens prompt tokens gets an answer (saved as a snapshot, as the window
does); then the follow-up question runs once restoring that snapshot and once cold (snapshots off),
alternating, and the medians are compared. Writes JSON under bench/results/.

`--synthetic` writes bench/first_answer.py's synthetic model once under --work (token prompts).
`--variants` (on a GPU) measures the same turn with the runtime's two follow-up paths switched:
`host` restores from the pinned host copy and prefills the suffix eagerly (neither path),
`resident` restores from the copy kept on the device, `graphed` runs the suffix on the captured
verify graphs, `now` both (the default). Each variant also reports, from one more follow-up timed
with the device drained between them, the restore (`restore_s`) and the suffix's forward (`suffix_s`).

The follow-ups above come after a cold turn, so each restores the snapshot by copy (a user coming
back to a conversation after another one). `now` also times the follow-up straight after the answer
(the first turn run again before each), which continues from the model's state in place
(`ttft_in_place_s`, `in_place_ratio` against the same cold turns). `--profile DIR` (CUDA) writes
torch's profiler table of one follow-up of each kind to DIR.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from ds4desk.engine import Engine, GenerateRequest, GenerateStats, LoadRequest, SaveSnapshot
from ds4desk.engine import runtime as runtime_module
from ds4desk.engine.runtime import Runtime

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, the "
    "state of the lamp and the small repairs of the day. "
)
VARIANTS = {  # name: (keep a copy on the device, graphed suffix)
    "host": (False, False),
    "resident": (True, False),
    "graphed": (False, True),
    "now": (True, True),
}


@contextmanager
def variant(runtime: Runtime, name: str) -> Iterator[None]:
    """The runtime with its follow-up paths as `name` says, restored afterwards."""
    resident, graphed = VARIANTS[name]
    saved = runtime.resident_snapshot_bytes, runtime_module.GRAPHED_SUFFIX_TOKENS
    runtime.resident_snapshot_bytes = saved[0] if resident else 0
    runtime_module.GRAPHED_SUFFIX_TOKENS = saved[1] if graphed else 0
    try:
        yield
    finally:
        runtime.resident_snapshot_bytes, runtime_module.GRAPHED_SUFFIX_TOKENS = saved


@contextmanager
def phases(runtime: Runtime, into: dict[str, float]) -> Iterator[None]:
    """Time the runtime's restore and prefill calls, the device drained before and after each."""

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            into[name] = into.get(name, 0.0) + time.perf_counter() - start
            return out

        return wrapper

    def sync() -> None:
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)

    runtime._restore = timed("restore_s", runtime._restore)  # type: ignore[method-assign]
    runtime._prefill = timed("suffix_s", runtime._prefill)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del runtime._restore, runtime._prefill  # back to the class's methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2")
    parser.add_argument("--synthetic", choices=("dense", "v4", "qwen35", "dense-small", "v4-tiny"))
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ds4desk-bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="now", help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument(
        "--profile", type=Path, help="write a profiler table of one follow-up of each kind here"
    )
    parser.add_argument(
        "--token-prompt",
        action="store_true",
        help="a conversation of token ids (models without a real tokenizer)",
    )
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := set(names) - VARIANTS.keys():
        parser.error(f"unknown variants {sorted(unknown)}")
    model = args.model
    if args.synthetic:
        sys.path.insert(0, str(BENCH))
        from first_answer import synthetic_folder

        model = str(synthetic_folder(args.synthetic, args.work))
        args.token_prompt = True

    engine = Engine()
    rows = []
    try:
        loaded = engine.load(LoadRequest(model, args.device, args.dtype, context=args.tokens + 512))
        assert loaded.ok and loaded.info, loaded.error
        runtime = engine._loaded.runtime  # type: ignore[union-attr]  # a bench may reach inside
        for name in names:
            with variant(runtime, name):
                rows.append({"variant": name, **measure(engine, runtime, args, name == "now")})
    finally:
        engine.close()

    for row in rows:
        print(json.dumps(row))
    record = {
        "model": loaded.info.name,
        "device": loaded.info.device,
        "dtype": loaded.info.dtype,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"snapshot_ttft_{stamp}.json"
    meta = {"date": stamp, "machine": platform.platform(), "torch": torch.__version__}
    out.write_text(json.dumps({**meta, "command": " ".join(sys.argv), **record}, indent=2))
    print(f"wrote {out}")


def measure(engine: Engine, runtime: Runtime, args: argparse.Namespace, in_place: bool) -> dict[str, Any]:
    """The first turn (its snapshot saved after the answer), then the follow-up warm and cold; with
    `in_place` also the follow-up straight after the first turn, run again before each."""
    if args.token_prompt:
        vocab = runtime.model.vocab_size
        ids = [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(args.tokens)]
        opening: dict[str, object] = {"prompt_tokens": ids, "stop_tokens": []}
    else:
        chat = [{"role": "user", "content": TEXT * (args.tokens // 33) + "Summarise the log in one line."}]
        opening = {"messages": chat}

    slot: list[int] = []

    def first_turn() -> Any:
        # Again into the first one's slot: the store holds one snapshot whichever follow-up runs.
        save = SaveSnapshot(slot=slot[0] if slot else None)
        result = engine.generate(GenerateRequest(**opening, max_new_tokens=32, save_snapshot=save))  # type: ignore[arg-type]
        assert result.ok, result.error
        slot[:] = [result.snapshot_slot]
        # A person reads the answer before asking again: by then the copies the answer's snapshot
        # queued (its device copy, from the pinned host one) are done.
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        return result

    first = first_turn()
    if args.token_prompt:
        follow: dict[str, object] = {"prompt_tokens": [*ids, *first.tokens, *range(500, 514)]}
    else:
        answer = {"role": "assistant", "content": first.text}
        follow = {"messages": [*chat, answer, {"role": "user", "content": "Which ships?"}]}

    def turn(use: bool) -> GenerateStats:
        result = engine.generate(GenerateRequest(**follow, max_new_tokens=1, use_snapshots=use))  # type: ignore[arg-type]
        assert result.ok, result.error
        return result.stats

    warm, cold = [], []
    for _ in range(args.repeats):  # cold first: each warm turn then restores (none is in place)
        cold.append(turn(False))
        warm.append(turn(True))
    split: dict[str, float] = {}
    with phases(runtime, split):
        turn(True)
    warm_ttft = statistics.median(s.time_to_first_token_s for s in warm)
    cold_ttft = statistics.median(s.time_to_first_token_s for s in cold)
    row = {
        "prompt_tokens": warm[0].prompt_tokens,
        "reused_tokens": warm[0].reused_tokens,
        "prefill_tokens_with_snapshot": warm[0].prefill_tokens,
        "ttft_with_snapshot_s": warm_ttft,
        "ttft_cold_s": cold_ttft,
        "ratio": warm_ttft / cold_ttft,
        **split,
    }
    if not in_place:
        return row
    placed = []
    for _ in range(args.repeats):
        first_turn()
        placed.append(turn(True))
        assert placed[-1].reused_tokens == warm[0].reused_tokens
    first_turn()
    in_place_split: dict[str, float] = {}
    with phases(runtime, in_place_split):
        turn(True)
    row["ttft_in_place_s"] = statistics.median(s.time_to_first_token_s for s in placed)
    row["in_place_ratio"] = row["ttft_in_place_s"] / cold_ttft
    row |= {f"in_place_{name}": value for name, value in in_place_split.items()}
    if args.profile and runtime.device.type == "cuda":
        profile_follow_ups(args.profile, first_turn, turn)
    return row


def profile_follow_ups(folder: Path, first_turn: Callable[[], Any], turn: Callable[[bool], Any]) -> None:
    """torch's profiler table (by CUDA time) of a follow-up in place and of one that restores."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    for kind in ("in_place", "restored"):
        first_turn()
        if kind == "restored":
            turn(False)  # a cold turn between: the follow-up restores by copy
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            turn(True)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
        (folder / f"snapshot_follow_up_{kind}_{stamp}.txt").write_text(table)


if __name__ == "__main__":
    main()
