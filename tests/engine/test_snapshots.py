"""Snapshot slots: a restored request is exactly an uninterrupted one, with less prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ds4desk.engine.api import EngineFailure, ErrorCode, FinishReason, SamplingParams, SaveSnapshot
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.runtime import RunOutcome, Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore
from tests.engine.tiny_dense import save_tiny

CPU = torch.device("cpu")
IDENTITY = ModelIdentity("tiny-llama", "float32", 96)
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(30)]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=5)


@pytest.fixture(scope="module", params=["llama", "deepseek_v4"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """Both families: DeepSeek-V4's tiny config has an 8-token window and windows of 4 and 8 tokens
    for its compressed layers, so snapshot positions land mid-window and after the ring wrapped."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        _, source = save_tiny("llama", folder, seed=2)
    else:
        make_tiny("deepseek_v4", folder, seed=2)
        source = inspect_folder(folder)
    return load_model(source, CPU, torch.float32).model


def runtime(model: torch.nn.Module, chunk: int = 4) -> Runtime:
    return Runtime(model, CPU, context=96, chunk=chunk)


def run(
    rt: Runtime,
    prompt: list[int],
    store: SnapshotStore | None = None,
    save: SaveSnapshot | None = None,
    count: int = 12,
    cancel_after: int | None = None,
) -> RunOutcome:
    seen: list[int] = []
    return rt.generate(
        prompt,
        SAMPLED,
        count,
        set(),
        seen.append,
        lambda: cancel_after is not None and len(seen) >= cancel_after,
        None,
        store,
        True,
        save,
    )


def same(a: RunOutcome, b: RunOutcome) -> None:
    assert a.tokens == b.tokens
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 512])
@pytest.mark.parametrize("at", [13, 16, 5])
def test_restore_equals_an_uninterrupted_run(model: torch.nn.Module, chunk: int, at: int) -> None:
    """13: mid-chunk, mid-window, after the 8-row ring wrapped; 16: where windows close; 5: early."""
    rt = runtime(model, chunk)
    store = SnapshotStore(IDENTITY)
    saved = run(rt, PROMPT[:20], store, SaveSnapshot(at=at))
    assert saved.snapshot_slot is not None and store.get(saved.snapshot_slot).tokens == tuple(PROMPT[:at])
    assert saved.stats.prefill_tokens == 20
    same(saved, run(rt, PROMPT[:20]))  # saving on the way changes nothing

    restored = run(rt, PROMPT, store)
    assert (restored.stats.reused_tokens, restored.stats.prefill_tokens) == (at, len(PROMPT) - at)
    same(restored, run(rt, PROMPT))


def test_an_exact_prompt_needs_no_prefill(model: torch.nn.Module) -> None:
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    run(rt, PROMPT, store, SaveSnapshot(at=len(PROMPT)))
    again = run(rt, PROMPT, store)
    assert (again.stats.reused_tokens, again.stats.prefill_tokens) == (len(PROMPT), 0)
    same(again, run(rt, PROMPT))


def test_a_snapshot_after_the_answer_serves_the_next_turn(model: torch.nn.Module) -> None:
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    first = run(rt, PROMPT[:16], store, SaveSnapshot())
    snap = store.get(first.snapshot_slot)  # type: ignore[arg-type]
    # LENGTH: the last token was sampled but never fed back, so the snapshot ends before it.
    assert snap.tokens == tuple([*PROMPT[:16], *first.tokens][: 16 + 11])
    follow_up = [*PROMPT[:16], *first.tokens, 7, 8, 9]
    restored = run(rt, follow_up, store)
    assert restored.stats.reused_tokens == 27
    same(restored, run(rt, follow_up))


def test_the_next_turn_continues_in_place(model: torch.nn.Module) -> None:
    """Right after the answer its snapshot is the model's state as it is: the follow-up copies
    nothing back (the snapshot's tensors are wiped to prove it) and equals an uninterrupted run."""
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    first = run(rt, PROMPT[:16], store, SaveSnapshot())
    snap = store.get(first.snapshot_slot)  # type: ignore[arg-type]
    kept = {name: tensor.clone() for name, tensor in snap.state.items()}
    for tensor in snap.state.values():
        tensor.zero_()
    follow_up = [*PROMPT[:16], *first.tokens, 7, 8, 9]
    in_place = run(rt, follow_up, store)
    assert in_place.stats.reused_tokens == 27
    for name, tensor in snap.state.items():
        tensor.copy_(kept[name])
    same(in_place, run(rt, follow_up))


