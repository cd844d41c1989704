"""The graphable verify step (models/llama/verify.py, graphs.GraphedDecode.verify): the same logits
and cache writes as forward(ids, pos, "all"); on a GPU, speculation through captured verify graphs
gives the tokens of speculation off.

On the CPU the step runs eagerly (nothing to capture), which checks its math with device positions
and a fixed span; the GPU tests capture and replay it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.kernels.dense import decode_attention as fused_decode
from ds4desk.engine.loader import load_model
from ds4desk.engine.runtime import Runtime
from tests.engine.speculative.tiny_pairs import REPEATING
from tests.engine.tiny_dense import TINY_CONFIGS, save_tiny, source_from_folder

CONTEXT = 64


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("verify-tiny")
    return {family: save_tiny(family, root / family)[1] for family in TINY_CONFIGS}


@pytest.mark.parametrize("attention", ["sdpa", "kernel"])
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_graphable_verify_equals_forward(sources, family: str, attention: str) -> None:
    """After the same prompt, verify steps of 1..8 tokens at positions that run past the sliding
    window give forward's logits at every span that holds them, and write the same cache rows;
    with attention under SDPA's mask or through the split-span decode op (its eager body here)."""
    device = torch.device("cpu")
    eager = load_model(sources[family], device, torch.float32).model
    graphable = load_model(sources[family], device, torch.float32).model
    graphable.decode_attention = "triton"
    force = fused_decode.SWITCH.force(attention == "kernel")
    for model in (eager, graphable):
        model.allocate_cache(CONTEXT)
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(7))
    pos_buf = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode(), force:
        for model in (eager, graphable):
            model.forward(ids[:9], 0, "none")
        pos = 9
        for count in (1, 3, 8, 2, 5, 4, 7, 6):
            chunk = ids[pos : pos + count]
            expected = eager.forward(chunk, pos, "all")
            pos_buf.fill_(pos)
            for span in sorted({pos + count, CONTEXT}):
                got = graphable.verify_graphable(chunk, pos_buf, span)
                assert got is not None and got.shape == (count, eager.vocab_size)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            pos += count
    assert eager._cache is not None and graphable._cache is not None
    torch.testing.assert_close(graphable._cache[:, :, :, :pos], eager._cache[:, :, :, :pos])


