"""The fused one-token CPU layer (gguf_cpu.FusedLayer, models/cpu_decode.py) against the torch steps it
replaces, on the real SmolLM2 Q4_1 and Gemma-3-270M Q4_K_M files: the same logits to float32
rounding, decoding past several attention tiles and, for Gemma, across the wrap of its local
layers' ring. The torch steps themselves are held to transformers by tests/engine/loading and
tests/engine/models; here each comparison also checks which path really ran."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models import cpu_decode
from tests.engine.gguf_fakes import write_tiny_gguf
from tests.real_models import gemma3_gguf, smollm2_gguf

pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="the C extension is not built")

CPU = torch.device("cpu")
# Logits of these models reach ~35; float32 sums in another order move them by ~1e-5.
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def smollm():
    return load_model(read_source(smollm2_gguf()), CPU, torch.float32).model


@pytest.fixture(scope="module")
def gemma():
    return load_model(read_source(gemma3_gguf()), CPU, torch.float32).model


def _prompt(count: int, vocab: int = 40000) -> torch.Tensor:
    return torch.tensor([(i * 7919 + 17) % (vocab - 10) + 5 for i in range(count)])


def _decode(model, prompt: int, steps: int, fused: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """[steps, V]: a fresh prefill of `prompt` tokens, then greedy one-token steps on one path."""
    monkeypatch.setattr(cpu_decode, "enabled", fused)
    rows = []
    with torch.inference_mode():
        logits = model.forward(_prompt(prompt, model.vocab_size), 0, "last")
        for position in range(prompt, prompt + steps):
            token = int(logits.argmax())
            logits = model.forward(torch.tensor([token]), position, "last")
            rows.append(logits.clone())
    return torch.stack(rows)


def _paths_used(model) -> set[str]:
    return {type(plan.cpu_layer).__name__ for plan in model._plans}


def _compare(model, prompt: int, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model.allocate_cache(prompt + steps + 8)
    for plan in model._plans:
        plan.cpu_layer = None
    torch_steps = _decode(model, prompt, steps, False, monkeypatch)
    assert all(plan.cpu_layer is None for plan in model._plans), "the torch steps made a fused layer"
    fused = _decode(model, prompt, steps, True, monkeypatch)
    assert _paths_used(model) == {"FusedLayer"}, "the fused layer did not run"
    delta = (fused - torch_steps).abs().max().item()
    assert torch_steps.abs().max().item() > 5.0
    assert delta <= TOLERANCE, f"max |Δ logit| {delta:.3g}"
    assert torch.equal(fused.argmax(-1), torch_steps.argmax(-1))


@pytest.mark.slow
def test_smollm2_fused_decode_matches_the_torch_steps(smollm, isa: str, monkeypatch) -> None:
    # 150 cached positions: three attention tiles of 64, the last one partial.
    _compare(smollm, 150, 6, monkeypatch)


@pytest.mark.slow
def test_smollm2_fused_decode_over_several_attention_segments(smollm, monkeypatch) -> None:
    # 700 cached positions: three segments of 256 (each its three query heads a kv head at once),
    # merged.
    _compare(smollm, 700, 3, monkeypatch)


@pytest.mark.slow
def test_gemma3_fused_decode_matches_across_the_ring_wrap(gemma, monkeypatch) -> None:
    """Gemma 3: (1 + w) norms before and after each block, q/k norms, GELU, its own rope tables per
    layer kind, and projections of several types side by side (q/k/v of Q4_K_M). The window is 512
    positions: decoding 506..517 wraps the local layers' ring, where position p overwrites row
    p - 512 and attention reads two runs of rows."""
    window = gemma.config.sliding_windows[0]
    assert window == 512 and gemma.ring_rows(window + 20) == window
    assert any(plan.qkv.parts for plan in gemma._plans), "no projection of parts left to test"
    _compare(gemma, window - 6, 12, monkeypatch)


def _several(model, prompt: int, count: int, fused: bool, monkeypatch: pytest.MonkeyPatch):
    """A torch prefill of `prompt` tokens, then `count` tokens in one forward (a verify step of
    speculative decoding) on one path, then one more token: (the step's logits [count, V], the
    next token's logits [1, V], the cache afterwards)."""
    monkeypatch.setattr(cpu_decode, "enabled", False)
    model.allocate_cache(prompt + count + 8)
    for plan in model._plans:
        plan.cpu_layer = None
    with torch.inference_mode():
        model.forward(_prompt(prompt, model.vocab_size), 0, "none")
        monkeypatch.setattr(cpu_decode, "enabled", fused)
        block = (_prompt(count, model.vocab_size) * 3 + 11) % model.vocab_size
        rows = model.forward(block, prompt, "all").clone()
        monkeypatch.setattr(cpu_decode, "enabled", False)
        after = model.forward(torch.tensor([7]), prompt + count, "last").clone()
    return rows, after, [plan.kv_cache.clone() for plan in model._plans]


def _compare_several(model, prompt: int, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch_rows, torch_after, torch_cache = _several(model, prompt, count, False, monkeypatch)
    assert all(plan.cpu_layer is None for plan in model._plans), "the torch steps made a fused layer"
    rows, after, cache = _several(model, prompt, count, True, monkeypatch)
    assert _paths_used(model) == {"FusedLayer"}, "the fused layer did not run"
    assert rows.shape == torch_rows.shape == (count, model.vocab_size)
    assert torch_rows.abs().max().item() > 5.0
    delta = (rows - torch_rows).abs().max().item()
    assert delta <= TOLERANCE, f"max |Δ logit| {delta:.3g} over {count} tokens"
    assert torch.equal(rows.argmax(-1), torch_rows.argmax(-1))
    # The cache the step wrote is the one the next token reads: same keys and values, same logits.
    assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(cache, torch_cache, strict=True))
    assert (after - torch_after).abs().max().item() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 5, 9, 16])
