"""Prefill chunks padded to row buckets (models/llama/model.py, PREFILL_ROW_STEP): the padding
changes no logit and no later token, stops where the context ends, and the load's warm-up runs every
bucket. Padding is on for CUDA devices; on the CPU these tests switch it on for the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.loader import load_model
from ds4desk.engine.models.llama import model as dense
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.warm_up import step_count
from tests.engine.tiny_dense import save_tiny
from tests.engine.warm_up_prompts import warm_up_prompts

CPU = torch.device("cpu")
CONTEXT = 96


def test_buckets_are_powers_of_two_then_multiples_of_the_step() -> None:
    assert [dense.prefill_rows(n) for n in (17, 32, 33, 100, 255, 256, 257, 3000, 4096)] == [
        32, 32, 64, 128, 256, 256, 512, 3072, 4096,
    ]  # fmt: skip


@pytest.fixture
def runtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Runtime, Runtime]:
    """The same tiny Llama twice: padding its chunks, and not."""
    _, source = save_tiny("llama", tmp_path / "llama", seed=3)
    plain = Runtime(load_model(source, CPU, torch.float32).model, CPU, context=CONTEXT, chunk=40)
    padded_model = load_model(source, CPU, torch.float32).model
    monkeypatch.setattr(padded_model, "_pads_rows", lambda: True)
    return Runtime(padded_model, CPU, context=CONTEXT, chunk=40), plain


def test_padding_runs_the_bucket_and_changes_no_logit(runtimes: tuple[Runtime, Runtime]) -> None:
    padded, plain = runtimes
    model = padded.model
    assert isinstance(model, dense.DenseModel)
    assert model._padded_rows(0, 37) == 64
    assert model._padded_rows(40, 37) == 37  # 40 + 64 would pass the context's 96 positions
    assert model._padded_rows(0, 16) == 16  # a few rows (FEW_ROWS) stay as they are
    rows: list[int] = []
    real_embed = dense.packed_embed

    def counting_embed(embed: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows.append(ids.shape[0])
        return real_embed(embed, ids)

    prompt = [(7 * i + 3) % 250 for i in range(77)]  # chunks of 40 and 37 rows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dense, "packed_embed", counting_embed)
        got = padded.prefill_logits(prompt)
    assert rows == [64, 37]  # 40 -> 64 at position 0; 37 at 40 stays (40 + 64 passes 96)
    want = plain.prefill_logits(prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_answer_after_a_padded_prompt_is_the_same(runtimes: tuple[Runtime, Runtime]) -> None:
    padded, plain = runtimes
    prompt = [(11 * i + 5) % 250 for i in range(53)]  # 40 + 13: the second chunk is a few rows

    def answer(runtime: Runtime) -> tuple[list[int], list[float]]:
        out = runtime.generate(prompt, SamplingParams(), 24, set(), lambda _t: None, lambda: False)
        return out.tokens, out.logprobs

    got, want = answer(padded), answer(plain)
    assert got[0] == want[0] and len(got[0]) == 24
    assert got[1] == pytest.approx(want[1], abs=1e-5)


def test_the_warm_up_runs_every_bucket(runtimes: tuple[Runtime, Runtime]) -> None:
    padded, plain = runtimes
    assert padded.model.prefill_row_buckets(padded.chunk) == [32, 64]  # 17..40 rows
    assert plain.model.prefill_row_buckets(plain.chunk) == []  # the CPU: no padding
    prompts, report = warm_up_prompts(padded)
    assert report.failed == ""
    assert prompts == [32, 64]
    assert report.steps == step_count(padded) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_chunks_are_padded_by_default_and_answer_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, source = save_tiny("llama", tmp_path / "llama", seed=4)
    cuda = torch.device("cuda")
    padded = Runtime(load_model(source, cuda, torch.float32).model, cuda, context=CONTEXT, chunk=40)
    assert padded.model.prefill_row_buckets(40) == [32, 64]
    prompt = [(13 * i + 1) % 250 for i in range(77)]
    got = padded.generate(prompt, SamplingParams(), 12, set(), lambda _t: None, lambda: False)
    monkeypatch.setattr(dense, "PAD_PREFILL_ROWS", False)
    plain = Runtime(load_model(source, cuda, torch.float32).model, cuda, context=CONTEXT, chunk=40)
    assert plain.model.prefill_row_buckets(40) == []
    want = plain.generate(prompt, SamplingParams(), 12, set(), lambda _t: None, lambda: False)
    assert got.tokens == want.tokens and got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
