"""DeepSeek-V4's roll-back hooks are exact: after a verify forward of `count` tokens and a roll-back
to the first `kept`, every tensor of the cache (the raw ring with its dead slots, the compressors'
carries, the compressed and indexer rows, and the MTP block's own cache and pending streams) equals
what a second model holds after being fed only the kept tokens, and both continue alike. Cases
cross the tiny model's boundaries: its ring wraps every 8 positions, CSA closes a window every 4
and HCA every 8, and a verify may cover a whole ring."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.speculative.rollback import rollback_of
from tests.engine.speculative.tiny_v4_mtp import VOCAB, load_v4, save_tiny_v4_with_mtp

CONTEXT = 64
WINDOW = 8

# (tokens before the verify, tokens verified, tokens kept)
CASES = [
    (1, 3, 1),
    (3, 3, 2),  # a CSA window closes at 3, inside the verify, and is kept
    (5, 4, 2),  # 7 closes CSA and HCA windows among the dead tokens
    (6, 8, 3),  # a whole ring, wrapping; windows close at 7 (kept? no) and 11
    (7, 8, 1),  # only the step's own token survives
    (8, 8, 5),
    (13, 5, 4),  # 15 closes both kinds: the last dead token
    (15, 6, 6),  # everything kept: nothing to undo
    (21, 7, 3),
    (10, 3, 0),  # a draft model's own roll-back may keep none of what it fed
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[DeepseekV4Model, DeepseekV4Model]:
    folder = save_tiny_v4_with_mtp(tmp_path_factory.mktemp("v4-rollback") / "model", seed=5)
    return load_v4(folder), load_v4(folder)


def cache_state(model: DeepseekV4Model) -> dict[str, torch.Tensor]:
    """Every tensor of the cache, whole (rows no request has reached included), and the MTP
    block's cache and pending streams when it follows the target."""
    cache = model.cache
    assert cache is not None
    state = {f"cache.{i}": t.clone() for i, t in enumerate(cache.tensors())}
    mtp = model._mtp_state
    if mtp is not None:
        state |= {f"mtp.{i}": t.clone() for i, t in enumerate(mtp.tensors())}
        assert model._mtp_pending is not None
        state["mtp.pending"] = model._mtp_pending.clone()
    return state


def described(key: str) -> Callable[[str], str]:
    return lambda message: f"{key}: {message}"


