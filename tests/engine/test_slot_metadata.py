"""Snapshot-slot metadata (tokens, bytes, hits, owner tag, pin, file) and memory readings, through the
real engine thread on a tiny real model (CPU)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds4desk.engine import (
    Engine,
    EngineClient,
    ErrorCode,
    GenerateRequest,
    LoadRequest,
    MemoryStats,
    SaveSnapshot,
    SlotInfo,
)
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.memory import process_rss

PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-v4")
    make_tiny("deepseek_v4", folder, seed=3)
    return folder


@pytest.fixture
def engine(tiny_model: Path, tmp_path: Path) -> Iterator[Engine]:
    engine = Engine()
    loaded = engine.load(LoadRequest(path=str(tiny_model), context=96, chunk=8))
    assert loaded.ok, loaded.error
    yield engine
    engine.close()


def answer(engine: Engine, prompt: list[int], tag: str | None = None, save: bool = True) -> list[int]:
    """Greedy, no stop token: always max_new_tokens tokens; returns the prompt and answer."""
    request = GenerateRequest(
        prompt_tokens=prompt,
        max_new_tokens=5,
        stop_tokens=[],
        save_snapshot=SaveSnapshot(tag=tag) if save else None,
    )
    result = engine.generate(request)
    assert result.ok, result.error
    return [*prompt, *result.tokens]


def only(engine: Engine) -> SlotInfo:
    listed = engine.slots("list")
    assert listed.ok and len(listed.slots) == 1
    return listed.slots[0]


def test_a_slot_reports_tokens_bytes_owner_and_hits(engine: Engine) -> None:
    first = answer(engine, PROMPT, tag="chat-7")
    slot = only(engine)
    # The cache holds the prompt and every answer token fed back (the last one was never fed).
    assert slot.tokens == len(first) - 1
    assert slot.bytes > 0 and slot.tag == "chat-7"
    assert slot.hits == 0 and not slot.pinned and slot.path is None
    assert slot.age_s >= 0 and slot.idle_s >= 0

    # A follow-up that starts with the snapshot continues from it: one hit, and its own new slot.
    engine.generate(GenerateRequest(prompt_tokens=[*first, 9], max_new_tokens=2, stop_tokens=[]))
    listed = engine.slots("list").slots
    assert [s.hits for s in listed] == [1]
    assert listed[0].tag == "chat-7"  # a request without a save leaves the owner alone

    answer(engine, [*first, 9, 10], tag="chat-7")
    listed = engine.slots("list").slots
    assert len(listed) == 2 and [s.hits for s in listed] == [2, 0]
    assert all(s.tag == "chat-7" for s in listed)
    assert listed[1].tokens > listed[0].tokens

    json_form = engine.slots("list").to_json()
    assert json_form["error"] is None
    assert [s["hits"] for s in json_form["slots"]] == [2, 0]  # type: ignore[index]


def test_refreshing_the_same_prefix_keeps_its_hits(engine: Engine) -> None:
    answer(engine, PROMPT[:10], tag="a", save=False)
    engine.generate(
        GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=1, save_snapshot=SaveSnapshot(at=10, tag="a"))
    )
    engine.generate(GenerateRequest(prompt_tokens=PROMPT[:15], max_new_tokens=1, stop_tokens=[]))
    assert only(engine).hits == 1
    # Saved again at the same position: restored (a second hit), refreshed in place, still one slot.
    engine.generate(
        GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=1, save_snapshot=SaveSnapshot(at=10, tag="a"))
    )
    slot = only(engine)
    assert slot.hits == 2 and slot.tokens == 10 and slot.tag == "a"


def test_pin_unpin_free(engine: Engine) -> None:
    answer(engine, PROMPT, tag="1")
    index = only(engine).slot
    pinned = engine.slots("pin", index)
    assert pinned.ok and pinned.slots[0].pinned
    assert not engine.slots("unpin", index).slots[0].pinned
    freed = engine.slots("free", index)
    assert freed.ok and freed.slots == []
    again = engine.slots("free", index)
    assert again.error is not None and again.error.code == ErrorCode.INVALID_SNAPSHOT_SLOT
    for op in ("free", "pin", "save"):
        missing = engine.slots(op)
        assert missing.error is not None and missing.error.code == ErrorCode.BAD_REQUEST
    unknown = engine.slots("explode", 0)
    assert unknown.error is not None and "explode" in unknown.error.detail


def test_save_and_load_round_trip_keeps_tokens_owner_and_file(engine: Engine, tmp_path: Path) -> None:
    first = answer(engine, PROMPT, tag="chat-3")
    saved_slot = only(engine)
    path = tmp_path / "snaps" / "slot.safetensors"
    saved = engine.slots("save", saved_slot.slot, path)
    assert saved.ok, saved.error
    assert path.is_file() and saved.slots[0].path == str(path)

    engine.slots("free", saved_slot.slot)
    loaded = engine.slots("load", None, path)
    assert loaded.ok, loaded.error
    back = loaded.slots[0]
    assert (back.tokens, back.bytes, back.tag, back.path) == (
        saved_slot.tokens,
        saved_slot.bytes,
        "chat-3",
        str(path),
    )
    assert back.hits == 0
    # The loaded snapshot is used: a follow-up prefills only what comes after it.
    follow = engine.generate(GenerateRequest(prompt_tokens=[*first, 4], max_new_tokens=1, stop_tokens=[]))
    assert follow.stats.reused_tokens == back.tokens
    assert only(engine).hits == 1

    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a snapshot")
    refused = engine.slots("load", None, broken)
    assert refused.error is not None and refused.error.code == ErrorCode.INVALID_SNAPSHOT_SLOT
    assert len(engine.slots("list").slots) == 1  # nothing lost


def test_memory_on_the_cpu(engine: Engine) -> None:
    stats = engine.submit_memory().result()
    assert isinstance(stats, MemoryStats)
    assert stats.device == "cpu" and stats.name
    loaded = engine._loaded
    assert loaded is not None
    # What the model holds (weights + cache), apart from the process's resident set.
    assert stats.allocated == loaded.info.weight_bytes + loaded.runtime.model.cache_bytes() > 0
    assert stats.reserved > stats.allocated
    assert 0 < stats.free <= stats.total
    assert stats.idle_park_in_s is None  # the auto-park is off
    assert process_rss() > 0
    assert engine.memory_stats is not None  # kept fresh by the engine thread

    parked = engine.park("all")
    assert parked.ok and parked.memory is not None and parked.memory.device == "cpu"
    assert parked.memory.allocated == 0 and parked.bytes == stats.allocated  # the readout's drop
    unparked = engine.unpark("all")
    assert unparked.memory is not None and unparked.memory.allocated > 0
    assert unparked.to_json()["memory"]["device"] == "cpu"  # type: ignore[index]


def test_memory_readings_do_not_hold_off_the_idle_park(tiny_model: Path, tmp_path: Path) -> None:
    engine = Engine(idle_park_after_s=30.0)
    try:
        assert engine.load(LoadRequest(path=str(tiny_model), context=96)).ok
        deadline = engine.idle_park_deadline()
        assert deadline is not None
        left = engine.submit_memory().result().idle_park_in_s
        assert left is not None and 0 < left <= 30.0
        assert engine.idle_park_deadline() == deadline  # a reading is not activity
        engine.slots("list")
        assert engine.idle_park_deadline() > deadline  # type: ignore[operator]  # a command is
    finally:
        engine.close()

    quick = Engine(idle_park_after_s=0.4)
    try:
        assert quick.load(LoadRequest(path=str(tiny_model), context=96)).ok
        give_up = time.monotonic() + 30  # a bound against a hang, not a timing assertion
        while not quick.parked and time.monotonic() < give_up:
            quick.submit_memory().result()  # polled faster than the idle time
            time.sleep(0.05)
        assert quick.parked
        assert quick.idle_park_deadline() is None
        after = quick.submit_memory().result()
        assert after.idle_park_in_s is None
    finally:
        quick.close()


def test_the_async_client(engine: Engine) -> None:
    client = EngineClient(engine)

    async def scenario() -> tuple[MemoryStats, list[SlotInfo]]:
        request = GenerateRequest(
            prompt_tokens=PROMPT, max_new_tokens=3, stop_tokens=[], save_snapshot=SaveSnapshot(tag="x")
        )
        assert (await client.generate(request)).ok
        return await client.memory(), (await client.slots("list")).slots

    memory, slots = asyncio.run(scenario())
    assert memory.device == "cpu" and memory.allocated > 0
    assert [s.tag for s in slots] == ["x"]
