"""The dense family (Llama, Mistral, Qwen2, Qwen3), its loader, sampling and the runtime, checked
against transformers on tiny random checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, FinishReason, SamplingParams
from ds4desk.engine.loader import LoadedModel, load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models.llama.config import DenseConfig
from ds4desk.engine.models.llama.model import DenseModel
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.sampling import sample
from tests.engine.tiny_dense import TINY_CONFIGS, save_tiny

FAMILIES = list(TINY_CONFIGS)
CPU = torch.device("cpu")
GREEDY = SamplingParams()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def prompt(length: int, seed: int = 1, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, ModelSource]]:
    """Every family saved once; llama sharded so loading reads several files."""
    saved = {}
    for family in FAMILIES:
        shard = "100KB" if family == "llama" else None
        saved[family] = save_tiny(family, tmp_path_factory.mktemp(family), shard=shard)
    return saved


def load(source: ModelSource, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(source, CPU, dtype)


def no_cancel() -> bool:
    return False


# --- the model against transformers --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family: str) -> None:
    hf, source = tiny[family]
    loaded = load(source)
    model = loaded.model
    model.allocate_cache(64)
    ids = torch.tensor(prompt(24))  # longer than mistral's window of 8
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
        ours = model.forward(ids, 0, "all")
        last = model.forward(ids, 0, "last")
        assert model.forward(ids, 0, "none") is None
    assert ours.dtype == torch.float32 and ours.shape == (24, 256)
    assert relative_error(ours, ref) < 1e-4
    assert last.shape == (256,)
    assert relative_error(last, ref[-1]) < 1e-4
    assert loaded.family == family
    assert loaded.parameters == hf.num_parameters()
    assert loaded.weight_bytes == 4 * loaded.parameters


def test_linear_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    hf, source = save_tiny("llama", tmp_path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert DenseConfig.from_hf(source.config).rope.kind == "linear"
    model = load(source).model
    model.allocate_cache(40)
    ids = torch.tensor(prompt(40))
    with torch.inference_mode():
        ours = model.forward(ids, 0, "all")
        ref = hf(ids[None]).logits[0]
    assert relative_error(ours, ref) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_names_are_hugging_face_names(tiny, family: str) -> None:
    hf, source = tiny[family]
    model = load(source).model
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())  # named_parameters drops the tied lm_head, as we do
    assert set(ours) == set(theirs)
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name
    if TINY_CONFIGS[family]["tie_word_embeddings"]:
        assert "lm_head.weight" not in ours


def test_bfloat16_load_runs_close_to_float32(tiny) -> None:
    hf, source = tiny["qwen2"]
    loaded = load(source, torch.bfloat16)
    model = loaded.model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.weight_bytes == 2 * loaded.parameters
    model.allocate_cache(32)
    ids = torch.tensor(prompt(12))
    with torch.inference_mode():
        ours = model.forward(ids, 0, "all")
        ref = hf(ids[None]).logits[0]
    assert ours.dtype == torch.float32
    assert relative_error(ours, ref) < 5e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_size_does_not_change_results(tiny, family: str) -> None:
    _, source = tiny[family]
    model = load(source).model
    ids = prompt(23)
    lasts, greedy = [], []
    for chunk in (1, 3, 512):
        runtime = Runtime(model, CPU, context=64, chunk=chunk)
        lasts.append(runtime.prefill_logits(ids))
        outcome = runtime.generate(ids, GREEDY, 8, set(), lambda _t: None, no_cancel)
        greedy.append(outcome.tokens)
    for other in lasts[1:]:
        assert relative_error(other, lasts[0]) < 1e-5
    assert greedy[0] == greedy[1] == greedy[2]
    assert len(greedy[0]) == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_after_prefill_equals_full_prefill(tiny, family: str) -> None:
    hf, source = tiny[family]
    model = load(source).model
    model.allocate_cache(64)
    ids = prompt(6)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids), 0, "last")
        for _ in range(14):  # runs past mistral's window of 8
            ids.append(int(torch.argmax(logits)))
            logits = model.forward(torch.tensor(ids[-1:]), len(ids) - 1, "last")
            # Re-prefilling the whole sequence rewrites the same cache rows, so decoding continues.
            full = model.forward(torch.tensor(ids), 0, "last")
            assert relative_error(logits, full) < 1e-5
        ref = hf(torch.tensor(ids)[None]).logits[0, -1]
    assert relative_error(logits, ref) < 1e-4


def test_runtime_greedy_matches_transformers_generate(tiny) -> None:
    hf, source = tiny["llama"]
    runtime = Runtime(load(source).model, CPU, context=64)
    ids = prompt(10)
    outcome = runtime.generate(ids, GREEDY, 12, set(), lambda _t: None, no_cancel)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert outcome.tokens == ref[0, len(ids) :].tolist()


def test_model_built_directly_fuses_its_weights(tiny) -> None:
    """A DenseModel made without the loader (on CPU, weights given by load_state_dict) works too."""
    hf, source = tiny["qwen2"]
    model = DenseModel(DenseConfig.from_hf(source.config), torch.float32)
    model.load_state_dict(hf.state_dict(), strict=False)
    model.finish_loading()
    model.allocate_cache(16)
    ids = torch.tensor(prompt(9))
    with torch.inference_mode():
        ours = model.forward(ids, 0, "all")
        ref = hf(ids[None]).logits[0]
    assert relative_error(ours, ref) < 1e-4


def test_forward_past_the_cache_is_context_overflow(tiny) -> None:
    model = load(tiny["mistral"][1]).model
    model.allocate_cache(8)
    with pytest.raises(EngineFailure) as info:
        model.forward(torch.tensor(prompt(4)), 6, "last")
    assert info.value.error.code == ErrorCode.CONTEXT_OVERFLOW


# --- loading errors ------------------------------------------------------------------------------


def test_missing_tensor_is_named(tiny) -> None:
    _, source = tiny["qwen2"]
    tensors = dict(source.tensors)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(EngineFailure) as info:
        load(dataclasses.replace(source, tensors=tensors))
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert "model.layers.1.self_attn.k_proj.bias" in info.value.error.detail


def test_wrong_shape_is_named(tiny) -> None:
    _, source = tiny["qwen3"]
    tensors = dict(source.tensors)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = dataclasses.replace(tensors[name], shape=(100, 64))
    with pytest.raises(EngineFailure) as info:
        load(dataclasses.replace(source, tensors=tensors))
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert info.value.error.detail == f"tensor {name} has shape [100, 64], config says [128, 64]"


def test_untied_checkpoint_without_lm_head_fails(tiny) -> None:
    _, source = tiny["mistral"]
    tensors = {k: v for k, v in source.tensors.items() if k != "lm_head.weight"}
    with pytest.raises(EngineFailure) as info:
        load(dataclasses.replace(source, tensors=tensors))
    assert "lm_head.weight" in info.value.error.detail


def test_unknown_architecture_is_named(tiny) -> None:
    _, source = tiny["llama"]
    with pytest.raises(EngineFailure) as info:
        load(dataclasses.replace(source, architecture="GPT2LMHeadModel"))
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert "'GPT2LMHeadModel'" in info.value.error.detail
    assert "LlamaForCausalLM" in info.value.error.detail


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
    ],
)
def test_invalid_config_is_load_failed(tiny, change: dict, named: str) -> None:
    _, source = tiny["llama"]
    config = {k: v for k, v in source.config.items() if k not in change or change[k] is not None}
    config.update({k: v for k, v in change.items() if v is not None})
    config.pop("rope_scaling", None)
    with pytest.raises(EngineFailure) as info:
        load(dataclasses.replace(source, config=config))
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert named in info.value.error.detail


# --- sampling ------------------------------------------------------------------------------------


def random_logits(seed: int = 0, vocab: int = 300) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_raw_logprob() -> None:
    logits = random_logits()
    token, logprob = sample(logits, GREEDY)
    assert token.dim() == 0 and token.dtype == torch.long
    assert logprob.dim() == 0 and logprob.dtype == torch.float32
    assert int(token) == int(torch.argmax(logits))
    assert float(logprob) == pytest.approx(float(torch.log_softmax(logits, 0)[token]), abs=1e-6)


def test_seeded_sampling_is_reproducible() -> None:
    logits = random_logits()
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=7)

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [int(sample(logits, params, generator)[0]) for _ in range(40)]

    assert draws(7) == draws(7)
    assert len(set(draws(7))) > 1  # it really samples
    assert draws(7) != draws(8)


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        token, _ = sample(logits, SamplingParams(temperature=5.0, top_k=1), generator)
        assert int(token) == int(torch.argmax(logits))


def test_logprob_is_of_raw_logits_not_tempered() -> None:
    logits = random_logits(4)
    raw = torch.log_softmax(logits, 0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        token, logprob = sample(logits, SamplingParams(temperature=2.0, top_p=0.8, top_k=30), generator)
        assert float(logprob) == pytest.approx(float(raw[token]), abs=1e-5)


def test_top_k_and_top_p_limit_the_choices() -> None:
    logits = random_logits(5)
    order = torch.argsort(logits, descending=True)
    generator = torch.Generator().manual_seed(1)
    top3 = set(order[:3].tolist())
    seen = {int(sample(logits, SamplingParams(temperature=1.0, top_k=3), generator)[0]) for _ in range(300)}
    assert seen == top3
    probs = torch.softmax(logits, 0)[order]
    nucleus = int((torch.cumsum(probs, 0) < 0.5).sum()) + 1  # smallest prefix with mass >= 0.5
    allowed = set(order[:nucleus].tolist())
    seen = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.5), generator)[0]) for _ in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    generator = torch.Generator().manual_seed(2)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, SamplingParams(temperature=1.0), generator)[0]] += 1
    assert torch.allclose(counts / 4000, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03)


# --- the runtime ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tiny) -> Runtime:
    return Runtime(load(tiny["qwen3"][1]).model, CPU, context=48, chunk=4)


def greedy_run(runtime: Runtime, ids: list[int], count: int) -> list[int]:
    return runtime.generate(ids, GREEDY, count, set(), lambda _t: None, no_cancel).tokens


def test_length_finish_streams_every_token(runtime: Runtime) -> None:
    seen: list[int] = []
    ids = prompt(9)
    outcome = runtime.generate(ids, GREEDY, 5, set(), seen.append, no_cancel)
    assert outcome.finish_reason == FinishReason.LENGTH
    assert len(outcome.tokens) == 5 and seen == outcome.tokens
    assert len(outcome.logprobs) == 5 and all(lp <= 0.0 for lp in outcome.logprobs)
    stats = outcome.stats
    assert (stats.prompt_tokens, stats.generated_tokens) == (9, 5)
    assert stats.prefill_s > 0 and stats.time_to_first_token_s >= stats.prefill_s and stats.decode_s > 0
    # The first logprob is the raw log-softmax of the prompt's last logits.
    expected = torch.log_softmax(runtime.prefill_logits(ids), 0)[outcome.tokens[0]]
    assert outcome.logprobs[0] == pytest.approx(float(expected), abs=1e-5)


def test_stop_token_ends_without_being_returned(runtime: Runtime) -> None:
    ids = prompt(7, seed=3)
    free = greedy_run(runtime, ids, 10)
    stop = free[4]
    cut = free.index(stop)
    seen: list[int] = []
    outcome = runtime.generate(ids, GREEDY, 10, {stop, 9999}, seen.append, no_cancel)
    assert outcome.finish_reason == FinishReason.STOP
    assert outcome.tokens == free[:cut] == seen
    assert outcome.stats.generated_tokens == cut + 1


def test_cancel_mid_decode_keeps_partial_tokens(runtime: Runtime) -> None:
    seen: list[int] = []
    outcome = runtime.generate(prompt(5), GREEDY, 20, set(), seen.append, lambda: len(seen) >= 3)
    assert outcome.finish_reason == FinishReason.CANCELLED
    assert outcome.tokens == seen and len(seen) == 3


def test_cancel_between_prefill_chunks(runtime: Runtime) -> None:
    checks: list[int] = []

    def cancel_on_second_check() -> bool:
        checks.append(1)
        return len(checks) >= 2

    seen: list[int] = []
    outcome = runtime.generate(prompt(10), GREEDY, 5, set(), seen.append, cancel_on_second_check)
    assert outcome.finish_reason == FinishReason.CANCELLED
    assert outcome.tokens == [] and seen == []
    assert len(checks) == 2  # chunk 4: it stopped before the second of three chunks


def test_seeded_generate_is_reproducible_and_state_does_not_leak(runtime: Runtime) -> None:
    params = SamplingParams(temperature=1.0, top_k=40, seed=11)

    def run(ids: list[int]) -> list[int]:
        return runtime.generate(ids, params, 8, set(), lambda _t: None, no_cancel).tokens

    first = run(prompt(12, seed=4))
    run(prompt(30, seed=5))  # a longer request in between writes more of the cache
    assert run(prompt(12, seed=4)) == first


def test_request_errors(runtime: Runtime) -> None:
    cases = [
        (dict(prompt_ids=prompt(40), max_new_tokens=9), ErrorCode.CONTEXT_OVERFLOW, "exceed the context"),
        (dict(prompt_ids=[], max_new_tokens=4), ErrorCode.BAD_REQUEST, "empty"),
        (dict(prompt_ids=[1, 256], max_new_tokens=4), ErrorCode.BAD_REQUEST, "token id 256 is outside"),
        (dict(prompt_ids=[3, -1, 300], max_new_tokens=4), ErrorCode.BAD_REQUEST, "token id -1 is outside"),
        (
            dict(prompt_ids=[1, 2], max_new_tokens=4, sampling=SamplingParams(1.0, top_p=0.0)),
            ErrorCode.BAD_REQUEST,
            "top_p",
        ),
    ]
    for kwargs, code, message in cases:
        args = {
            "sampling": GREEDY,
            "stop_ids": set(),
            "on_token": lambda _t: None,
            "should_cancel": no_cancel,
        }
        with pytest.raises(EngineFailure) as info:
            runtime.generate(**{**args, **kwargs})
        assert info.value.error.code == code, kwargs
        assert message in info.value.error.detail, (kwargs, info.value.error.detail)
    # Exactly filling the context is fine.
    assert len(greedy_run(runtime, prompt(40), 8)) == 8


class _Broken:
    """A model whose forward fails with `error` on the call numbered `fail_at` (0 = prefill)."""

    def __init__(self, model: DenseModel, error: Exception, fail_at: int) -> None:
        self.model, self.error, self.fail_at, self.calls = model, error, fail_at, 0
        self.vocab_size = model.vocab_size

    def allocate_cache(self, context: int) -> None:
        self.model.allocate_cache(context)

    def free_cache(self) -> None:
        self.model.free_cache()

    def forward(self, ids: torch.Tensor, start: int, logits: str) -> torch.Tensor | None:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.error
        return self.model.forward(ids, start, logits)


@pytest.mark.parametrize(
    ("error", "fail_at", "code"),
    [
        (RuntimeError("kernel exploded"), 0, ErrorCode.PREFILL_FAILED),
        (RuntimeError("kernel exploded"), 2, ErrorCode.DECODE_FAILED),
        (torch.OutOfMemoryError("no memory left"), 0, ErrorCode.OUT_OF_MEMORY),
        (torch.OutOfMemoryError("no memory left"), 1, ErrorCode.OUT_OF_MEMORY),
    ],
)
def test_torch_errors_become_engine_failures(tiny, error: Exception, fail_at: int, code: ErrorCode) -> None:
    broken = _Broken(load(tiny["llama"][1]).model, error, fail_at)
    runtime = Runtime(broken, CPU, context=32)  # type: ignore[arg-type]
    with pytest.raises(EngineFailure) as info:
        runtime.generate(prompt(5), GREEDY, 5, set(), lambda _t: None, no_cancel)
    assert info.value.error.code == code
    assert str(error) in info.value.error.detail


def test_close_frees_the_cache(tiny, tmp_path: Path) -> None:
    model = load(tiny["llama"][1]).model
    runtime = Runtime(model, CPU, context=16)
    assert model.context == 16 and model.cache_bytes() > 0
    runtime.close()
    assert model.context == 0 and model.cache_bytes() == 0