@pytest.mark.parametrize("between", ["generate", "prefill", "cancelled", "restore"])
def test_a_request_between_makes_the_next_turn_restore(model: torch.nn.Module, between: str) -> None:
    """Whatever runs the model after the answer (another prompt, a prefill, a request cancelled at
    once, a turn of another saved conversation) leaves the saved state behind: the follow-up then
    restores it by copy and still equals an uninterrupted run."""
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    other = store.get(run(rt, PROMPT[2:14], store, SaveSnapshot()).snapshot_slot)  # type: ignore[arg-type]
    first = run(rt, PROMPT[:16], store, SaveSnapshot())
    if between == "generate":
        run(rt, PROMPT[5:25])
    elif between == "prefill":
        rt.prefill_logits(PROMPT[3:20])
    elif between == "cancelled":
        assert run(rt, PROMPT[4:24], count=40, cancel_after=0).finish_reason == FinishReason.CANCELLED
    else:
        assert run(rt, [*other.tokens, 5, 6], store).stats.reused_tokens == len(other.tokens)
    follow_up = [*PROMPT[:16], *first.tokens, 7, 8, 9]
    restored = run(rt, follow_up, store)
    assert restored.stats.reused_tokens == 27
    same(restored, run(rt, follow_up))


def test_cancel_on_the_restored_path(model: torch.nn.Module) -> None:
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    run(rt, PROMPT, store, SaveSnapshot(at=20))
    cut = run(rt, PROMPT, store, count=40, cancel_after=3)
    assert cut.finish_reason == FinishReason.CANCELLED and cut.stats.reused_tokens == 20
    assert cut.tokens == run(rt, PROMPT, count=40).tokens[: len(cut.tokens)]


def test_disk_round_trip_and_refusals(model: torch.nn.Module, tmp_path: Path) -> None:
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    slot = run(rt, PROMPT, store, SaveSnapshot(at=25)).snapshot_slot
    assert slot is not None
    store.save(slot, tmp_path / "s.safetensors")

    fresh = SnapshotStore(IDENTITY)
    loaded = fresh.load(tmp_path / "s.safetensors")
    assert loaded.tokens == tuple(PROMPT[:25])
    restored = run(rt, PROMPT, fresh)
    assert restored.stats.reused_tokens == 25
    same(restored, run(rt, PROMPT))

    save_file({"x": torch.zeros(3)}, str(tmp_path / "other.safetensors"))
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 10)
    for identity, name in [
        (ModelIdentity("another-model", "float32", 96), "s.safetensors"),
        (ModelIdentity("tiny-llama", "bfloat16", 96), "s.safetensors"),
        (ModelIdentity("tiny-llama", "float32", 128), "s.safetensors"),
        (IDENTITY, "other.safetensors"),
        (IDENTITY, "junk.bin"),
    ]:
        other = SnapshotStore(identity)
        with pytest.raises(EngineFailure) as refused:
            other.load(tmp_path / name)
        assert refused.value.error.code == ErrorCode.INVALID_SNAPSHOT_SLOT
        assert len(other) == 0  # never half-applied


