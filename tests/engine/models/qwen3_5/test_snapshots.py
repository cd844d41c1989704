"""Qwen3.5 snapshots: the state (conv windows, recurrent matrices, attention KV) saved at a position
and restored equals an uninterrupted run, in memory and through a file; a snapshot is only ever
reused at exactly the length it was taken at."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams, SaveSnapshot
from ds4desk.engine.loader import load_model
from ds4desk.engine.runtime import RunOutcome, Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore, state_layout
from tests.engine.models.qwen3_5.tiny import TINY, save_tiny

CPU = torch.device("cpu")
CONTEXT = 128
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(70)]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    _, source = save_tiny(tmp_path_factory.mktemp("qwen3_5-snapshots"), seed=2)
    return load_model(source, CPU, torch.float32).model


def identity(model: torch.nn.Module) -> ModelIdentity:
    """As the engine makes it: the layout learned from the model's empty state."""
    rt = runtime(model)
    return ModelIdentity(
        "tiny-qwen3_5", "float32", CONTEXT, state_layout(rt.model, CONTEXT), TINY["vocab_size"]
    )


def runtime(model: torch.nn.Module, chunk: int = 8) -> Runtime:
    return Runtime(model, CPU, context=CONTEXT, chunk=chunk)


def run(
    rt: Runtime,
    prompt: list[int],
    store: SnapshotStore | None = None,
    save: SaveSnapshot | None = None,
    count: int = 12,
) -> RunOutcome:
    return rt.generate(prompt, SAMPLED, count, set(), lambda _t: None, lambda: False, None, store, True, save)


def same(a: RunOutcome, b: RunOutcome) -> None:
    assert a.tokens == b.tokens
    # Restoring moves the prefill chunk edges: float32 sums in another order, a few 1e-6 apart.
    assert a.logprobs == pytest.approx(b.logprobs, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("chunk", [1, 8, 512])
@pytest.mark.parametrize("at", [3, 13, 40])
def test_restore_equals_an_uninterrupted_run(model: torch.nn.Module, chunk: int, at: int) -> None:
    """3: inside the first conv window; 13: mid-chunk; 40: past several prefill chunks."""
    rt = runtime(model, chunk)
    store = SnapshotStore(identity(model))
    saved = run(rt, PROMPT[:50], store, SaveSnapshot(at=at))
    assert saved.snapshot_slot is not None and store.get(saved.snapshot_slot).tokens == tuple(PROMPT[:at])
    same(saved, run(rt, PROMPT[:50]))  # saving on the way changes nothing

    restored = run(rt, PROMPT, store)
    assert (restored.stats.reused_tokens, restored.stats.prefill_tokens) == (at, len(PROMPT) - at)
    same(restored, run(rt, PROMPT))


def test_the_snapshot_holds_every_layers_state(model: torch.nn.Module) -> None:
    rt = runtime(model)
    store = SnapshotStore(identity(model))
    slot = run(rt, PROMPT, store, SaveSnapshot(at=21)).snapshot_slot
    state = store.get(slot).state  # type: ignore[arg-type]
    linear, full = 4, 2  # the tiny model's layer kinds
    kernel, channels = TINY["linear_conv_kernel_dim"], 2 * 2 * 8 + 4 * 12
    assert state["kv"].shape == (full, 2, TINY["num_key_value_heads"], 21, TINY["head_dim"])
    assert state["conv"].shape == (linear, channels, kernel - 1)
    assert state["recurrent"].shape == (linear, 4, 8, 12) and state["recurrent"].dtype == torch.float32
    assert state["conv"].abs().sum() > 0 and state["recurrent"].abs().sum() > 0


def test_an_exact_prompt_needs_no_prefill(model: torch.nn.Module) -> None:
    rt = runtime(model)
    store = SnapshotStore(identity(model))
    run(rt, PROMPT, store, SaveSnapshot(at=len(PROMPT)))
    again = run(rt, PROMPT, store)
    assert (again.stats.reused_tokens, again.stats.prefill_tokens) == (len(PROMPT), 0)
    same(again, run(rt, PROMPT))


def test_a_snapshot_after_the_answer_serves_the_next_turn(model: torch.nn.Module) -> None:
    rt = runtime(model)
    store = SnapshotStore(identity(model))
    first = run(rt, PROMPT[:16], store, SaveSnapshot())
    snap = store.get(first.snapshot_slot)  # type: ignore[arg-type]
    assert snap.tokens == tuple([*PROMPT[:16], *first.tokens][: 16 + 11])
    follow_up = [*PROMPT[:16], *first.tokens, 7, 8, 9]
    restored = run(rt, follow_up, store)
    assert restored.stats.reused_tokens == 27
    same(restored, run(rt, follow_up))


def test_a_longer_snapshot_is_never_cut_to_a_shorter_prompt(model: torch.nn.Module) -> None:
    """A snapshot past the prompt's end (or diverging inside it) is not reused: the state could not
    be cut back. The shorter snapshot that does prefix the prompt is reused at its own length."""
    rt = runtime(model)
    store = SnapshotStore(identity(model))
    run(rt, PROMPT, store, SaveSnapshot(at=60))
    run(rt, PROMPT, store, SaveSnapshot(at=10))
    diverged = [*PROMPT[:40], 1, 2, 3]
    reused = run(rt, diverged, store)
    assert reused.stats.reused_tokens == 10
    same(reused, run(rt, diverged))


def test_disk_round_trip_checked_against_the_layout(model: torch.nn.Module, tmp_path: Path) -> None:
    rt = runtime(model)
    ident = identity(model)
    store = SnapshotStore(ident)
    slot = run(rt, PROMPT, store, SaveSnapshot(at=33)).snapshot_slot
    assert slot is not None
    store.save(slot, tmp_path / "s.safetensors")
    fresh = SnapshotStore(ident)
    assert fresh.load(tmp_path / "s.safetensors").tokens == tuple(PROMPT[:33])
    restored = run(rt, PROMPT, fresh)
    assert restored.stats.reused_tokens == 33
    same(restored, run(rt, PROMPT))

    # A forged file: the recurrent state of another shape is refused before anything changes.
    tensors = load_file(str(tmp_path / "s.safetensors"))
    tensors["state.recurrent"] = tensors["state.recurrent"][:, :, :4].contiguous()
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, str(tmp_path / "forged.safetensors"), metadata=metadata)
    other = SnapshotStore(ident)
    with pytest.raises(EngineFailure) as refused:
        other.load(tmp_path / "forged.safetensors")
    assert refused.value.error.code == ErrorCode.INVALID_SNAPSHOT_SLOT and len(other) == 0
