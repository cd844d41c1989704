"""A model's layers split into contiguous shards (ds4desk.engine.split), tested on the CPU with
several shards on the "cpu" device: the same ops run in the same order, so every logit must be
bit-identical to the unsplit model's, through chunked prefill, decode steps, the graphable decode
step and snapshots; the hand-off between shards is a real copy. Plus the split planner, the
explicit split's checks, and the engine, CLI and settings wiring."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ds4desk.cli import build_parser
from ds4desk.cli import main as cli_main
from ds4desk.engine import Engine, ErrorCode, GenerateRequest, LoadRequest, SaveSnapshot
from ds4desk.engine.api import EngineFailure, FinishReason, SamplingParams, ThinkingBudget
from ds4desk.engine.graphs import graphs_wanted
from ds4desk.engine.loader import check_tensors, load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models import base
from ds4desk.engine.models.llama import model as llama
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.split import (
    ShardPlan,
    explicit_plan,
    model_bytes,
    needed_per_device,
    parse_devices,
    parse_layer_split,
    plan_for,
    plan_split,
)
from ds4desk.settings import Settings
from tests.engine.tiny_dense import save_tiny, source_from_folder

CPU = torch.device("cpu")
CONTEXT = 64
TOKENIZER = Path(__file__).with_name("tiny_tokenizer.json")


# ---- the models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek_v4"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v4":
        make_tiny("deepseek_v4", folder, seed=3)  # 4 layers: sliding, CSA, HCA, CSA
        return source_from_folder(folder)
    # Three layers, so three shards of one layer each exist; llama ties its head, qwen3 does not.
    _, found = save_tiny(
        request.param, folder, num_hidden_layers=3, tie_word_embeddings=request.param == "llama"
    )
    return found


def plans_for(source: ModelSource) -> list[ShardPlan]:
    layers = source.config["num_hidden_layers"]
    two = ShardPlan(("cpu", "cpu"), (layers - 1, 1))
    three = ShardPlan(("cpu",) * 3, (1, layers - 2, 1))
    return [two, three, ShardPlan(("cpu", "cpu"), (1, layers - 1))]


def load(source: ModelSource, split: ShardPlan | None = None) -> Any:
    model = load_model(source, CPU, torch.float32, split=split).model
    model.allocate_cache(CONTEXT)
    return model


def prompt(source: ModelSource, count: int, seed: int) -> torch.Tensor:
    vocab = source.config["vocab_size"]
    return torch.randint(2, vocab, (count,), generator=torch.Generator().manual_seed(seed))


def graph_step(model: Any, token: torch.Tensor, pos: int) -> torch.Tensor:
    """decode_graphable as the graph runner drives it (V4 learns its length afterwards)."""
    logits = model.decode_graphable(token.view(1), torch.tensor([pos]), CONTEXT)
    model.set_length(pos + 1)
    return logits


def run(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill in uneven chunks (every position's logits), then eager and graphable decode steps
    fed their own greedy picks: every logit vector along the way."""
    out = [model(ids[:7], 0, "all"), model(ids[7:19], 7, "all"), model(ids[19:], 19, "all")]
    token = out[-1][-1].argmax().view(1)
    pos = ids.shape[0]
    for step in range(8):
        logits = model(token, pos, "last") if step % 2 == 0 else graph_step(model, token, pos)
        out.append(logits)
        token = logits.argmax().view(1)
        pos += 1
    return out


def test_split_logits_equal_the_unsplit_model_exactly(source: ModelSource) -> None:
    ids = prompt(source, 23, seed=1)
    expected = run(load(source), ids)
    for plan in plans_for(source):
        model = load(source, plan)
        got = run(model, ids)
        assert len(got) == len(expected)
        for step, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a, b), f"{plan.layers}: step {step} differs"