def tensors(nbytes: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"kv": torch.zeros(nbytes // 4)}, torch.zeros(4)


def test_eviction_is_lru_keeps_pinned_and_prefers_leaves() -> None:
    store = SnapshotStore(IDENTITY, slots=3)
    a = store.put([1, 2], *tensors(64))
    store.put([1, 2, 3], *tensors(64))  # extends a
    c = store.put([9], *tensors(64))
    store.longest_prefix([1, 2])  # a is the most recently used, yet b extends it
    d = store.put([5], *tensors(64))
    assert {s.tokens for s in store.list()} == {a.tokens, c.tokens, d.tokens}  # b: the oldest leaf
    store.pin(c.slot)
    store.put([6], *tensors(64))  # a is a leaf now, and older than d; c is pinned
    assert {s.tokens for s in store.list()} == {c.tokens, d.tokens, (6,)}
    for snap in store.list():
        store.pin(snap.slot)
    with pytest.raises(EngineFailure) as full:
        store.put([7], *tensors(64))
    assert full.value.error.code == ErrorCode.OUT_OF_MEMORY


def test_the_memory_budget_evicts_too() -> None:
    store = SnapshotStore(IDENTITY, slots=8, budget_bytes=300)
    store.put([1], *tensors(128))
    store.put([2], *tensors(128))
    store.put([3], *tensors(128))  # 3 x (128 + 16) > 300: the oldest goes
    assert [s.tokens for s in store.list()] == [(2,), (3,)] or {s.tokens for s in store.list()} == {
        (2,),
        (3,),
    }
    with pytest.raises(EngineFailure):
        store.put([4], *tensors(4096))


def test_bad_slots() -> None:
    store = SnapshotStore(IDENTITY, slots=2)
    for call in (lambda: store.free(1), lambda: store.put([1], *tensors(8), slot=5), lambda: store.pin(0)):
        with pytest.raises(EngineFailure) as bad:
            call()
        assert bad.value.error.code == ErrorCode.INVALID_SNAPSHOT_SLOT


def test_a_save_position_outside_the_prompt_is_refused(model: torch.nn.Module) -> None:
    with pytest.raises(EngineFailure) as bad:
        run(runtime(model), PROMPT, SnapshotStore(IDENTITY), SaveSnapshot(at=len(PROMPT) + 1))
    assert bad.value.error.code == ErrorCode.BAD_REQUEST
    with pytest.raises(EngineFailure) as none:
        run(runtime(model), PROMPT, None, SaveSnapshot(at=3))
    assert none.value.error.code == ErrorCode.INVALID_SNAPSHOT_SLOT


def test_a_chat_follow_up_prefills_only_the_new_message() -> None:
    """The real model and its chat template, as the window uses them."""
    from ds4desk.engine import Engine, GenerateRequest, LoadRequest

    engine = Engine()
    try:
        assert engine.load(LoadRequest(context=1024)).ok
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        first = engine.generate(
            GenerateRequest(messages=chat, max_new_tokens=24, save_snapshot=SaveSnapshot())
        )
        assert first.ok and first.snapshot_slot is not None
        chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Spain?"}]
        follow = engine.generate(GenerateRequest(messages=chat, max_new_tokens=16))
        cold = engine.generate(GenerateRequest(messages=chat, max_new_tokens=16, use_snapshots=False))
        listed = engine.slots("list")
    finally:
        engine.close()
    assert follow.stats.reused_tokens >= len(first.prompt_tokens) + len(first.tokens)
    assert follow.stats.prefill_tokens < 16  # "<|im_end|>", the new user turn and the assistant header
    assert follow.tokens == cold.tokens and cold.stats.reused_tokens == 0
    assert listed.ok and [s.slot for s in listed.slots] == [first.snapshot_slot]


def test_a_resident_copy_serves_the_follow_up(model: torch.nn.Module) -> None:
    """With a device budget, a saved snapshot also stays as a copy beside the cache (on the CPU here,
    as it would on the GPU): the follow-up restores from that copy (the host state is wiped to
    prove it) and equals an uninterrupted run; a snapshot the store dropped loses its copy."""
    rt = runtime(model)
    rt.resident_snapshot_bytes = 2**30
    store = SnapshotStore(IDENTITY)
    first = run(rt, PROMPT[:16], store, SaveSnapshot())
    snap = store.get(first.snapshot_slot)  # type: ignore[arg-type]
    assert [r.snapshot for r in rt._resident] == [snap]
    run(rt, PROMPT[5:25])  # moves the model's state on: the follow-up must restore
    for tensor in snap.state.values():
        tensor.zero_()
    follow_up = [*PROMPT[:16], *first.tokens, 7, 8, 9]
    restored = run(rt, follow_up, store)
    assert restored.stats.reused_tokens == 27
    same(restored, run(rt, follow_up))

    store.free(snap.slot)
    run(rt, PROMPT[:10], store, SaveSnapshot())
    assert [r.snapshot for r in rt._resident] == store.list()


def test_resident_copies_stay_within_their_budget(model: torch.nn.Module) -> None:
    """Newest first: a budget of one snapshot keeps only the latest copy; one larger than the whole
    budget gets no copy and leaves the others be."""
    rt = runtime(model)
    store = SnapshotStore(IDENTITY)
    rt.resident_snapshot_bytes = 2**30
    one = store.get(run(rt, PROMPT[:12], store, SaveSnapshot()).snapshot_slot)  # type: ignore[arg-type]
    rt.resident_snapshot_bytes = one.nbytes + 4 * 2**10
    two = store.get(run(rt, PROMPT[3:15], store, SaveSnapshot()).snapshot_slot)  # type: ignore[arg-type]
    assert len(store) == 2 and [r.snapshot for r in rt._resident] == [two]
    rt.resident_snapshot_bytes = 16
    run(rt, PROMPT[5:20], store, SaveSnapshot())
    assert len(store) == 3 and [r.snapshot for r in rt._resident] == [two]
    rt.close()
    assert rt._resident == []
