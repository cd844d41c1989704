"""The live speed dock: charts receive stats, histories are bounded, repaints are coalesced (counted,
never timed), memory is polled only while the dock is shown. (Axes, bars, markers: test_charts.py.)"""

from __future__ import annotations

from ds4desk.engine.api import GenerateStats, MemoryStats, TextDelta
from ds4desk.ui.perf_panel import PerfPanel
from ds4desk.ui.stats_format import memory_others
from tests.ui.fake_backend import FakeBackend
from tests.ui.test_main_window import type_and_enter


def stats(decode_s: float = 0.5, generated: int = 51) -> GenerateStats:
    return GenerateStats(
        prompt_tokens=200,
        prefill_tokens=200,
        generated_tokens=generated,
        time_to_first_token_s=0.25,
        prefill_s=0.25,
        decode_s=decode_s,
    )


def memory(allocated: int) -> MemoryStats:
    return MemoryStats("cuda:0", "Test GPU", allocated, allocated + 10**8, 10**10, 8 * 10**10)


def test_live_rate_comes_from_the_streamed_batches(qtbot) -> None:
    panel = PerfPanel()
    qtbot.addWidget(panel)
    panel.begin_answer()
    for i in range(11):  # 20 tokens every 10 ms: 2,000 tok/s
        panel.on_delta(TextDelta(1, tuple(range(20)), "x" * 20), now=100.0 + i * 0.01)
    assert panel.live_rate() == 2000.0 or abs(panel.live_rate() - 2000.0) < 1e-6
    # Batches older than a second leave the window: the rate follows the answer's current speed.
    for i in range(11):
        panel.on_delta(TextDelta(1, tuple(range(5)), "y"), now=102.0 + i * 0.01)
    assert abs(panel.live_rate() - 500.0) < 1e-6
    panel.on_delta(TextDelta(1, (), "held-back text"), now=103.0)  # no tokens: not counted
    assert abs(panel.live_rate() - 500.0) < 1e-6


def test_end_of_answer_adds_the_engine_s_numbers(qtbot) -> None:
    panel = PerfPanel()
    qtbot.addWidget(panel)
    panel.begin_answer()
    panel.end_answer(stats())
    assert panel.decode_chart.values() == [100.0]  # 50 decode steps in 0.5 s
    assert panel.prefill_chart.values() == [800.0] and panel.ttft_chart.values() == [0.25]
    panel.end_answer(GenerateStats())  # a failed request measured nothing: nothing is added
    assert len(panel.prefill_chart.values()) == 1 and len(panel.ttft_chart.values()) == 1
    assert panel.prefill_chart.label() == "prefill: last 800 tok/s  (max 800 tok/s)"


def test_histories_are_bounded(qtbot) -> None:
    panel = PerfPanel(capacity=5)
    qtbot.addWidget(panel)
    for i in range(40):
        panel.end_answer(stats(decode_s=0.1 * (i + 1)))
        panel.add_memory(memory(i * 10**9))
    for chart in panel.charts:
        assert len(chart.values()) == 5
    assert panel.memory_chart.values() == [i * 1e9 for i in range(35, 40)]  # the newest, in bytes
    assert [bar.number for bar in panel.decode_chart.bars] == [36, 37, 38, 39, 40]  # numbers go on
    assert panel.memory_label.text() == "  ·  ".join(memory_others(memory(39 * 10**9)))


def test_repaints_are_coalesced(qtbot) -> None:
    """A thousand batches between two ticks cost one repaint per chart, not a thousand."""
    panel = PerfPanel(tick_ms=50)
    qtbot.addWidget(panel)
    panel.resize(320, 480)
    panel.show()
    qtbot.waitExposed(panel)
    chart = panel.decode_chart
    panel.begin_answer()
    paints_before = chart.paints
    for i in range(1000):
        panel.on_delta(TextDelta(1, (i,), "t"), now=10.0 + i * 0.0005)
    assert chart.updates == 0  # nothing drawn while the batches arrive: they are only counted
    qtbot.waitUntil(lambda: chart.updates == 1)
    qtbot.waitUntil(lambda: chart.paints > paints_before)
    assert chart.values() == []  # the estimate is no bar of its own: it waits for the engine's figure
    assert chart.live is not None and abs(chart.live - 2000.0) < 1.0  # 999 tokens over 0.4995 s
    ticks = panel.ticks
    qtbot.wait(200)  # several tick intervals with nothing new
    assert panel.ticks == ticks and chart.updates == 1  # an idle panel does not redraw


def test_the_window_feeds_the_dock(qtbot, make_window, run) -> None:
    backend = FakeBackend(reply="word " * 60, batch_chars=5)
    window = make_window(backend)
    panel = window.perf_panel
    assert window.perf_dock.isHidden() and not panel.polling  # hidden: no memory polling
    calls = backend.memory_calls

    window.perf_dock_action.trigger()
    assert window.perf_dock.isVisible() and panel.polling
    run(window.wait_idle())
    assert backend.memory_calls > calls and len(panel.memory_chart.values()) >= 1

    seen: list[int] = []
    original = panel.on_delta
    panel.on_delta = lambda delta, now=None: (seen.append(len(delta.tokens)), original(delta, now))  # type: ignore[method-assign]
    type_and_enter(qtbot, window, "Talk")
    run(window.wait_idle())
    assert sum(seen) == backend.batches_sent == 60  # every streamed batch reached the dock
    assert panel.prefill_chart.values() and panel.ttft_chart.values() == [0.05]
    assert panel.decode_chart.values()[-1] > 0 and panel.decode_chart.live is None

    window.perf_dock_action.trigger()
    assert not panel.polling


def test_a_failing_memory_source_is_reported(qtbot, loop) -> None:
    async def broken() -> MemoryStats:
        raise RuntimeError("no device")

    panel = PerfPanel(broken)
    qtbot.addWidget(panel)
    panel.poll_memory()
    loop.run_until_complete(panel.wait_idle())
    assert "no device" in panel.memory_label.text()
    assert len(panel.memory_chart.values()) == 0