def test_several_tokens_in_one_call_match_the_torch_prefill(smollm, count: int, monkeypatch) -> None:
    _compare_several(smollm, 70, count, monkeypatch)


@pytest.mark.slow
def test_several_tokens_across_gemma3_s_ring_wrap(gemma, monkeypatch) -> None:
    """Nine tokens whose positions cross the local layers' wrap (window 512): each token writes its
    ring row and attends before the next one overwrites the row 512 positions back."""
    window = gemma.config.sliding_windows[0]
    _compare_several(gemma, window - 4, 9, monkeypatch)


def test_more_tokens_than_one_call_takes_are_refused(smollm) -> None:
    smollm.allocate_cache(64)
    for plan in smollm._plans:
        plan.cpu_layer = None
    fused = cpu_decode.cached_layer(
        smollm._plans[0],
        smollm._shards[0].cos,
        smollm._shards[0].sin,
        lambda: _spec(smollm),
    )
    assert fused is not None
    x = torch.zeros(gguf_cpu.MAX_TOKENS + 1, smollm.config.hidden_size)
    with pytest.raises(ValueError, match="is not"):
        gguf_cpu.decode_layers([fused], x, 0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_logits(smollm, threads: int, monkeypatch) -> None:
    smollm.allocate_cache(64)
    monkeypatch.setattr(cpu_decode, "enabled", True)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            logits = smollm.forward(_prompt(40), 0, "last")
            token = torch.tensor([int(logits.argmax())])
            torch.set_num_threads(1)
            one = smollm.forward(token, 40, "last")
            torch.set_num_threads(threads)
            many = smollm.forward(token, 40, "last")
    finally:
        torch.set_num_threads(before)
    assert (one - many).abs().max().item() <= TOLERANCE


@pytest.mark.slow
def test_a_new_cache_gets_a_new_fused_layer_and_the_old_one_is_freed(smollm, monkeypatch) -> None:
    monkeypatch.setattr(cpu_decode, "enabled", True)
    smollm.allocate_cache(32)
    with torch.inference_mode():
        smollm.forward(_prompt(8), 0, "none")
        smollm.forward(torch.tensor([5]), 8, "last")
    first = smollm._plans[0].cpu_layer
    old_cache = weakref.ref(smollm._plans[0].kv_cache)
    assert isinstance(first, gguf_cpu.FusedLayer)
    smollm.allocate_cache(48)
    gc.collect()
    assert old_cache() is None, "the fused layer kept the freed cache alive"
    with torch.inference_mode():
        smollm.forward(_prompt(8), 0, "none")
        smollm.forward(torch.tensor([5]), 8, "last")
    second = smollm._plans[0].cpu_layer
    assert isinstance(second, gguf_cpu.FusedLayer) and second is not first
    assert second.reads(smollm._plans[0].kv_cache, smollm._shards[0].cos, smollm._shards[0].sin)


def _spec(model, **changes) -> gguf_cpu.LayerSpec:
    from ds4desk.engine.models.llama.layer import EagerDecodeSteps

    shard = model._shards[0]
    steps = EagerDecodeSteps(model.config, True, shard, 0)
    spec = steps._spec(model._plans[0], shard.cos, shard.sin)
    assert spec is not None
    for name, value in changes.items():
        setattr(spec, name, value)
    return spec


@pytest.mark.slow
def test_what_the_kernel_cannot_run_is_refused(smollm) -> None:
    smollm.allocate_cache(16)
    hidden = smollm.config.hidden_size
    assert gguf_cpu.fused_layer(_spec(smollm)) is not None
    # Another dtype, a wrong shape, a block type the kernels do not know: no fused layer.
    assert gguf_cpu.fused_layer(_spec(smollm, input_norm=torch.ones(hidden, dtype=torch.bfloat16))) is None
    assert gguf_cpu.fused_layer(_spec(smollm, pre_ffn_norm=torch.ones(hidden + 1))) is None
    bad = _spec(smollm)
    bad.down = gguf_cpu.FusedProjection((gguf_cpu.PackedPart(bad.down.parts[0].weight, 0, bad.ffn),))
    assert gguf_cpu.fused_layer(bad) is None
    layer = gguf_cpu.fused_layer(_spec(smollm))
    assert layer is not None
    with pytest.raises(ValueError, match="float32"):
        layer(torch.zeros(1, hidden, dtype=torch.float64), 0, 1)
    with pytest.raises(ValueError, match="position"):  # the cache holds 16 positions
        layer(torch.zeros(1, hidden), 16, 1)
    with pytest.raises(ValueError, match="position"):
        layer(torch.zeros(1, hidden), -1, 1)


def test_a_model_of_float_weights_keeps_the_torch_steps(tmp_path: Path, monkeypatch) -> None:
    """A float32 GGUF's projections are float weights, not the kernel's: each layer is tried once,
    remembered as unfit, and the torch steps run (the same logits as with the path turned off)."""
    model = load_model(read_source(write_tiny_gguf(tmp_path / "tiny.gguf")), CPU, torch.float32).model
    model.allocate_cache(16)
    fused = _decode(model, 6, 3, True, monkeypatch)
    assert _paths_used(model) == {"_Unfit"}
    assert torch.equal(fused, _decode(model, 6, 3, False, monkeypatch))


def test_callers_on_several_threads_each_get_their_own_result() -> None:
    """The decode pool serves one caller at a time; the others run their GEMVs on OpenMP meanwhile.
    Four threads multiplying different weights at once must each get the reference result."""
    import threading

    from ds4desk.engine.kernels.quant.gguf_matmul import reference_matmul

    type_id, cols, rows = 8, 512, 3000  # Q8_0: 34 bytes a block
    generator = torch.Generator().manual_seed(3)
    jobs = []
    for _ in range(4):
        blocks = torch.randint(0, 256, (rows, cols // 32, 34), dtype=torch.uint8, generator=generator)
        blocks[:, :, 1] = 0x2C  # fp16 scales of about 0.06: finite, no overflow
        weight = blocks.reshape(rows, -1).contiguous()
        x = torch.randn(1, cols, generator=generator)
        jobs.append((x, weight, reference_matmul(x, weight, type_id, cols, torch.empty(1, rows))))
    errors: list[float] = []

    def run(x: torch.Tensor, weight: torch.Tensor, want: torch.Tensor) -> None:
        out = torch.empty(1, rows)
        for _ in range(50):
            gguf_cpu.matmul(x, weight, type_id, cols, out)
            errors.append((out - want).abs().max().item() / want.abs().max().item())

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 200 and max(errors) < 1e-5


@pytest.mark.slow
def test_a_layer_left_to_the_torch_steps_among_fused_ones(smollm, monkeypatch) -> None:
    """Where one layer of a shard is not the kernel's, the others run one fused call each and that
    one on the torch steps: still the torch steps' logits."""
    smollm.allocate_cache(64)
    torch_steps = _decode(smollm, 40, 3, False, monkeypatch)
    smollm.allocate_cache(64)
    odd = smollm._plans[3]
    for plan in smollm._plans:
        plan.cpu_layer = None
    odd.cpu_layer = cpu_decode._Unfit(odd.kv_cache)  # as cached_layer leaves a layer it cannot run
    mixed = _decode(smollm, 40, 3, True, monkeypatch)
    assert _paths_used(smollm) == {"FusedLayer", "_Unfit"}
    assert (mixed - torch_steps).abs().max().item() <= TOLERANCE


@pytest.mark.slow
def test_two_models_decoding_at_once_each_get_their_logits(smollm, monkeypatch) -> None:
    """One token's layers hold the decode team; a second caller meanwhile runs its layers on its
    own thread. Two models decoding on two threads must each match their run alone."""
    import threading

    other = load_model(read_source(smollm2_gguf()), CPU, torch.float32).model
    for model in (smollm, other):
        model.allocate_cache(64)
    alone = [_decode(model, 30 + 7 * i, 8, True, monkeypatch) for i, model in enumerate((smollm, other))]
    together: list[torch.Tensor | None] = [None, None]

    def run(index: int, model) -> None:
        together[index] = _decode(model, 30 + 7 * index, 8, True, monkeypatch)

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate((smollm, other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for want, got in zip(alone, together, strict=True):
        assert got is not None and (got - want).abs().max().item() <= TOLERANCE


@pytest.fixture(scope="module")
def wide_groups(tmp_path_factory):
    """A Q8_0 llama of 18 query heads on one kv head, 80 wide (llama.cpp's quantizer): the fused
    attention takes the group 8 + 8 + 2 heads at a time, and 80 / 16 = 5 vectors a row leave a tail
    after the 2- and 8-vector runs of value rows."""
    pytest.importorskip("llama_cpp")
    from tests.engine.gguf_fakes import WideSizes, quantize_with_llama_cpp, wide_weights, write_wide_gguf

    sizes = WideSizes(hidden=256, ffn=512, heads=18, kv_heads=1, head_dim=80, layers=2)
    folder = tmp_path_factory.mktemp("wide_groups")
    source = write_wide_gguf(folder / "f32.gguf", "llama", wide_weights("llama", sizes, seed=3), sizes)
    path = quantize_with_llama_cpp(source, folder / "q8.gguf", "Q8_0", pure=True)
    model = load_model(read_source(path), CPU, torch.float32).model
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim) == (18, 1, 80)
    return model


@pytest.mark.slow
def test_many_heads_on_one_kv_head_decode_as_the_torch_steps(wide_groups, monkeypatch) -> None:
    # 300 cached positions: two attention segments of 256.
    _compare(wide_groups, 300, 3, monkeypatch)
