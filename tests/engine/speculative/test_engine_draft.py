"""A draft model through the engine: loaded beside the target from LoadRequest.draft, refused with
a clear error when it cannot draft for the target, parked and unparked on its own, and the
`speculative` setting resolved per request (auto: the draft when loaded, else lookup; off for
DeepSeek-V4, where an explicit drafter is refused)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds4desk.engine import Engine, ErrorCode, GenerateRequest, LoadRequest, SaveSnapshot
from ds4desk.engine.api import EngineFailure
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.runtime import Runtime
from tests.engine.models.gemma3 import tiny as gemma3_tiny
from tests.engine.speculative.tiny_pairs import GREEDY, REPEATING
from tests.engine.tiny_dense import save_tiny

PROMPT = [v % 250 + 6 for v in REPEATING]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-draft")
    made = {
        "target": (root / "target", {"seed": 1}),
        "draft": (root / "draft", {"seed": 21}),
        "wide": (root / "wide", {"seed": 22, "vocab_size": 320}),  # another vocabulary
    }
    for folder, options in made.values():
        gemma3_tiny.save_tiny(folder, "tiny", **options)  # type: ignore[arg-type]
    # A llama-family draft with Gemma's vocabulary size: drafting across families is fine.
    save_tiny("llama", root / "llama", seed=23, vocab_size=300)
    return {name: folder for name, (folder, _) in made.items()} | {"llama": root / "llama"}


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine()
    yield engine
    engine.close()


def load(engine: Engine, folders: dict[str, Path], draft: str | None, speculative: str = "auto"):  # type: ignore[no-untyped-def]
    request = LoadRequest(
        path=str(folders["target"]),
        device="cpu",
        context=256,
        chunk=16,
        draft=str(folders[draft]) if draft else None,
        speculative=speculative,
    )
    return engine.load(request)


def ask(engine: Engine, speculative: str | None = None, count: int = 30):  # type: ignore[no-untyped-def]
    return engine.generate(
        GenerateRequest(
            prompt_tokens=PROMPT,
            sampling=GREEDY,
            max_new_tokens=count,
            stop_tokens=[],
            speculative=speculative,
        )
    )


@pytest.mark.parametrize("draft", ["draft", "llama"])
def test_a_loaded_draft_drafts_and_the_answer_is_unchanged(
    engine: Engine, folders: dict[str, Path], draft: str
) -> None:
    loaded = load(engine, folders, draft)
    assert loaded.ok, loaded.error
    info = loaded.info
    assert info is not None and info.draft == str(folders[draft]) and info.draft_weight_bytes > 0
    device, resident = engine.resident_bytes()
    assert device == "cpu" and resident > info.weight_bytes + info.draft_weight_bytes
    plain = ask(engine, "off")
    auto = ask(engine)
    assert plain.ok and auto.ok, (plain.error, auto.error)
    assert auto.stats.speculative == "draft" and auto.stats.drafted_tokens > 0
    assert auto.tokens == plain.tokens
    as_json = auto.to_json()["stats"]
    assert isinstance(as_json, dict)
    assert as_json["drafted_tokens"] == auto.stats.drafted_tokens
    assert as_json["accepted_tokens"] == auto.stats.accepted_tokens
    assert as_json["speculative"] == "draft"


def test_park_and_unpark_the_draft_alone(engine: Engine, folders: dict[str, Path]) -> None:
    assert load(engine, folders, "draft").ok
    before = ask(engine)
    _, resident = engine.resident_bytes()
    parked = engine.park("draft")
    assert parked.ok and not parked.parked and not engine.parked
    assert parked.bytes > 0
    assert engine.resident_bytes()[1] == resident - parked.bytes
    # The target answers on, with prompt lookup; asking for the draft now says why not.
    without = ask(engine)
    assert without.ok and without.stats.speculative == "lookup" and without.tokens == before.tokens
    refused = ask(engine, "draft")
    assert refused.error is not None and refused.error.code == ErrorCode.BAD_REQUEST
    assert "draft model" in refused.error.detail
    assert engine.park("draft").bytes == 0  # nothing left to free
    unparked = engine.unpark("draft")
    assert unparked.ok and unparked.bytes == parked.bytes
    again = ask(engine)
    assert again.stats.speculative == "draft" and again.tokens == before.tokens
    # Parking the target takes the draft with it; unparking brings both back.
    assert engine.park("all").parked
    assert engine.resident_bytes() == ("", 0)
    after = ask(engine)  # unparks on demand
    assert after.ok and after.stats.speculative == "draft" and after.tokens == before.tokens


def test_a_draft_with_another_vocabulary_is_refused(engine: Engine, folders: dict[str, Path]) -> None:
    assert load(engine, folders, None).ok
    first = ask(engine, "off")
    refused = load(engine, folders, "wide")
    assert not refused.ok and refused.error is not None
    assert refused.error.code == ErrorCode.LOAD_FAILED
    assert "vocabulary of 320 tokens" in refused.error.detail and "300" in refused.error.detail
    assert "tokenizer" in refused.error.detail
    # Refused before anything was let go: the model loaded before still answers, the same.
    info = engine.model_info
    assert info is not None and info.path == str(folders["target"]) and info.draft == ""
    assert ask(engine, "off").tokens == first.tokens


def test_a_draft_loaded_beside_the_model_keeps_the_model_and_its_snapshots(
    engine: Engine, folders: dict[str, Path]
) -> None:
    """File > Load draft model asks for the loaded model with a draft: only the draft is loaded
    (the model's weights are the same objects), the snapshot a chat saved still serves its
    follow-up, and a later draft replaces the first. A draft that cannot draft for it is refused
    and the one loaded stays."""
    assert load(engine, folders, None).ok
    before = engine._loaded
    assert before is not None
    weights = before.runtime.model
    saved = engine.generate(
        GenerateRequest(
            prompt_tokens=PROMPT,
            sampling=GREEDY,
            max_new_tokens=6,
            stop_tokens=[],
            save_snapshot=SaveSnapshot(),
        )
    )
    assert saved.ok and saved.snapshot_slot is not None
    for draft in ("draft", "llama"):
        swapped = load(engine, folders, draft)
        assert swapped.ok, swapped.error
        assert swapped.info is not None and swapped.info.draft == str(folders[draft])
        assert swapped.info.draft_weight_bytes > 0 and swapped.info.weight_bytes == before.info.weight_bytes
        loaded = engine._loaded
        assert loaded is not None and loaded.runtime.model is weights
        assert loaded.runtime.draft is not None and loaded.runtime.draft.path == str(folders[draft])
        assert [slot.slot for slot in engine.slots().slots] == [saved.snapshot_slot]
        follow_up = [*PROMPT, *saved.tokens, 7, 8, 9]
        answer = engine.generate(
            GenerateRequest(prompt_tokens=follow_up, sampling=GREEDY, max_new_tokens=12, stop_tokens=[])
        )
        assert answer.ok and answer.stats.reused_tokens > 0
        assert answer.stats.speculative == "draft" and answer.stats.drafted_tokens > 0
    refused = load(engine, folders, "wide")
    assert not refused.ok and refused.error is not None and refused.error.code == ErrorCode.LOAD_FAILED
    info = engine.model_info
    assert info is not None and info.draft == str(folders["llama"])
    assert engine._loaded is not None and engine._loaded.runtime.model is weights


def test_a_bad_speculative_word_is_refused(engine: Engine, folders: dict[str, Path]) -> None:
    bad = load(engine, folders, None, speculative="sometimes")
    assert not bad.ok and bad.error is not None and bad.error.code == ErrorCode.BAD_REQUEST
    assert load(engine, folders, None, speculative="off").ok
    assert ask(engine).stats.speculative == "off"  # the load's setting is every request's default
    assert ask(engine, "lookup").stats.speculative == "lookup"
    mtp = ask(engine, "mtp")
    assert mtp.error is not None and mtp.error.code == ErrorCode.BAD_REQUEST
    assert "not supported for this model" in mtp.error.detail


def test_deepseek_v4_speculates(tmp_path: Path) -> None:
    """Its ring and compressor state roll back: auto drafts by prompt lookup (make_tiny's V4 has no
    MTP block), with the tokens of speculation off; a draft or MTP it does not have is refused."""
    make_tiny("deepseek_v4", tmp_path, seed=2)
    model = load_model(inspect_folder(tmp_path), torch.device("cpu"), torch.float32).model
    rt = Runtime(model, torch.device("cpu"), context=64, chunk=8)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    off = rt.generate(prompt, GREEDY, 6, set(), lambda _t: None, lambda: False).tokens
    for mode in ("auto", "lookup"):
        on = rt.generate(prompt, GREEDY, 6, set(), lambda _t: None, lambda: False, speculative=mode)
        assert on.stats.speculative == "lookup" and on.tokens == off
    for mode, why in (("draft", "needs a draft model"), ("mtp", "not supported for this model")):
        with pytest.raises(EngineFailure) as failure:
            rt.generate(prompt, GREEDY, 6, set(), lambda _t: None, lambda: False, speculative=mode)
        assert failure.value.error.code == ErrorCode.BAD_REQUEST
        assert why in failure.value.error.detail


def test_deepseek_v4_with_a_draft_of_another_vocabulary_is_refused_at_load(
    engine: Engine, folders: dict[str, Path], tmp_path: Path
) -> None:
    make_tiny("deepseek_v4", tmp_path, seed=2)
    refused = engine.load(
        LoadRequest(path=str(tmp_path), device="cpu", context=64, draft=str(folders["draft"]))
    )
    assert not refused.ok and refused.error is not None and refused.error.code == ErrorCode.LOAD_FAILED
    assert "vocabulary" in refused.error.detail


def test_only_drafts_whose_roll_back_undoes_graph_steps_get_graphs(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """Dense and Gemma 3 drafts may decode through graphs (their verifies run in one too, and their
    roll-backs put back cache rows); DeepSeek-V4's and Qwen3.5's roll-backs recompute from what
    their eager steps record: they draft eagerly."""
    from ds4desk.engine.speculative.draft_model import _rolls_back_graph_steps
    from tests.engine.models.qwen3_5 import tiny as qwen35_tiny

    def model(folder: Path) -> object:
        return load_model(inspect_folder(folder), torch.device("cpu"), torch.float32).model

    make_tiny("deepseek_v4", tmp_path / "v4")
    qwen35_tiny.save_tiny(tmp_path / "qwen35")
    assert _rolls_back_graph_steps(model(folders["llama"]))
    assert _rolls_back_graph_steps(model(folders["draft"]))  # Gemma 3
    assert not _rolls_back_graph_steps(model(tmp_path / "v4"))
    assert not _rolls_back_graph_steps(model(tmp_path / "qwen35"))
