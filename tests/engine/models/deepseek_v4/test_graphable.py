"""DeepSeek-V4's CUDA-graph decode step (`decode_graphable`), run eagerly on the CPU: it must equal
forward()'s decode step at every position and span, leave the same state (so eager prefill,
graphable steps, snapshots and eager chunks mix in any order) and never reallocate the cache a
captured graph holds the addresses of."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.make_tiny import TINY_CONFIG, make_tiny, random_state
from ds4desk.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import source_from_folder

CPU = torch.device("cpu")
CONTEXT = 96
BUCKETS = (16, 32, 64, CONTEXT)
# Layer kinds in another order than make_tiny's, a score-routed first layer, and 3 of 8 experts
# active (so the graphable MoE runs every expert by default; make_tiny's 2 of 8 gathers).
OTHER_LAYOUT = {
    "layer_types": [CSA, HCA, SLIDING, CSA],
    "mlp_layer_types": [MOE, HASH_MOE, MOE, HASH_MOE],
    "num_experts_per_tok": 3,
    "index_topk": 4,
}


def write_tiny(folder: Path, seed: int, **overrides: Any) -> ModelSource:
    """make_tiny's random checkpoint (HF layout) for its config with `overrides`."""
    config = {**TINY_CONFIG, **overrides}
    (folder / "config.json").write_text(json.dumps(config))
    state = random_state(config, seed)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return source_from_folder(folder)


