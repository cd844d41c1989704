"""Qwen3.5's prefill products on their rows' bucket (models/row_buckets.py, model.PAD_PRODUCT_ROWS):
its chunks cannot be padded (the linear layers' state would take the padding in), so each
projection runs on its rows padded with zeros and cut back, the MoE experts' too; no logit changes,
and the load's warm-up runs a prompt of every bucket. Padding is on for CUDA devices; on the CPU
these tests switch it on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4desk.engine.api import SamplingParams
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models import packed
from ds4desk.engine.models.packed import Projection
from ds4desk.engine.models.qwen3_5 import model as qwen_model
from ds4desk.engine.models.qwen3_5.model import Qwen35Model
from ds4desk.engine.runtime import Runtime
from tests.engine.models.qwen3_5.tiny import save_tiny, save_tiny_moe
from tests.engine.warm_up_prompts import warm_up_prompts

CPU = torch.device("cpu")
CONTEXT = 160
CHUNK = 96
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(130)]  # chunks of 96 and 34 rows


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    return save_tiny(tmp_path_factory.mktemp("qwen3_5-buckets"), seed=4)[1]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    return save_tiny_moe(tmp_path_factory.mktemp("qwen3_5_moe-buckets"))[1]


def every_projection(rt: Runtime) -> list[Projection]:
    return [p for shard in rt.model._shards for plan in shard.plans for p in held_projections(plan)]


def runtime(source: ModelSource) -> Runtime:
    return Runtime(load_model(source, CPU, torch.float32).model, CPU, context=CONTEXT, chunk=CHUNK)


def padding_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Qwen35Model, "_pads_rows", lambda self: True)


def held_projections(value: object) -> list[Projection]:
    """Every Projection a plan holds, found through its fields (what _projections must list)."""
    if isinstance(value, Projection):
        return [value]
    if isinstance(value, (list, tuple)):
        return [p for item in value for p in held_projections(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return [p for field in fields for p in held_projections(getattr(value, field.name))]
    return []


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_padded_products_change_no_logit_and_no_answer(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = request.getfixturevalue(kind)

    def answer(rt: Runtime) -> tuple[torch.Tensor, list[int], list[float]]:
        logits = rt.prefill_logits(PROMPT)
        out = rt.generate(PROMPT, SamplingParams(), 12, set(), lambda _t: None, lambda: False)
        return logits, out.tokens, out.logprobs

    want = answer(runtime(source))
    rows: list[int] = []
    real_bucketed = packed.bucketed

    def recording(x: torch.Tensor, fn):  # type: ignore[no-untyped-def]
        rows.append(x.shape[0])
        return real_bucketed(x, fn)

    padding_on(monkeypatch)
    monkeypatch.setattr(packed, "bucketed", recording)
    rt = runtime(source)
    assert all(p.pad_rows for p in every_projection(rt))  # every one of them
    got = answer(rt)
    assert {96, 34} <= set(rows)  # the chunks' products went through the buckets
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1] == want[1] and got[2] == pytest.approx(want[2], abs=1e-5)


def test_the_warm_up_runs_every_bucket(dense: ModelSource, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(dense)
    assert rt.model.prefill_row_buckets(rt.chunk) == []  # the CPU: no padding
    assert not any(p.pad_rows for p in every_projection(rt))
    padding_on(monkeypatch)
    assert rt.model.prefill_row_buckets(rt.chunk) == [32, 64, 128]  # 17..96 rows; 128 fits 160
    prompts, report = warm_up_prompts(rt)
    assert report.failed == ""
    assert prompts == [32, 64, 128]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_products_are_padded_by_default_and_answer_the_same(
    dense: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = torch.device("cuda")

    def answer() -> tuple[list[int], list[float], list[int]]:
        rt = Runtime(load_model(dense, cuda, torch.float32).model, cuda, context=CONTEXT, chunk=CHUNK)
        out = rt.generate(PROMPT, SamplingParams(), 12, set(), lambda _t: None, lambda: False)
        return out.tokens, out.logprobs, rt.model.prefill_row_buckets(CHUNK)

    tokens, logprobs, padded_buckets = answer()
    assert padded_buckets == [32, 64, 128]
    monkeypatch.setattr(qwen_model, "PAD_PRODUCT_ROWS", False)
    want_tokens, want_logprobs, plain_buckets = answer()
    assert plain_buckets == []
    assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-4)
