"""How long the UI thread stalls while an answer streams at 2,000 tok/s into a long conversation.

    QT_QPA_PLATFORM=offscreen .venv/bin/python bench/ui_responsiveness.py [--seconds 10] [--messages 200]

The real MainWindow on the real qasync loop, offscreen, with a chat of --messages messages (code
blocks, lists, tables) open; a scripted backend streams 20 tokens every 10 ms (2,000 tok/s) of
Markdown for --seconds. A QTimer at 5 ms notes every gap between its timeouts: the worst and p99 gap
are how long a click or a key press would have waited. Prints JSON and writes it under
bench/results/ui_responsiveness.json (and a timestamped copy).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.ui.fake_backend, run as a script

import PySide6
import qasync
import shiboken6
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication

from ds4desk.engine.api import FinishReason, GenerateRequest, GenerateResult, GenerateStats, TextDelta
from ds4desk.history import History
from ds4desk.settings import Settings
from ds4desk.ui.main_window import MainWindow
from ds4desk.ui.stream_render import StreamSplicer
from tests.ui.fake_backend import FakeBackend

RESULTS = Path(__file__).resolve().parent / "results"

# About 4 characters a token, as for English text and code with a BPE vocabulary.
ANSWER_PARTS = [
    "Here is how the parser handles **nested** blocks, step by step:\n\n",
    "1. It reads the header and checks the `magic` bytes.\n2. It walks the table of contents.\n\n",
    "```python\ndef parse(stream: bytes) -> dict[str, int]:\n    offsets = {}\n"
    "    for index, chunk in enumerate(stream.split(b'\\n')):\n        offsets[str(index)] = len(chunk)\n"
    "    return offsets\n```\n\n",
    "| field | bytes | meaning |\n|---|---:|---|\n| magic | 4 | file kind |\n| count | 8 | entries |\n\n",
    "The same idea works for *streaming* input; see [the docs](https://example.org) for details. ",
]


def conversation_message(index: int) -> tuple[str, str]:
    if index % 2 == 0:
        return "user", f"Question {index // 2}: how does step {index} of the import work? Show code."
    return "assistant", "".join(ANSWER_PARTS) * 2


class StreamingBackend(FakeBackend):
    """FakeBackend that streams `tokens_per_batch` tokens every `interval_s`, on an absolute schedule
    (a late batch is not made up by sleeping less later: the rate stays the target rate)."""

    def __init__(self, seconds: float, tokens_per_batch: int = 20, interval_s: float = 0.010) -> None:
        super().__init__(delay_s=0.0)
        self.seconds = seconds
        self.tokens_per_batch = tokens_per_batch
        self.interval_s = interval_s
        self.tokens_streamed = 0
        self.late_batches = 0

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        self.generate_requests.append(request)
        text = "".join(ANSWER_PARTS)
        chars = self.tokens_per_batch * 4
        start = time.perf_counter()
        sent: list[str] = []
        batch = 0
        offset = 0
        while time.perf_counter() - start < self.seconds:
            batch += 1
            target = start + batch * self.interval_s
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.late_batches += 1
                await asyncio.sleep(0)
            piece = (text * 2)[offset : offset + chars]
            offset = (offset + chars) % len(text)
            sent.append(piece)
            self.tokens_streamed += self.tokens_per_batch
            if on_delta is not None:
                first = self.tokens_streamed - self.tokens_per_batch
                on_delta(TextDelta(request.request_id, tuple(range(first, self.tokens_streamed)), piece))
        elapsed = time.perf_counter() - start
        stats = GenerateStats(
            prompt_tokens=5000,
            prefill_tokens=5000,
            generated_tokens=self.tokens_streamed,
            time_to_first_token_s=0.01,
            prefill_s=0.01,
            decode_s=elapsed,
        )
        return GenerateResult(
            request.request_id, text="".join(sent), finish_reason=FinishReason.LENGTH, stats=stats
        )


class GapMeter:
    def __init__(self, interval_ms: int) -> None:
        self.gaps_ms: list[float] = []
        # The UI thread's CPU time within each gap: on a loaded machine a gap can be long because the
        # OS ran another process, which this tells apart from the UI's own work.
        self.gaps_cpu_ms: list[float] = []
        self.gap_ends_s: list[float] = []  # when each gap ended, from start()
        self._started = 0.0
        self._last: float | None = None
        self._last_cpu = 0.0
        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = self._started = time.perf_counter()
        self._last_cpu = time.thread_time()
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def _tick(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self._last is not None:
            self.gaps_ms.append((now - self._last) * 1000)
            self.gaps_cpu_ms.append((cpu - self._last_cpu) * 1000)
            self.gap_ends_s.append(now - self._started)
        self._last, self._last_cpu = now, cpu


def time_renders(window: MainWindow) -> list[tuple[float, float]]:
    """(wall ms, CPU ms of this thread) of every streaming render: the machine is shared, so the CPU
    time says what the UI itself cost when the wall time was stretched by other processes."""
    view = window.chat_view
    original = view._render_stream
    costs: list[tuple[float, float]] = []

    def timed() -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        original()
        costs.append(((time.perf_counter() - wall) * 1000, (time.thread_time() - cpu) * 1000))

    view._render_stream = timed  # type: ignore[method-assign]
    view._render_timer.timeout.disconnect()
    view._render_timer.timeout.connect(timed)
    return costs


def settle(loop: asyncio.AbstractEventLoop, seconds: float = 0.5) -> None:
    loop.run_until_complete(asyncio.sleep(seconds))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--timer-ms", type=int, default=5)
    parser.add_argument("--perf-dock", action="store_true", help="show the live speed dock too")
    parser.add_argument("--profile", type=Path, help="write cProfile stats of the stream to this file")
    parser.add_argument(
        "--whole-renders",
        action="store_true",
        help="the peer: re-render the whole answer every time, as before the block-by-block splicer",
    )
    args = parser.parse_args()

    if args.whole_renders:
        StreamSplicer.render = lambda self, *a, **k: None  # type: ignore[method-assign]
    app = QApplication.instance() or QApplication(sys.argv)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    folder = Path(tempfile.mkdtemp(prefix="ds4-ui-bench-"))
    history = History(folder / "history.sqlite3")
    chat = history.create_chat(model="fake")
    for index in range(args.messages):
        role, content = conversation_message(index)
        history.add_message(chat.id, role, content)
    backend = StreamingBackend(args.seconds)
    window = MainWindow(backend, history, Settings())
    window.resize(1100, 750)
    window.show()
    if args.perf_dock:
        window.perf_dock_action.trigger()
    loop.run_until_complete(window.load_model())

    settle(loop)  # the window's layout (and the dock's) as a user would see it, before measuring
    opened = time.perf_counter()
    window.open_chat(chat.id)
    app.processEvents()
    open_chat_s = time.perf_counter() - opened
    settle(loop)

    meter = GapMeter(args.timer_ms)
    renders = time_renders(window)
    load_before = os.getloadavg()

    async def stream() -> None:
        meter.start()
        await window.send_message("Explain the whole import again, with code.")
        meter.stop()

    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        loop.run_until_complete(stream())
        profiler.disable()
        profiler.dump_stats(str(args.profile))
    else:
        loop.run_until_complete(stream())
    gaps = meter.gaps_ms
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pyside6": PySide6.__version__,
            "qpa": os.environ.get("QT_QPA_PLATFORM"),
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "messages_on_screen": args.messages,
        "open_chat_s": round(open_chat_s, 3),
        "stream_seconds": args.seconds,
        "target_tok_s": backend.tokens_per_batch / backend.interval_s,
        "tokens_streamed": backend.tokens_streamed,
        "achieved_tok_s": round(backend.tokens_streamed / args.seconds, 1),
        "late_batches": backend.late_batches,
        "answer_chars": len(history.messages(chat.id)[-1].content),
        "renders": window.chat_view.renders,
        "timer_interval_ms": args.timer_ms,
        "timer_ticks": len(gaps),
        "worst_gap_ms": round(max(gaps), 2) if gaps else None,
        "p99_gap_ms": round(percentile(gaps, 0.99), 2) if gaps else None,
        "p50_gap_ms": round(statistics.median(gaps), 2) if gaps else None,
        "gaps_over_50ms": sum(1 for g in gaps if g > 50),
        "worst_gap_cpu_ms": round(max(meter.gaps_cpu_ms), 2) if gaps else None,
        "p99_gap_cpu_ms": round(percentile(meter.gaps_cpu_ms, 0.99), 2) if gaps else None,
        "gaps_over_50ms_cpu": sum(1 for g in meter.gaps_cpu_ms if g > 50),
        # Where the UI's own worst gap was: after --seconds it is the end of the answer (final render,
        # history, footer), not the streaming.
        "worst_gap_cpu_at_s": round(meter.gap_ends_s[meter.gaps_cpu_ms.index(max(meter.gaps_cpu_ms))], 2)
        if gaps
        else None,
        "perf_dock": args.perf_dock,
        "whole_renders": args.whole_renders,
        "render_wall_ms_max": round(max(w for w, _ in renders), 1) if renders else None,
        "render_wall_ms_p50": round(statistics.median(w for w, _ in renders), 1) if renders else None,
        "render_cpu_ms_max": round(max(c for _, c in renders), 1) if renders else None,
        "render_cpu_ms_p50": round(statistics.median(c for _, c in renders), 1) if renders else None,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    window.close()
    loop.run_until_complete(window.wait_idle())
    shiboken6.delete(window)  # now, on this thread, not in the garbage collector at exit
    shiboken6.delete(meter.timer)
    history.close()
    loop.close()
    asyncio.set_event_loop(None)
    gc.collect()  # while Qt is still up: collected at interpreter exit, PySide6 crashes
    text = json.dumps(result, indent=2)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ui_responsiveness.json").write_text(text + "\n")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS / f"ui_responsiveness_{stamp}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