@pytest.fixture(scope="module", params=["make_tiny", "other_layout"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "make_tiny":
        make_tiny("deepseek_v4", folder, seed=3)
        return source_from_folder(folder)
    return write_tiny(folder, seed=5, **OTHER_LAYOUT)


def load(source: ModelSource) -> DeepseekV4Model:
    model = load_model(source, CPU, torch.float32).model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(CONTEXT)
    return model


def tokens(source: ModelSource, count: int, seed: int) -> list[int]:
    vocab = source.config["vocab_size"]
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def smallest_bucket(pos: int) -> int:
    return next(span for span in BUCKETS if span > pos)


def tight(pos: int) -> int:
    return pos + 1  # no bucket at all: the fewest rows a step can be given


def full(pos: int) -> int:
    return CONTEXT


class Stepper:
    """Runs graphable steps the way the runtime replays a graph: the same token / pos tensors are
    refilled in place before every step, then the new length is reported."""

    def __init__(self, model: DeepseekV4Model) -> None:
        self.model = model
        self.token = torch.zeros(1, dtype=torch.int64, device=model.device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=model.device)

    def step(self, token: int, pos: int, span: int) -> torch.Tensor:
        self.token.fill_(token)
        self.pos.fill_(pos)
        logits = self.model.decode_graphable(self.token, self.pos, span)
        self.model.set_length(pos + 1)
        return logits


def step_op_names(
    fused: DeepseekV4Model,
    eager: DeepseekV4Model,
    module: Any,
    ids: list[int],
    start: int,
    stop: int,
    span: int,
) -> dict[tuple[bool, int], list[str]]:
    """The aten ops of each graphable step start..stop-1 after a prefill of ids[:start], with
    `module.SWITCH` forced on for `fused` and off for `eager`: {(on, pos): names}."""
    recorded: dict[tuple[bool, int], list[str]] = {}
    with torch.inference_mode():
        for model, on in ((fused, True), (eager, False)):
            model.forward(torch.tensor(ids[:start]), 0, "none")
            stepper = Stepper(model)
            for pos in range(start, stop):
                seen = OpNames()
                with module.SWITCH.force(on), seen:
                    stepper.step(ids[pos], pos, span)
                recorded[(on, pos)] = seen.names
    return recorded


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def assert_same_state(ours: DeepseekV4Model, ref: DeepseekV4Model, length: int) -> None:
    a, b = ours.export_state(length), ref.export_state(length)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("spans", [smallest_bucket, full, tight])
@pytest.mark.parametrize("prefill", [1, 13])
def test_graphable_steps_equal_forward_steps(source: ModelSource, prefill: int, spans) -> None:
    graphable, eager = load(source), load(source)
    window = graphable.config.sliding_window
    steps = 3 * window + 4 * graphable.config.index_topk + 3  # the ring wraps, top-k really selects
    assert prefill + steps <= CONTEXT
    prompt = torch.tensor(tokens(source, prefill, seed=prefill))
    stepper = Stepper(graphable)
    with torch.inference_mode():
        first = graphable.forward(prompt, 0, "last")
        assert torch.equal(first, eager.forward(prompt, 0, "last"))
        ours_next = ref_next = int(first.argmax())
        for pos in range(prefill, prefill + steps):
            ours = stepper.step(ours_next, pos, spans(pos))
            ref = eager.forward(torch.tensor([ref_next]), pos, "last")
            assert ours.shape == ref.shape == (graphable.vocab_size,) and ours.dtype == torch.float32
            assert relative_error(ours, ref) < 1e-5, pos
            ours_next, ref_next = int(ours.argmax()), int(ref.argmax())
            assert ours_next == ref_next, pos
        assert_same_state(graphable, eager, prefill + steps)


@pytest.mark.parametrize("dense", [True, False])
def test_both_moe_strategies_match(source: ModelSource, dense: bool) -> None:
    graphable, eager = load(source), load(source)
    graphable.graph_dense_moe = dense
    ids = tokens(source, 40, seed=7)
    stepper = Stepper(graphable)
    with torch.inference_mode():
        graphable.forward(torch.tensor(ids[:5]), 0, "none")
        eager.forward(torch.tensor(ids[:5]), 0, "none")
        for pos in range(5, len(ids)):
            ours = stepper.step(ids[pos], pos, smallest_bucket(pos))
            ref = eager.forward(torch.tensor([ids[pos]]), pos, "last")
            assert relative_error(ours, ref) < 1e-5, pos


def test_graphable_steps_mix_with_snapshots_and_eager_chunks(source: ModelSource) -> None:
    mixed, uninterrupted = load(source), load(source)
    ids = tokens(source, 80, seed=11)
    with torch.inference_mode():
        reference = uninterrupted.forward(torch.tensor(ids), 0, "all")
        stepper = Stepper(mixed)

        def graphable_steps(start: int, stop: int) -> None:
            for pos in range(start, stop):
                logits = stepper.step(ids[pos], pos, smallest_bucket(pos))
                assert relative_error(logits, reference[pos]) < 1e-5, pos

        def eager_chunk(start: int, stop: int) -> None:
            logits = mixed.forward(torch.tensor(ids[start:stop]), start, "all")
            assert relative_error(logits, reference[start:stop]) < 1e-5, start

        eager_chunk(0, 6)
        graphable_steps(6, 23)
        snapshot = mixed.export_state(23)
        graphable_steps(23, 41)  # past the snapshot: rings wrap, windows close
        mixed.import_state(snapshot, 23)
        graphable_steps(23, 30)  # the restored state continues exactly
        eager_chunk(30, 37)  # a prefill chunk after graphable steps (closes windows mid-chunk)
        graphable_steps(37, 50)
        mixed.import_state(snapshot, 23)
        eager_chunk(23, 45)  # the restored graphable state, continued eagerly
        eager_chunk(45, 46)
        graphable_steps(46, 80)


def test_the_step_keeps_every_cache_tensor_in_place(source: ModelSource) -> None:
    model = load(source)
    cache = model.cache
    assert cache is not None and type(model).supports_graphs
    held = [*cache.tensors(), *(t for pair in model._tables.values() for t in pair)]
    addresses = [t.data_ptr() for t in held]
    ids = tokens(source, 40, seed=13)
    stepper = Stepper(model)
    inputs = (stepper.token, stepper.pos)
    with torch.inference_mode():
        model.forward(torch.tensor(ids[:3]), 0, "none")
        seen = []
        for pos in range(3, 40):
            # The same two input tensors every step, only their values change (as in a replay).
            seen.append(stepper.step(ids[pos], pos, 64 if pos < 64 else CONTEXT))
        snapshot = model.export_state(40)
        model.import_state(snapshot, 20)
        model.import_state(snapshot, 40)
        stepper.step(ids[0], 40, 64)
    now = [*cache.tensors(), *(t for pair in model._tables.values() for t in pair)]
    assert all(a is b for a, b in zip(held, now, strict=True))
    assert [t.data_ptr() for t in now] == addresses
    assert model.cache is cache and (stepper.token, stepper.pos) == inputs
    # Different positions really gave different steps (the pos tensor's value was read).
    assert not any(torch.equal(seen[i], seen[i + 1]) for i in range(len(seen) - 1))


class OpRecorder(TorchDispatchMode):
    """Every aten op a call dispatches, with its output shapes, dtypes and devices."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, tuple | list) else (out,)
        described = tuple(
            (tuple(r.shape), r.dtype, r.device.type) if isinstance(r, torch.Tensor) else type(r).__name__
            for r in results
        )
        self.ops.append((func.__name__, described))
        return out


# What a graph cannot capture: a device value read on the host, a data-dependent shape, a tensor
# made from Python data (a host-to-device copy).
HOST_BOUND = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "lift_fresh", "tolist")


def test_every_step_of_a_span_runs_the_same_ops_on_the_same_shapes(source: ModelSource) -> None:
    """What a capture records at one position is what the step does at any other: the same op
    sequence with the same shapes, and nothing that syncs with the host or copies from it."""
    model = load(source)
    ids = tokens(source, 60, seed=23)
    stepper = Stepper(model)
    # Before and after the ring wraps (8), at CSA (4) and HCA (8) window closings, in between, and
    # past index_topk visible rows; the steps between are run unrecorded.
    watched = {2, 3, 4, 6, 7, 8, 11, 15, 16, 17, 23, 31, 34, 47, 55, 59}
    recorded: dict[int, list[tuple[str, tuple]]] = {}
    with torch.inference_mode():
        model.forward(torch.tensor(ids[:2]), 0, "none")
        for pos in range(2, 60):
            if pos not in watched:
                stepper.step(ids[pos], pos, 64)
                continue
            recorder = OpRecorder()
            with recorder:
                stepper.step(ids[pos], pos, 64)
            recorded[pos] = recorder.ops
    first = recorded[2]
    assert len(first) > 100 and recorded.keys() == watched
    for pos, ops in recorded.items():
        assert ops == first, pos
    names = {name for name, _ in first}
    assert not [name for name in names if name.startswith(HOST_BOUND)]
    assert "topk.default" in names and "index_copy_.default" in names


def test_the_length_is_invalid_until_reported(source: ModelSource) -> None:
    model = load(source)
    ids = tokens(source, 6, seed=17)
    with torch.inference_mode():
        model.forward(torch.tensor(ids[:5]), 0, "none")
        model.decode_graphable(torch.tensor([ids[5]]), torch.tensor([5]), 16)
        with pytest.raises(EngineFailure) as info:
            model.forward(torch.tensor([ids[5]]), 6, "last")
        assert info.value.error.code == ErrorCode.BAD_REQUEST
        with pytest.raises(EngineFailure):
            model.export_state(6)
        model.set_length(6)
        assert model.forward(torch.tensor([ids[5]]), 6, "last") is not None
    with pytest.raises(ValueError, match="span"):
        model.decode_graphable(torch.tensor([1]), torch.tensor([7]), CONTEXT + 1)
    with pytest.raises(ValueError, match="length"):
        model.set_length(CONTEXT + 1)


@pytest.mark.parametrize("context", [6, 13])
def test_contexts_that_end_inside_a_compressed_window(tmp_path: Path, context: int) -> None:
    """Context 6: no HCA row exists at all (rate 8). Context 13: the last positions' window has no
    row (13 // 8 = 1), so the step's unconditional write must leave row 0, already visible, intact."""
    make_tiny("deepseek_v4", tmp_path, seed=1)
    source = source_from_folder(tmp_path)
    models = []
    for _ in range(2):
        model = load_model(source, CPU, torch.float32).model
        assert isinstance(model, DeepseekV4Model)
        model.allocate_cache(context)
        models.append(model)
    graphable, eager = models
    ids = tokens(source, context, seed=19)
    stepper = Stepper(graphable)
    with torch.inference_mode():
        graphable.forward(torch.tensor(ids[:1]), 0, "none")
        eager.forward(torch.tensor(ids[:1]), 0, "none")
        for pos in range(1, context):
            ours = stepper.step(ids[pos], pos, context)
            assert relative_error(ours, eager.forward(torch.tensor([ids[pos]]), pos, "last")) < 1e-5, pos
        assert_same_state(graphable, eager, context)


PIECE = 16  # DeepseekV4Model.prefill_piece_tokens


def assert_same_carried_state(ours: DeepseekV4Model, ref: DeepseekV4Model, length: int) -> None:
    """assert_same_state over what a later position reads: of each compressor's open window
    (carry tensors 0 and 1) only the rows of positions already fed (length mod rate); the rest
    is left over from earlier windows, differently by a chunk and by steps, and always rewritten
    before the window closes."""
    a, b = ours.export_state(length), ref.export_state(length)
    assert a.keys() == b.keys()
    for name in a:
        layer, *part = name.split(".")
        ours_t, ref_t = a[name], b[name]
        if part[0] in ("compressor", "indexer") and part[1] in ("0", "1"):
            fed = length % ours.config.rate(ours.config.layer_types[int(layer)])
            ours_t, ref_t = ours_t[:fed], ref_t[:fed]
        assert torch.allclose(ours_t, ref_t, rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("dense", [None, False])
@pytest.mark.parametrize(("start", "real"), [(0, 16), (0, 5), (9, 3), (14, 1), (37, 11)])
def test_a_padded_prompt_piece_equals_forward(source: ModelSource, start: int, real: int, dense) -> None:
    """A piece of `real` tokens padded to 16 (the padding random ids, not zeros) leaves the state
    forward leaves for those tokens alone, returns its last logits, and decoding on from it equals
    decoding on from forward. Pieces cross CSA and HCA window ends and wrap the sliding ring."""
    piece, eager = load(source), load(source)
    piece.graph_dense_moe = dense
    ids = tokens(source, start + real + 8, seed=start + real)
    padding = tokens(source, PIECE - real, seed=99)
    with torch.inference_mode():
        if start:
            piece.forward(torch.tensor(ids[:start]), 0, "none")
            eager.forward(torch.tensor(ids[:start]), 0, "none")
        ref = eager.forward(torch.tensor(ids[start : start + real]), start, "last")
        ours = piece.prefill_graphable(
            torch.tensor(ids[start : start + real] + padding),
            torch.tensor([start]),
            torch.tensor([real]),
            smallest_bucket(start + PIECE - 1),
        )
        assert ours is not None and ours.shape == ref.shape and ours.dtype == torch.float32
        assert relative_error(ours, ref) < 1e-5
        piece.set_length(start + real)
        assert_same_carried_state(piece, eager, start + real)
        stepper = Stepper(piece)
        for pos in range(start + real, len(ids)):
            ours = stepper.step(ids[pos], pos, smallest_bucket(pos))
            ref = eager.forward(torch.tensor([ids[pos]]), pos, "last")
            assert relative_error(ours, ref) < 1e-5, pos


def test_a_split_model_has_no_prompt_piece_step(source: ModelSource) -> None:
    model = load(source)
    model._boundaries = {2: CPU}  # what a split leaves; its pieces run eagerly
    with torch.inference_mode():
        step = model.prefill_graphable(
            torch.zeros(PIECE, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            32,
        )
    assert step is None
