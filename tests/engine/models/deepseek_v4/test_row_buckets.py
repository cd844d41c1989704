"""DeepSeek-V4's prefill products on their rows' bucket (models/row_buckets.py, ops.PAD_PRODUCT_ROWS):
each product runs on its rows padded with zeros and cut back, the experts' groups on a bucketed
largest group, so no logit changes, and the load's warm-up runs a prompt of every bucket. Padding is
on for CUDA devices; on the CPU these tests switch it on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import inspect_folder
from ds4desk.engine.make_tiny import TINY_CONFIG, make_tiny
from ds4desk.engine.models import row_buckets
from ds4desk.engine.models.deepseek_v4 import moe, ops
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.synthetic import build_quantized
from ds4desk.engine.runtime import Runtime
from tests.engine.warm_up_prompts import warm_up_prompts

CPU = torch.device("cpu")
CONTEXT = 160
CHUNK = 96


def test_bucketed_runs_the_bucket_and_returns_the_rows_own() -> None:
    weight = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    shapes: list[tuple[int, ...]] = []

    def times(rows: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(rows.shape))
        return rows @ weight

    x = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(1))  # 21 rows
    got = row_buckets.bucketed(x, times)
    assert shapes == [(32, 5)] and got.shape == (3, 7, 6)
    torch.testing.assert_close(got, x @ weight)
    few = torch.randn(16, 5)
    torch.testing.assert_close(row_buckets.bucketed(few, times), few @ weight)
    assert shapes[-1] == (16, 5)  # a few rows run as they are


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4")
    make_tiny("deepseek_v4", path, seed=3)
    return path


def runtime(folder: Path) -> Runtime:
    model = load_model(inspect_folder(folder), CPU, torch.float32).model
    return Runtime(model, CPU, context=CONTEXT, chunk=CHUNK)


def test_padded_products_change_no_logit_and_no_answer(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [(7 * i + 3) % 250 for i in range(130)]  # chunks of 96 and 34 rows

    def answer(rt: Runtime) -> tuple[torch.Tensor, list[int], list[float]]:
        logits = rt.prefill_logits(prompt)
        out = rt.generate(prompt, SamplingParams(), 12, set(), lambda _t: None, lambda: False)
        return logits, out.tokens, out.logprobs

    want = answer(runtime(folder))
    rows: list[int] = []
    largest: list[int] = []
    real_bucketed, real_rows = ops.bucketed, moe.prefill_rows

    def recording(x: torch.Tensor, fn):  # type: ignore[no-untyped-def]
        rows.append(x.numel() // x.shape[-1])
        return real_bucketed(x, fn)

    def recording_rows(count: int) -> int:
        largest.append(count)
        return real_rows(count)

    monkeypatch.setattr(ops, "pads_rows", lambda device: True)
    monkeypatch.setattr(ops, "bucketed", recording)
    monkeypatch.setattr(moe, "prefill_rows", recording_rows)
    got = answer(runtime(folder))
    assert {96, 34} <= set(rows)  # the chunks' products went through the buckets
    assert largest  # the experts' groups ran on a bucket too
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1] == want[1] and got[2] == pytest.approx(want[2], abs=1e-5)


def test_the_warm_up_runs_every_bucket(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(folder)
    assert rt.model.prefill_row_buckets(rt.chunk) == []  # the CPU: no padding
    monkeypatch.setattr(ops, "pads_rows", lambda device: True)
    assert rt.model.prefill_row_buckets(rt.chunk) == [32, 64, 128]  # 17..96 rows; 128 fits 160
    prompts, report = warm_up_prompts(rt)
    assert report.failed == ""
    assert prompts == [32, 64, 128]


def test_weights_kept_quantized_get_no_bucket_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 linears and packed FP4 experts run on their own kernels: no warm-up prompt per bucket."""
    model = build_quantized(DeepseekV4Config.from_hf(TINY_CONFIG), CPU, None, dtype=torch.float32, seed=3)
    model.allocate_cache(CONTEXT)
    monkeypatch.setattr(ops, "pads_rows", lambda device: True)
    assert model.prefill_row_buckets(CHUNK) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_products_are_padded_by_default_and_answer_the_same(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = torch.device("cuda")
    prompt = [(13 * i + 1) % 250 for i in range(130)]

    def answer() -> tuple[list[int], list[float], list[int]]:
        model = load_model(inspect_folder(folder), cuda, torch.float32).model
        rt = Runtime(model, cuda, context=CONTEXT, chunk=CHUNK)
        out = rt.generate(prompt, SamplingParams(), 12, set(), lambda _t: None, lambda: False)
        return out.tokens, out.logprobs, rt.model.prefill_row_buckets(CHUNK)

    tokens, logprobs, padded_buckets = answer()
    assert padded_buckets == [32, 64, 128]
    monkeypatch.setattr(ops, "PAD_PRODUCT_ROWS", False)
    want_tokens, want_logprobs, plain_buckets = answer()
    assert plain_buckets == []
    assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-4)