def test_every_layer_lives_with_its_shard(source: ModelSource) -> None:
    plan = ShardPlan(("cpu", "cpu", "cpu"), (1, source.config["num_hidden_layers"] - 2, 1))
    model = load(source, plan)
    assert model.split == plan
    if isinstance(model, llama.DenseModel):
        assert [len(shard.plans) for shard in model._shards] == list(plan.layers)
        assert [shard.first for shard in model._shards] == [True, False, False]
        assert all(
            shard.cache is not None and shard.cache.shape[0] == n
            for shard, n in zip(model._shards, plan.layers, strict=True)
        )
    else:
        assert sorted(model._boundaries) == [start for start, _ in plan.bounds()[1:]]
    # Where each parameter goes, by name.
    named = ShardPlan(("cuda:0", "cuda:1", "cpu"), plan.layers)
    layer_devices = named.layer_devices()
    for name, _ in model.named_parameters():
        if name.startswith("model.layers."):
            assert named.device_of(name) == layer_devices[int(name.split(".")[2])]
        elif "embed_tokens" in name:
            assert named.device_of(name) == "cuda:0"
        else:
            assert named.device_of(name) == "cpu"  # norm, hyper-connection head, lm_head: the last


@pytest.fixture
def hand_overs(
    source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (input, output) of the shard hand-off, recorded."""
    # Both families hand over through base.hand_over (their forward and base's decode_graphable).
    real: Callable[[torch.Tensor, torch.device], torch.Tensor] = base.hand_over
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = real(x, device)
        seen.append((x, out))
        return out

    monkeypatch.setattr(base, "hand_over", spy)
    return seen


def test_the_hand_off_copies_at_every_boundary_and_never_aliases(
    source: ModelSource, hand_overs: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    plan = ShardPlan(("cpu",) * 3, (1, source.config["num_hidden_layers"] - 2, 1))
    model = load(source, plan)
    v4 = source.architecture.startswith("Deepseek")
    model(prompt(source, 9, seed=2), 0, "last")
    # Dense hands over the hidden state; V4 the hyper-connection streams and the token ids.
    assert len(hand_overs) == (2 * 2 if v4 else 2)
    if v4:
        streams = [out for x, out in hand_overs if x.is_floating_point()]
        assert all(s.shape == (9, source.config["hc_mult"], source.config["hidden_size"]) for s in streams)
    for x, out in hand_overs:
        assert torch.equal(x, out)
        assert out.data_ptr() != x.data_ptr()  # a copy into the next shard's own tensor
    hand_overs.clear()
    graph_step(model, torch.tensor([5]), 9)
    # The graphable step also hands over the position tensor: each shard's graph has its own.
    assert len(hand_overs) == (2 * 3 if v4 else 2 * 2)
    assert all(out.data_ptr() != x.data_ptr() for x, out in hand_overs)


def test_a_snapshot_of_the_split_model_restores_and_continues_exactly(source: ModelSource) -> None:
    ids = prompt(source, 21, seed=3)

    def greedy(model: Any, logits: torch.Tensor, pos: int, steps: int) -> list[torch.Tensor]:
        out = []
        for _ in range(steps):
            token = logits.argmax().view(1)
            logits = model(token, pos, "last")
            out.append(logits)
            pos += 1
        return out

    reference = load(source)
    reference(ids[:10], 0, "none")  # chunked as the split model is: other chunks round differently
    first = reference(ids[10:], 10, "last")
    unsplit_state = reference.export_state(ids.shape[0])
    expected = greedy(reference, first, ids.shape[0], 6)

    plans = plans_for(source)
    split = load(source, plans[0])
    assert split(ids[:10], 0, "none") is None
    logits = split(ids[10:], 10, "last")
    assert torch.equal(logits, first)
    state = split.export_state(ids.shape[0])
    # The snapshot holds every shard's part: the same host payload the unsplit model exports.
    assert state.keys() == unsplit_state.keys()
    assert all(state[k].device == CPU and torch.equal(state[k], unsplit_state[k]) for k in state)

    # Restored into the split model after another request overwrote its cache, into another split
    # and into the unsplit model: each continues exactly as the uninterrupted run.
    split(prompt(source, 17, seed=4), 0, "last")
    for target in (split, load(source, plans[1]), load(source)):
        target.import_state(state, ids.shape[0])
        assert all(
            torch.equal(a, b) for a, b in zip(greedy(target, logits, ids.shape[0], 6), expected, strict=True)
        )


def test_cancel_and_the_thinking_budget_act_on_a_split_model_as_on_one_device(source: ModelSource) -> None:
    """Runtime-level: a cancel mid-decode keeps the same partial tokens, and a thinking budget forces
    its close tokens at the same step, split or not."""
    ids = prompt(source, 12, seed=4).tolist()
    greedy = SamplingParams()
    outcomes = []
    for split in (None, plans_for(source)[1]):
        runtime = Runtime(load(source, split), CPU, CONTEXT, chunk=5)
        seen: list[int] = []
        cancelled = runtime.generate(ids, greedy, 20, set(), seen.append, lambda seen=seen: len(seen) >= 3)
        assert cancelled.finish_reason == FinishReason.CANCELLED and cancelled.tokens == seen
        budget = ThinkingBudget(max_tokens=3, close_tokens=[7, 8])
        forced = runtime.generate(ids, greedy, 10, set(), lambda _t: None, lambda: False, budget)
        outcomes.append((cancelled.tokens, forced.tokens, forced.budget_forced_close))
        runtime.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][2] and outcomes[0][1][3:5] == [7, 8]  # forced after 3 thinking tokens


def test_place_needs_the_layer_count_and_a_model_not_materialized_yet(source: ModelSource) -> None:
    layers = source.config["num_hidden_layers"]
    meta, _ = check_tensors(source)
    with pytest.raises(EngineFailure) as failure:
        meta.place(ShardPlan(("cpu", "cpu"), (1, layers)))
    assert failure.value.error.code == ErrorCode.BAD_REQUEST
    assert f"covers {layers + 1} layers; the model has {layers}" in failure.value.error.detail
    loaded = load(source)
    with pytest.raises(RuntimeError, match="before materialize"):
        loaded.place(ShardPlan(("cpu", "cpu"), (1, layers - 1)))


# ---- the planner ----------------------------------------------------------------------------------


def worst_fill(counts: tuple[int, ...], layers: list[int], first: int, last: int, free: list[int]) -> float:
    plan = ShardPlan(tuple(f"cuda:{i}" for i in range(len(counts))), counts)
    needs = needed_per_device(plan, layers, first, last)
    return max(needs[d] / f for d, f in zip(plan.devices, free, strict=True))


def test_plan_split_balances_bytes_on_equal_devices() -> None:
    assert plan_split([10] * 8, 0, 0, [1000, 1000]) == (4, 4)
    assert plan_split([10] * 9, 0, 0, [1000] * 3) == (3, 3, 3)
    # The embedding on the first device and the head on the last take the place of layers.
    assert plan_split([10] * 10, 20, 0, [1000, 1000]) == (4, 6)
    assert plan_split([10] * 10, 0, 20, [1000, 1000]) == (6, 4)
    # Uneven layers: by bytes, not by count.
    assert plan_split([40, 10, 10, 10, 10], 0, 0, [1000, 1000]) == (1, 4)


def test_plan_split_respects_each_devices_free_memory() -> None:
    layers = [10] * 10
    counts = plan_split(layers, 5, 5, [105, 30])
    assert sum(counts) == 10 and all(c >= 1 for c in counts)
    assert worst_fill(counts, layers, 5, 5, [105, 30]) <= 1.0
    assert counts == (8, 2)  # the second device holds 2 layers and the head, 25 of its 30 bytes


def test_plan_split_is_the_best_contiguous_split() -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(30):
        count = int(torch.randint(3, 9, (1,), generator=generator))
        devices = int(torch.randint(1, 4, (1,), generator=generator))
        layers = torch.randint(1, 50, (count,), generator=generator).tolist()
        first, last = (int(v) for v in torch.randint(0, 60, (2,), generator=generator))
        free = torch.randint(150, 400, (devices,), generator=generator).tolist()
        options = [
            cuts for cuts in itertools.product(range(1, count + 1), repeat=devices) if sum(cuts) == count
        ]
        best = min(worst_fill(c, layers, first, last, free) for c in options)
        if best > 1.0:
            with pytest.raises(EngineFailure):
                plan_split(layers, first, last, free)
            continue
        chosen = plan_split(layers, first, last, free)
        assert sum(chosen) == count and all(c >= 1 for c in chosen)
        assert worst_fill(chosen, layers, first, last, free) == pytest.approx(best)


def test_plan_split_refuses_what_cannot_fit() -> None:
    with pytest.raises(EngineFailure) as failure:
        plan_split([10] * 10, 0, 0, [40, 40])
    assert failure.value.error.code == ErrorCode.OUT_OF_MEMORY
    assert "no split of its 10 layers fits" in failure.value.error.detail
    # Enough in total, but one layer is larger than any device.
    with pytest.raises(EngineFailure):
        plan_split([10, 100, 10], 0, 0, [90, 90])
    with pytest.raises(EngineFailure) as failure:
        plan_split([10, 10], 0, 0, [100, 100, 100])
    assert failure.value.error.code == ErrorCode.BAD_REQUEST
    assert "3 devices need at least 3 layers" in failure.value.error.detail


@pytest.mark.parametrize(
    ("devices", "counts", "message"),
    [
        (("cpu", "cpu"), (2, 2), "covers 4 layers; the model has 3"),
        (("cpu", "cpu"), (3,), "lists 1 counts for 2 devices"),
        (("cpu", "cpu"), (3, 0), "every shard needs at least one layer"),
        (("cpu", "gpu0"), (2, 1), "'gpu0' is not a device"),
        ((), (), "at least one device"),
    ],
)
def test_explicit_split_errors_are_bad_requests(
    devices: tuple[str, ...], counts: tuple[int, ...], message: str
) -> None:
    with pytest.raises(EngineFailure) as failure:
        explicit_plan(devices, counts, 3)
    assert failure.value.error.code == ErrorCode.BAD_REQUEST
    assert message in failure.value.error.detail


def test_parsing_devices_and_layer_split() -> None:
    assert parse_devices("cuda:0, CUDA:1") == ("cuda:0", "cuda:1")
    assert parse_layer_split("22,21") == (22, 21)
    for bad in ("22,-1", "22,x", "22,,21", "0"):
        with pytest.raises(EngineFailure, match="positive layer counts"):
            parse_layer_split(bad)
    with pytest.raises(EngineFailure, match="not a device"):
        parse_devices("cuda:0,tpu")


def test_model_bytes_places_weights_and_caches(source: ModelSource) -> None:
    meta, _ = check_tensors(source)
    layers, first, last = model_bytes(meta, CONTEXT)
    caches = meta.layer_cache_bytes_for(CONTEXT)
    total = sum(p.numel() * p.element_size() for p in meta.parameters())
    tied = first if "lm_head.weight" not in dict(meta.named_parameters()) else 0
    assert sum(layers) + first + last == total + sum(caches) + tied
    assert first == meta.model.embed_tokens.weight.numel() * 4
    assert all(size > cache > 0 for size, cache in zip(layers, caches, strict=True))
    plan, needs = plan_for(("cpu", "cpu"), None, meta, CONTEXT, lambda _d: 2**40)
    assert sum(plan.layers) == len(layers) and needs == {"cpu": sum(layers) + first + last}


def test_a_split_over_several_gpus_keeps_its_graphs(source: ModelSource) -> None:
    """Every model decodes shard by shard (decode_shard is part of the model contract), so a split
    over several GPUs is captured as one graph per shard: the split never turns graphs off, the
    setting and the device do."""
    layers = source.config["num_hidden_layers"]
    meta, _ = check_tensors(source)
    assert meta.supports_graphs
    meta.place(ShardPlan(("cuda:0", "cuda:1"), (1, layers - 1)))
    assert meta.split is not None and meta.split.multi_device
    cuda = torch.device("cuda", 0)
    assert graphs_wanted(True, cuda, meta)
    assert not graphs_wanted(False, cuda, meta)
    assert graphs_wanted(None, cuda, meta) == (torch.version.hip is None)
    assert not graphs_wanted(True, CPU, meta)
    meta.supports_graphs = False  # a family whose decode step cannot be captured
    assert not graphs_wanted(True, cuda, meta)


# ---- the engine, the CLI and the settings ---------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-engine")
    save_tiny("llama", folder)  # 3 layers
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = Engine()
    yield engine
    engine.close()


PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(20)]


def greedy_tokens(engine: Engine, request: LoadRequest, **generate: Any) -> list[int]:
    loaded = engine.load(request)
    assert loaded.ok, loaded.error
    result = engine.generate(
        GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=12, stop_tokens=[], **generate)
    )
    assert result.ok, result.error
    assert len(result.tokens) == 12
    return result.tokens


def test_the_engine_loads_a_split_and_generates_the_same_tokens(engine: Engine, llama_folder: Path) -> None:
    path = str(llama_folder)
    unsplit = greedy_tokens(engine, LoadRequest(path=path, context=CONTEXT, chunk=6))
    split = LoadRequest(path=path, context=CONTEXT, chunk=6, devices=("cpu", "cpu"), layer_split=(2, 1))
    assert greedy_tokens(engine, split) == unsplit
    info = engine.model_info
    assert info is not None and info.device == "cpu,cpu"
    # A snapshot saved on the split model is restored by the next request: no prefill of its prompt.
    saved = engine.generate(
        GenerateRequest(
            prompt_tokens=PROMPT, max_new_tokens=12, stop_tokens=[], save_snapshot=SaveSnapshot(at=15)
        )
    )
    assert saved.ok and saved.tokens == unsplit
    again = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=12, stop_tokens=[]))
    assert again.ok and again.stats.reused_tokens == 15 and again.tokens == unsplit
    # Park and unpark keep the split; the automatic split plans one too.
    assert engine.park().ok and engine.unpark().ok
    assert (
        greedy_tokens(engine, LoadRequest(path=path, context=CONTEXT, devices=("cpu", "cpu", "cpu")))
        == unsplit
    )


def test_the_engine_splits_deepseek_v4(engine: Engine, tmp_path: Path) -> None:
    folder = tmp_path / "v4"
    make_tiny("deepseek_v4", folder, seed=3)
    unsplit = greedy_tokens(engine, LoadRequest(path=str(folder), context=CONTEXT, chunk=5))
    split = LoadRequest(
        path=str(folder), context=CONTEXT, chunk=5, devices=("cpu", "cpu"), layer_split=(3, 1)
    )
    assert greedy_tokens(engine, split) == unsplit


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_the_engine_runs_a_split_over_two_gpus_with_a_graph_per_shard(
    engine: Engine, llama_folder: Path, tmp_path: Path, family: str
) -> None:
    """Through the engine on two GPUs: one captured graph per shard decodes what the unsplit model's
    graph decodes, a snapshot taken on the split model is reused, and park / unpark recapture."""
    folder, layer_split = llama_folder, (2, 1)
    if family == "deepseek_v4":
        folder, layer_split = tmp_path / "v4", (2, 2)
        make_tiny("deepseek_v4", folder, seed=3)
    common = {"path": str(folder), "dtype": "float32", "context": CONTEXT, "chunk": 5, "cuda_graphs": True}
    unsplit = greedy_tokens(engine, LoadRequest(device="cuda:0", **common))
    split = LoadRequest(devices=("cuda:0", "cuda:1"), layer_split=layer_split, **common)
    assert greedy_tokens(engine, split) == unsplit
    runtime = engine._loaded.runtime  # type: ignore[union-attr]
    assert runtime.graphs is not None and len(runtime.graphs.devices) == 2
    saved = engine.generate(
        GenerateRequest(
            prompt_tokens=PROMPT, max_new_tokens=12, stop_tokens=[], save_snapshot=SaveSnapshot(at=15)
        )
    )
    assert saved.ok and saved.tokens == unsplit
    again = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=12, stop_tokens=[]))
    assert again.ok and again.stats.reused_tokens == 15 and again.tokens == unsplit
    assert engine.park().ok and engine.unpark().ok
    after = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=12, stop_tokens=[]))
    assert after.ok and after.tokens == unsplit
    assert engine._loaded.runtime.graphs is not None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("devices", "layer_split", "message"),
    [
        (("cpu", "cpu"), (2, 2), "covers 4 layers; the model has 3"),
        (("cpu", "cpu"), (1, 1, 1), "lists 3 counts for 2 devices"),
        (("cpu", "npu"), (2, 1), "'npu' is not a device"),
        (None, (2, 1), "needs the devices"),
        (("cpu",) * 4, None, "4 devices need at least 4 layers"),
    ],
)
def test_bad_splits_are_refused_and_the_loaded_model_stays(
    engine: Engine,
    llama_folder: Path,
    devices: tuple[str, ...] | None,
    layer_split: tuple[int, ...] | None,
    message: str,
) -> None:
    path = str(llama_folder)
    assert engine.load(LoadRequest(path=path, context=CONTEXT)).ok
    refused = engine.load(LoadRequest(path=path, context=CONTEXT, devices=devices, layer_split=layer_split))
    assert refused.error is not None and refused.error.code == ErrorCode.BAD_REQUEST
    assert message in refused.error.detail
    assert engine.generate(GenerateRequest(prompt_tokens=PROMPT[:5], max_new_tokens=2)).ok


def test_cli_flags_and_check(llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["generate", "--raw", "hi", "--devices", "cuda:0,cuda:1", "--layer-split", "22,21"]
    )
    assert args.devices == ("cuda:0", "cuda:1") and args.layer_split == (22, 21)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--raw", "hi", "--layer-split", "22,zero"])
    capsys.readouterr()
    data = ["--data-dir", str(tmp_path / "data")]
    code = cli_main(["check", str(llama_folder), "--devices", "cpu,cpu", "--layer-split", "2,1", *data])
    out = capsys.readouterr().out
    assert code == 0 and "layer split (256-token cache): cpu: 2 layers, cpu: 1 layers" in out
    code = cli_main(["check", str(llama_folder), "--devices", "cpu,cpu", "--layer-split", "2,2", *data])
    assert code == 2 and "covers 4 layers; the model has 3" in capsys.readouterr().err
    code = cli_main(
        ["generate", str(llama_folder), "--prompt-tokens", "5,6,7", "--max-tokens", "3", "--json",
         "--devices", "cpu,cpu", "--layer-split", "1,2", *data]
    )  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["error"] is None and len(result["tokens"]) == 3


def test_settings_carry_a_validated_split(tmp_path: Path) -> None:
    settings = Settings(devices=["cuda:0", "cuda:1"], layer_split=[22, 21])
    request = settings.load_request()
    assert request.devices == ("cuda:0", "cuda:1") and request.layer_split == (22, 21)
    assert settings.load_request(device="cpu").devices is None  # a one-off device wins
    assert Settings().load_request().devices is None
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"devices": ["cuda:0", "tpu"], "layer_split": [3, 0]}))
    loaded = Settings.load(path)
    assert loaded.devices == [] and loaded.layer_split == []
    path.write_text(json.dumps({"devices": ["cpu", "cuda:1"], "layer_split": [2, 1]}))
    loaded = Settings.load(path)
    assert loaded.devices == ["cpu", "cuda:1"] and loaded.layer_split == [2, 1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_over_two_gpus_equals_one_gpu(source: ModelSource, dtype: torch.dtype) -> None:
    """The same model on cuda:0, and split over cuda:0 + cuda:1 in both orders: bit-identical logits
    (the hand-off is a plain copy; every shard runs the same kernels as the unsplit model)."""
    layers = source.config["num_hidden_layers"]
    ids = prompt(source, 23, seed=1).to("cuda:0")

    def on_gpus(split: ShardPlan | None) -> list[torch.Tensor]:
        model = load_model(source, torch.device("cuda:0"), dtype, split=split).model
        model.allocate_cache(CONTEXT)
        out = [model(ids[:7], 0, "all"), model(ids[7:], 7, "all")]
        token = out[-1][-1].argmax().view(1)
        for pos in range(ids.shape[0], ids.shape[0] + 6):
            out.append(model(token, pos, "last"))
            token = out[-1].argmax().view(1)
        return [t.cpu() for t in out]

    expected = on_gpus(None)
    for plan in (
        ShardPlan(("cuda:0", "cuda:1"), (layers - 1, 1)),
        ShardPlan(("cuda:1", "cuda:0"), (1, layers - 1)),
    ):
        got = on_gpus(plan)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), plan
