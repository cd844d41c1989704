"""The graph-capturable decode step: the same math as the eager step, shapes fixed by the span.

On the CPU the step runs eagerly (there is nothing to capture), which checks the math; the GPU
test captures and replays it for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import SamplingParams, SaveSnapshot
from ds4desk.engine.graphs import GraphedDecode, graphs_wanted, span_buckets
from ds4desk.engine.loader import load_model
from ds4desk.engine.runtime import RunOutcome, Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore
from tests.engine.tiny_dense import TINY_CONFIGS, save_tiny, source_from_folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("graph-tiny")
    return {family: save_tiny(family, root / family)[1] for family in TINY_CONFIGS}


def test_span_buckets_cover_the_context() -> None:
    assert span_buckets(100) == [100]
    assert span_buckets(256) == [256]
    assert span_buckets(1000) == [256, 512, 1000]
    assert span_buckets(4096) == [256, 512, 1024, 2048, 4096]


def test_graphs_are_off_on_the_cpu(sources) -> None:
    model = load_model(sources["llama"], torch.device("cpu"), torch.float32).model
    assert not graphs_wanted(True, torch.device("cpu"), model)
    assert not graphs_wanted(None, torch.device("cpu"), model)


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_graphable_step_equals_eager_step(sources, family: str, attention: str) -> None:
    """Prefill, then decode past the sliding window with both steps on two copies of the model:
    the logits agree at every span that covers the position, and so does the cache."""
    device = torch.device("cpu")
    eager = load_model(sources[family], device, torch.float32).model
    graphable = load_model(sources[family], device, torch.float32).model
    graphable.decode_attention = attention
    for model in (eager, graphable):
        model.allocate_cache(64)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    token_buf = torch.zeros(1, dtype=torch.long)
    pos_buf = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        expected = eager.forward(prompt, 0, "last")
        got = graphable.forward(prompt, 0, "last")
        for pos in range(9, 40):
            token = int(torch.argmax(expected))
            assert token == int(torch.argmax(got))
            expected = eager.forward(torch.tensor([token]), pos, "last")
            token_buf.fill_(token)
            pos_buf.fill_(pos)
            # The same tensor objects every step, as a captured graph sees them.
            spans = {pos + 1, 64} if pos % 2 else {64}
            for span in sorted(spans):
                got = graphable.decode_graphable(token_buf, pos_buf, span)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert eager._cache is not None and graphable._cache is not None
    torch.testing.assert_close(graphable._cache[:, :, :, :40], eager._cache[:, :, :, :40])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    """On a GPU: greedy decode through captured graphs equals the eager decode, token for token,
    across span buckets, and a snapshot restored into the captured cache continues exactly."""
    source = save_tiny("llama", tmp_path / "llama", max_position_embeddings=1024)[1]
    device = torch.device("cuda")
    results = []
    for graphs in (False, True):
        model = load_model(source, device, torch.float32).model
        runtime = Runtime(model, device, context=1024, chunk=64, graphs=graphs)
        assert (runtime.graphs is not None) == graphs
        if graphs:
            assert isinstance(runtime.graphs, GraphedDecode) and runtime.graphs.spans == [256, 512, 1024]
        prompt = [int(t) for t in torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(5))]
        out = runtime.generate(
            prompt, SamplingParams(temperature=0.0), 400, set(), lambda _t: None, lambda: False
        )
        results.append((out.tokens, out.logprobs))
        runtime.close()
    (eager_tokens, eager_logprobs), (graph_tokens, graph_logprobs) = results
    assert graph_tokens == eager_tokens
    assert max(abs(a - b) for a, b in zip(graph_logprobs, eager_logprobs, strict=True)) < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_greedy_step_chains_its_pick_on_the_device(tmp_path: Path) -> None:
    """step(None, pos) feeds the previous replay's greedy pick at the next position with no launch
    from the host: the same logits as feeding that pick explicitly; anywhere else it refuses."""
    source = save_tiny("llama", tmp_path / "llama", max_position_embeddings=512)[1]
    device = torch.device("cuda")
    runtime = Runtime(load_model(source, device, torch.float32).model, device, context=512, graphs=True)
    graphs = runtime.graphs
    assert graphs is not None
    prompt = list(range(3, 60))
    with torch.inference_mode():
        runtime.prefill_logits(prompt)
        at = len(prompt)
        _, pick = graphs.step(torch.tensor([7], device=device), at)
        picked = int(pick[0].item())
        assert graphs.chains(at + 1) and not graphs.chains(at) and not graphs.chains(at + 2)
        chained = graphs.step(None, at + 1)[0].clone()
        explicit = graphs.step(torch.tensor([picked], device=device), at + 1)[0]
        torch.testing.assert_close(chained, explicit, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="no greedy pick"):
            graphs.step(None, 5)
    runtime.close()


def _greedy(runtime: Runtime, ids: list[int], count: int, **more: object) -> RunOutcome:
    greedy = SamplingParams(temperature=0.0)
    return runtime.generate(ids, greedy, count, set(), lambda _t: None, lambda: False, **more)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "deepseek_v4"])
def test_short_prompts_and_follow_ups_run_on_the_prompt_piece_graphs(tmp_path: Path, family: str) -> None:
    """On a GPU: a short prompt (its last piece padded) and a follow-up's suffix after a snapshot
    kept on the device run on the prompt-piece graphs; a second follow-up so near the end of the
    context that a padded piece would pass it runs eagerly; all answer as the eager runtime does."""
    if family == "llama":
        source = save_tiny("llama", tmp_path / "llama", max_position_embeddings=320)[1]
    else:
        from ds4desk.engine.make_tiny import make_tiny

        make_tiny("deepseek_v4", tmp_path / "v4")
        source = source_from_folder(tmp_path / "v4")
    device = torch.device("cuda")
    prompt = [int(t) for t in torch.randint(0, 256, (180,), generator=torch.Generator().manual_seed(9))]
    results = []
    for graphs in (False, True):
        model = load_model(source, device, torch.float32).model
        runtime = Runtime(model, device, context=320, chunk=64, graphs=graphs)
        store = SnapshotStore(ModelIdentity("tiny", "float32", 320))
        short = _greedy(runtime, prompt[:40], 8)
        first = _greedy(runtime, prompt, 62, snapshots=store, save=SaveSnapshot())
        turn = [*prompt, *first.tokens, 5, 6, 7, 8, 9, 10, 11, 12]
        second = _greedy(runtime, turn, 60, snapshots=store, save=SaveSnapshot())
        assert (second.stats.reused_tokens, second.stats.prefill_tokens) == (241, 9)
        third = _greedy(runtime, [*turn, *second.tokens, 1, 2, 3, 4, 5], 4, snapshots=store)
        assert (third.stats.reused_tokens, third.stats.prefill_tokens) == (309, 6)
        if graphs:
            assert runtime.graphs is not None and set(runtime.graphs._piece_graphs) == {256, 320}
            assert [r.snapshot for r in runtime._resident] == store.list()
        results.append([(out.tokens, out.logprobs) for out in (short, first, second, third)])
        runtime.close()
    for (eager_tokens, eager_logprobs), (graph_tokens, graph_logprobs) in zip(*results, strict=True):
        assert graph_tokens == eager_tokens
        assert max(abs(a - b) for a, b in zip(graph_logprobs, eager_logprobs, strict=True)) < 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_prefill_attention_equals_the_cpu_layout(sources, family: str) -> None:
    """The GPU's flash-shaped prefill attention (switched on here on the CPU) gives the logits of
    the CPU layout, for a first chunk and for chunks that follow earlier ones."""
    device = torch.device("cpu")
    models = [load_model(sources[family], device, torch.float32).model for _ in range(2)]
    models[1].fused_attention = True
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(4))
    outputs = []
    with torch.inference_mode():
        for model in models:
            model.allocate_cache(64)
            model.forward(prompt[:11], 0, "none")
            outputs.append(model.forward(prompt[11:], 11, "all"))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_deepseek_v4_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    """DeepSeek-V4 on a GPU: ring, compressors, indexer and both routings inside captured graphs
    give the eager tokens, past the ring's wrap and across span buckets; a snapshot saved after
    graph steps restores and continues like the eager run."""
    from ds4desk.engine.make_tiny import make_tiny
    from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore

    make_tiny("deepseek_v4", tmp_path / "v4")
    source = source_from_folder(tmp_path / "v4")
    device = torch.device("cuda")
    vocab = source.config["vocab_size"]
    prompt = [int(t) for t in torch.randint(0, vocab, (150,), generator=torch.Generator().manual_seed(7))]
    results = []
    for graphs in (False, True):
        model = load_model(source, device, torch.float32).model
        runtime = Runtime(model, device, context=600, chunk=64, graphs=graphs)
        assert (runtime.graphs is not None) == graphs
        store = SnapshotStore(ModelIdentity("tiny-v4", "float32", 600))
        greedy = SamplingParams(temperature=0.0)
        first = runtime.generate(
            prompt,
            greedy,
            300,
            set(),
            lambda _t: None,
            lambda: False,
            snapshots=store,
            save=SaveSnapshot(),
        )
        follow = [*prompt, *first.tokens[:-1], 5, 6, 7]
        second = runtime.generate(follow, greedy, 40, set(), lambda _t: None, lambda: False, snapshots=store)
        assert second.stats.reused_tokens == len(prompt) + len(first.tokens) - 1
        results.append((first.tokens, second.tokens))
        runtime.close()
    assert results[1] == results[0]
