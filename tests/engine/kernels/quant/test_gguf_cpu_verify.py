"""A speculative verify step on the fused CPU layer (gguf_cpu.decode_layers with T tokens) against the
same tokens fed one decode step at a time on the same layer: bit for bit the same logits and the same
cache, for T = 2..16, on the real SmolLM2 Q4_1 file (every token's heads attended in one phase: the
cache has room for all T) and on Gemma-3-270M Q4_K_M where the step crosses its local layers' ring
(each token writes its row and attends in turn) and where it does not. Speculative decoding's greedy
identity on the CPU rests on this: the target's argmax at a drafted position is the argmax the plain
decode loop would have taken, not one that merely agrees to within rounding."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models import cpu_decode
from tests.real_models import gemma3_gguf, smollm2_gguf

pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="the C extension is not built")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm():
    return load_model(read_source(smollm2_gguf()), CPU, torch.float32).model


@pytest.fixture(scope="module")
def gemma():
    return load_model(read_source(gemma3_gguf()), CPU, torch.float32).model


def _tokens(count: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.tensor([(i * 7919 + seed) % (vocab - 10) + 5 for i in range(count)])


def _after_prompt(model, prompt: int, context: int) -> None:
    """A fresh cache of `context` rows holding `prompt` tokens (prefilled on the torch steps)."""
    model.allocate_cache(context)
    for plan in model._plans:
        plan.cpu_layer = None
    with torch.inference_mode():
        model.forward(_tokens(prompt, model.vocab_size, 17), 0, "none")


def _verify_and_decode(model, prompt: int, count: int, context: int, monkeypatch: pytest.MonkeyPatch):
    """(logits of `count` tokens in one forward, the cache after; the same tokens one at a time)."""
    block = _tokens(count, model.vocab_size, 331)
    runs = []
    for together in (True, False):
        monkeypatch.setattr(cpu_decode, "enabled", False)
        _after_prompt(model, prompt, context)
        monkeypatch.setattr(cpu_decode, "enabled", True)
        with torch.inference_mode():
            if together:
                rows = model.forward(block, prompt, "all").clone()
            else:
                rows = torch.stack(
                    [model.forward(block[i : i + 1], prompt + i, "last").clone() for i in range(count)]
                )
        assert {type(plan.cpu_layer).__name__ for plan in model._plans} == {"FusedLayer"}
        runs.append((rows, [plan.kv_cache.clone() for plan in model._plans]))
    return runs


def _assert_bitwise(runs, count: int, vocab: int) -> None:
    (rows, cache), (one_by_one, decoded_cache) = runs
    assert rows.shape == one_by_one.shape == (count, vocab)
    assert rows.abs().max().item() > 5.0
    differ = (rows.view(torch.int32) != one_by_one.view(torch.int32)).any(1).nonzero()[:, 0].tolist()
    assert not differ, f"verify rows {differ} differ from their decode steps"
    for layer, (a, b) in enumerate(zip(cache, decoded_cache, strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"layer {layer}'s cache differs"


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 5, 8, 9, 16])
def test_smollm2_verify_step_is_its_decode_steps_bit_for_bit(smollm, count: int, monkeypatch) -> None:
    # 150 cached positions: the attention crosses tiles of 64, the last one partial.
    _assert_bitwise(_verify_and_decode(smollm, 150, count, 200, monkeypatch), count, smollm.vocab_size)


@pytest.mark.slow
def test_smollm2_verify_step_across_attention_segments_is_bit_for_bit(smollm, monkeypatch) -> None:
    """From 250, nine tokens read 251 to 259 positions: the first ones one attention segment of 256
    positions, the later ones two, whose partial sums are merged (the split is the same in both runs)."""
    _assert_bitwise(_verify_and_decode(smollm, 250, 9, 300, monkeypatch), 9, smollm.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("start", [100, 506], ids=["inside-the-ring", "across-the-wrap"])
def test_gemma3_verify_step_is_its_decode_steps_bit_for_bit(gemma, start: int, monkeypatch) -> None:
    """Window 512: from 506, nine tokens cross the local layers' ring (positions 512.. overwrite
    rows 0..), where the step must write and attend token by token; from 100 they fit."""
    window = gemma.config.sliding_windows[0]
    assert window == 512
    runs = _verify_and_decode(gemma, start, 9, start + 9 + 8, monkeypatch)
    _assert_bitwise(runs, 9, gemma.vocab_size)