def fresh(model: DeepseekV4Model, tracking: bool) -> None:
    model.allocate_cache(CONTEXT)
    model.set_mtp_tracking(tracking)


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("verify", ["forward", "graphable"])
@pytest.mark.parametrize("tracking", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize(("before", "count", "kept"), CASES)
def test_rollback_equals_feeding_only_the_kept_tokens(
    pair: tuple[DeepseekV4Model, DeepseekV4Model],
    before: int,
    count: int,
    kept: int,
    tracking: bool,
    verify: str,
) -> None:
    """`graphable`: the verify through verify_graphable (run eagerly, as a graph's first use is), whose
    compressor carries are written a token at a time; when every token is kept nothing is undone, and
    the carries' rows not yet reached differ from a chunk's (test_graphable compares what is read)."""
    spec, ref = pair
    hooks = rollback_of(spec)
    assert hooks is not None and hooks.max_verify_tokens() == WINDOW
    ids = tokens(before + count + 1, before * 100 + count)
    nxt = ids[before + count :]  # a token to continue with after the roll-back
    if verify == "graphable" and kept == count:
        pytest.skip("nothing is rolled back")
    with torch.inference_mode():
        fresh(spec, tracking)
        spec.forward(ids[:before], 0, "none")
        saved = hooks.verify_checkpoint(before, count)
        if verify == "graphable":
            at = torch.tensor([before])
            scored = spec.verify_graphable(ids[before : before + count], at, CONTEXT)
            if tracking:  # a graph step does not feed the MTP block: no graphable verify then
                assert scored is None
                scored = spec.forward(ids[before : before + count], before, "all")
            else:
                assert scored is not None
                spec.set_length(before + count)
        else:
            scored = spec.forward(ids[before : before + count], before, "all")
        hooks.verify_rollback(saved, before, kept)
        assert spec.cache is not None and spec.cache.length == before + kept
        rolled = cache_state(spec)

        fresh(ref, tracking)
        ref.forward(ids[:before], 0, "none")
        if kept:
            kept_logits = ref.forward(ids[before : before + kept], before, "all")
            assert scored is not None and kept_logits is not None
            torch.testing.assert_close(scored[:kept], kept_logits, atol=1e-5, rtol=1e-5)
        expected = cache_state(ref)

        assert rolled.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(rolled[key], expected[key], atol=1e-5, rtol=1e-4, msg=described(key))
        if tracking:
            assert spec._mtp_length == ref._mtp_length == before + kept - 1
            assert spec.mtp_ready(before + kept) and ref.mtp_ready(before + kept)
        else:
            assert spec._mtp_state is None
        # Both continue alike, through a compress boundary and a wrap of the ring.
        after_spec = spec.forward(torch.cat([nxt, ids[:WINDOW]]), before + kept, "all")
        after_ref = ref.forward(torch.cat([nxt, ids[:WINDOW]]), before + kept, "all")
        torch.testing.assert_close(after_spec, after_ref, atol=1e-5, rtol=1e-5)
        if tracking:
            for key, value in cache_state(ref).items():
                torch.testing.assert_close(
                    cache_state(spec)[key], value, atol=1e-5, rtol=1e-4, msg=described(key)
                )


def test_the_dead_ring_rows_come_back_bit_for_bit(pair: tuple[DeepseekV4Model, DeepseekV4Model]) -> None:
    """The slots a rejected token overwrote hold again exactly what they held (the rows of positions
    a window back), not a recomputation."""
    spec, _ = pair
    ids = tokens(20, 7)
    with torch.inference_mode():
        fresh(spec, False)
        spec.forward(ids[:12], 0, "none")
        assert spec.cache is not None
        before = [layer.ring.clone() for layer in spec.cache.layers]
        saved = spec.verify_checkpoint(12, 8)
        spec.forward(ids[12:20], 12, "all")
        changed = [
            not torch.equal(layer.ring, old) for layer, old in zip(spec.cache.layers, before, strict=True)
        ]
        assert all(changed)  # the verify did write every layer's ring
        spec.verify_rollback(saved, 12, 2)
        for layer, old in zip(spec.cache.layers, before, strict=True):
            dead = [p % WINDOW for p in range(14, 20)]
            assert torch.equal(layer.ring[dead], old[dead])


def test_a_verify_longer_than_the_ring_is_refused(pair: tuple[DeepseekV4Model, DeepseekV4Model]) -> None:
    spec, _ = pair
    with torch.inference_mode():
        fresh(spec, False)
        spec.forward(tokens(4, 1), 0, "none")
        with pytest.raises(ValueError, match=r"1\.\.8 positions"):
            spec.verify_checkpoint(4, WINDOW + 1)


def test_snapshots_carry_the_mtp_state(pair: tuple[DeepseekV4Model, DeepseekV4Model], tmp_path: Path) -> None:
    """A snapshot taken while the block follows holds its state: imported into a fresh cache, the
    block drafts exactly as it would have; imported without it, the block stops drafting."""
    spec, ref = pair
    ids = tokens(30, 3)
    with torch.inference_mode():
        fresh(spec, True)
        spec.forward(ids[:19], 0, "none")
        state = spec.export_state(19)
        assert "mtp.pending" in state and "mtp.ring" in state
        drafted = spec.mtp_draft(int(ids[19]), 3, torch.argmax)
        fresh(ref, True)
        ref.import_state(state, 19)
        assert ref.mtp_ready(19)
        assert [int(t) for t in ref.mtp_draft(int(ids[19]), 3, torch.argmax)] == [int(t) for t in drafted]
        fresh(ref, True)
        ref.import_state({k: v for k, v in state.items() if not k.startswith("mtp.")}, 19)
        assert not ref.mtp_ready(19)
