"""Qwen3.5 on a GPU: decode through captured CUDA graphs (the conv window, the recurrent matrices
and the KV rows all updated in place inside the graph) equals eager decode, and a snapshot
restored into the captured state continues exactly, its suffix (and a short prompt) on the
prompt-piece graphs. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import SamplingParams, SaveSnapshot
from ds4desk.engine.graphs import GraphedDecode
from ds4desk.engine.loader import load_model
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore
from tests.engine.models.qwen3_5.tiny import TINY, save_tiny, save_tiny_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    "variant",
    [
        "dense",
        "moe",  # experts gathered by index inside the graph (32 columns: no GEMV kernel tile fits)
        "moe-kernels",  # the picked experts' rows read by the GEMV kernels
    ],
)
def test_replayed_graphs_give_the_eager_tokens(tmp_path: Path, variant: str) -> None:
    if variant == "dense":
        _, source = save_tiny(tmp_path / "q", seed=3, max_position_embeddings=1024)
    else:
        width = 64 if variant == "moe-kernels" else 32
        _, source = save_tiny_moe(
            tmp_path / "q", seed=3, max_position_embeddings=1024, moe_intermediate_size=width
        )
    device = torch.device("cuda")
    prompt = [
        int(t)
        for t in torch.randint(5, TINY["vocab_size"], (200,), generator=torch.Generator().manual_seed(5))
    ]
    results = []
    for graphs in (False, True):
        model = load_model(source, device, torch.float32).model
        runtime = Runtime(model, device, context=1024, chunk=64, graphs=graphs)
        assert (runtime.graphs is not None) == graphs
        if graphs:
            assert isinstance(runtime.graphs, GraphedDecode)
        store = SnapshotStore(ModelIdentity("q", "float32", 1024))
        out = runtime.generate(
            prompt, GREEDY, 300, set(), lambda _t: None, lambda: False, None, store, True, SaveSnapshot()
        )
        # The next turn from the snapshot taken after the answer, through the same graphs.
        follow = [*prompt, *out.tokens[:-1], 7, 8, 9]
        again = runtime.generate(follow, GREEDY, 40, set(), lambda _t: None, lambda: False, None, store)
        assert again.stats.reused_tokens == len(prompt) + len(out.tokens) - 1
        # A short prompt from position 0 after all that (on the prompt-piece graphs for the dense
        # model: they start its linear layers from zeros, as forward does).
        short = runtime.generate(prompt[:20], GREEDY, 20, set(), lambda _t: None, lambda: False)
        if graphs:
            assert bool(runtime.graphs._piece_graphs) == (variant == "dense")  # type: ignore[union-attr]
        results.append((out.tokens, out.logprobs, again.tokens + short.tokens))
        runtime.close()
    (eager_tokens, eager_logprobs, eager_next), (graph_tokens, graph_logprobs, graph_next) = results
    assert graph_tokens == eager_tokens and graph_next == eager_next
    assert max(abs(a - b) for a, b in zip(graph_logprobs, eager_logprobs, strict=True)) < 1e-3
