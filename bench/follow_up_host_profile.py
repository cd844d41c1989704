"""Where a follow-up turn's host time goes: Python's profiler over the runtime's `generate`.

    python3 bench/follow_up_host_profile.py KIND TOKENS [--device cuda] [--work DIR] [--rows 22]

KIND is one of bench/first_answer.py's synthetic models (dense, qwen35, v4, dense-small, v4-tiny),
loaded as the app loads it (the engine's load: graphs, warm-up). A prompt of TOKENS token ids is
answered with 32 tokens, a snapshot saved after them; the follow-up (that, the answer and 14 new
tokens, to its first token) then runs six times straight after the answer (continued in place), six
times restored after a cold turn, and three times cold, and their times to the first token are
printed. Then ten in-place follow-ups run under cProfile: the functions by own time and by
cumulative time, and what `generate` and `_restore` call. On a GPU the one wait for the device shows
as the read of the first token (`tolist`); everything else is the host's own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_answer import synthetic_folder  # a sibling script: the synthetic models

from ds4desk.engine import Engine, LoadRequest
from ds4desk.engine.api import SamplingParams, SaveSnapshot
from ds4desk.engine.runtime import RunOutcome, Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore

GREEDY = SamplingParams(temperature=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("dense", "qwen35", "v4", "dense-small", "v4-tiny"))
    parser.add_argument("tokens", type=int)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ds4desk-bench"))
    parser.add_argument("--rows", type=int, default=22)
    args = parser.parse_args()
    engine = Engine()
    try:
        dtype = "bfloat16" if args.device.startswith("cuda") else None
        loaded = engine.load(
            LoadRequest(
                str(synthetic_folder(args.kind, args.work)), args.device, dtype, context=args.tokens + 512
            )
        )
        assert loaded.ok, loaded.error
        runtime = engine._loaded.runtime  # type: ignore[union-attr]  # a bench may reach inside
        profile(runtime, args.kind, args.tokens, args.rows)
    finally:
        engine.close()


def profile(runtime: Runtime, kind: str, tokens: int, rows: int) -> None:
    vocab = runtime.model.vocab_size
    ids = [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(tokens)]
    store = SnapshotStore(ModelIdentity("follow-up-profile", "bench", runtime.context))

    def drained() -> None:
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)

    def run(prompt: list[int], new: int, **more: object) -> RunOutcome:
        out = runtime.generate(prompt, GREEDY, new, set(), lambda _t: None, lambda: False, **more)  # type: ignore[arg-type]
        drained()
        return out

    def first_turn() -> RunOutcome:
        return run(ids, 32, snapshots=store, use_snapshots=True, save=SaveSnapshot(slot=0))

    turn = [*ids, *first_turn().tokens, *range(500, 514)]

    def follow_up(use: bool = True) -> float:
        return run(turn, 1, snapshots=store, use_snapshots=use).stats.time_to_first_token_s

    def in_place() -> float:
        first_turn()
        return follow_up()

    def restored() -> float:
        follow_up(use=False)
        return follow_up()

    kinds: list[tuple[str, Callable[[], float], int]] = [
        ("in place", in_place, 6),
        ("restored", restored, 6),
        ("cold", lambda: follow_up(use=False), 3),
    ]
    for name, timed, count in kinds:
        times = " ".join(f"{1e3 * timed():.2f}" for _ in range(count))
        print(f"{kind} {tokens}: follow-up {name}, time to first token (ms): {times}")
    profiler = cProfile.Profile()
    for _ in range(10):
        first_turn()
        profiler.enable()
        follow_up()
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    stats.print_callees("generate")
    stats.print_callees("_restore")


if __name__ == "__main__":
    main()