def test_gemma3_graphable_verify_equals_forward(tmp_path: Path) -> None:
    """Gemma 3 (a 5-position window: local layers keep a ring of 5 rows): verify steps of 1..5
    tokens at positions before and long past the ring's first wrap give forward's logits at every
    span that holds them, and leave the same global rows and ring rows."""
    from tests.engine.models.gemma3 import tiny as gemma3_tiny

    device = torch.device("cpu")
    _, source = gemma3_tiny.save_tiny(tmp_path / "gemma3", "tiny", seed=3)
    eager = load_model(source, device, torch.float32).model
    graphable = load_model(source, device, torch.float32).model
    for model in (eager, graphable):
        model.allocate_cache(CONTEXT)
    ids = torch.randint(0, 300, (CONTEXT,), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        for model in (eager, graphable):
            model.forward(ids[:2], 0, "none")
        pos = 2
        for count in (2, 3, 1, 5, 4, 5, 2, 5, 3, 4):
            chunk = ids[pos : pos + count]
            expected = eager.forward(chunk, pos, "all")
            before = graphable.export_state(pos)
            for span in sorted({pos + count, CONTEXT}):
                graphable.import_state(before, pos)  # a verify's ring writes are read by the next
                got = graphable.verify_graphable(chunk, torch.tensor([pos]), span)
                assert got is not None and got.shape == (count, eager.vocab_size)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            pos += count
        for name, value in eager.export_state(pos).items():
            torch.testing.assert_close(graphable.export_state(pos)[name], value)


@pytest.mark.parametrize("real", [16, 5])
def test_a_padded_prompt_piece_equals_forward(sources, real: int) -> None:
    """prefill_graphable: 16 tokens of which `real` are the prompt's (the rest junk) give forward's
    logits after the last real one and write its cache rows; the padding's rows are overwritten
    by the next forward before anything reads them."""
    device = torch.device("cpu")
    eager = load_model(sources["llama"], device, torch.float32).model
    graphable = load_model(sources["llama"], device, torch.float32).model
    for model in (eager, graphable):
        model.allocate_cache(CONTEXT)
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        for model in (eager, graphable):
            model.forward(ids[:20], 0, "none")
        expected = eager.forward(ids[20 : 20 + real], 20, "last")
        piece = torch.cat((ids[20 : 20 + real], ids[: 16 - real]))
        got = graphable.prefill_graphable(piece, torch.tensor([20]), torch.tensor([real]), CONTEXT)
        assert got is not None
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        after = 20 + real
        torch.testing.assert_close(
            graphable.forward(ids[after : after + 3], after, "all"),
            eager.forward(ids[after : after + 3], after, "all"),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v4", "gemma3", "qwen3_5"])
def test_speculation_through_verify_graphs_keeps_the_tokens(tmp_path: Path, family: str) -> None:
    """On a GPU with decode graphs, speculation verifies through captured graphs (one per size and
    span seen) and answers with the tokens of speculation off, in float32: the dense family with
    prompt lookup; the others (whose random tiny answers never quote their prompt) with another
    random model of the family as the draft, so nearly every draft is rejected and rolled back:
    DeepSeek-V4's roll-back recomputes compressor carries from a replayed graph's inputs, Qwen3.5's
    runs the delta rule over what a replayed graph fed its linear layers, Gemma 3's puts back ring
    rows (its draft steps through its own graphs too; the other two drafts run eagerly)."""
    from ds4desk.engine.speculative.draft_model import DraftModel
    from tests.engine.models.gemma3 import tiny as gemma3_tiny
    from tests.engine.models.qwen3_5 import tiny as qwen35_tiny

    device = torch.device("cuda")
    mode = "draft"
    if family == "deepseek_v4":
        from ds4desk.engine.make_tiny import make_tiny

        make_tiny("deepseek_v4", tmp_path / family, seed=0)
        make_tiny("deepseek_v4", tmp_path / "draft", seed=1)
        source = source_from_folder(tmp_path / family)
    elif family == "gemma3":
        source = gemma3_tiny.save_tiny(tmp_path / family, "tiny", 0, max_position_embeddings=1024)[1]
        gemma3_tiny.save_tiny(tmp_path / "draft", "tiny", 1, max_position_embeddings=1024)
    elif family == "qwen3_5":
        source = qwen35_tiny.save_tiny(tmp_path / family, 0, max_position_embeddings=1024)[1]
        qwen35_tiny.save_tiny(tmp_path / "draft", 1, max_position_embeddings=1024)
    else:
        source = save_tiny(family, tmp_path / family, max_position_embeddings=1024)[1]
        mode = "lookup"
    runtime = Runtime(load_model(source, device, torch.float32).model, device, context=1024, graphs=True)
    assert runtime.graphs is not None
    if mode == "draft":
        draft = load_model(source_from_folder(tmp_path / "draft"), device, torch.float32).model
        runtime.draft = DraftModel(draft, 1024, 64, "draft", 0, graphs=True)
        assert (runtime.draft.graphs is not None) == (family == "gemma3")
    prompt = REPEATING * 4

    def answer(mode: str):
        return runtime.generate(
            prompt, SamplingParams(), 300, set(), lambda _t: None, lambda: False, speculative=mode
        )

    off, on = answer("off"), answer(mode)
    assert on.tokens == off.tokens
    assert on.logprobs == pytest.approx(off.logprobs, abs=1e-3)
    assert on.stats.drafted_tokens > 0
    if mode == "lookup":
        assert on.stats.accepted_tokens > 0
    captured = runtime.graphs._verify_graphs
    assert captured, "no verify step ran through a graph"
    assert all(count <= 8 and span in runtime.graphs.spans for count, span in captured)
    if runtime.draft is not None:
        runtime.draft.close()
    runtime.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("draft_seed", [1, 2], ids=["itself", "another"])
def test_a_draft_model_drafts_through_its_own_graphs(tmp_path: Path, draft_seed: int) -> None:
    """On a GPU with decode graphs, a draft model's steps replay its own graphs (and its short
    catch-ups its prompt-piece graphs): greedy answers keep the tokens of speculation off, with a
    draft that always agrees (the target's own weights) and one that mostly does not."""
    from ds4desk.engine.speculative.draft_model import DraftModel

    device = torch.device("cuda")
    source = save_tiny("llama", tmp_path / "target", seed=1, max_position_embeddings=1024)[1]
    draft_source = save_tiny("llama", tmp_path / "draft", seed=draft_seed, max_position_embeddings=1024)[1]
    runtime = Runtime(load_model(source, device, torch.float32).model, device, context=1024, graphs=True)
    draft = DraftModel(
        load_model(draft_source, device, torch.float32).model, 1024, 64, "draft", 0, graphs=True
    )
    runtime.draft = draft
    assert draft.graphs is not None
    prompt = REPEATING * 2

    def answer(mode: str):
        return runtime.generate(
            prompt, SamplingParams(), 120, set(), lambda _t: None, lambda: False, speculative=mode
        )

    off, on = answer("off"), answer("draft")
    assert on.tokens == off.tokens
    assert on.stats.drafted_tokens > 0
    if draft_seed == 1:  # the target as its own draft: nearly every draft kept
        assert on.stats.accepted_tokens >= 0.9 * on.stats.drafted_tokens
    again = answer("draft")  # the draft's cache is rewritten from position 0
    assert again.tokens == off.tokens
    draft.close()
    runtime.close()
