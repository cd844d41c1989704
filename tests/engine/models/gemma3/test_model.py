"""Gemma 3 text against transformers (float32, random weights): chunked prefill, one-token decode,
the graphable step, snapshots and a layer split, on prompts longer than the sliding window so the
local layers really drop keys."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models import base
from ds4desk.engine.models.gemma3.config import Gemma3Config
from ds4desk.engine.models.gemma3.model import Gemma3Model
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.split import ShardPlan
from tests.engine.models.gemma3.tiny import CONFIGS, save_tiny
from tests.engine.tiny_dense import source_from_folder

CPU = torch.device("cpu")
KINDS = list(CONFIGS)
CONTEXT = 96
PROMPT_LENGTH = 80  # 16x the tiny window, 5x the scaled 270M's


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def prompt(source: ModelSource, length: int, seed: int = 1) -> torch.Tensor:
    vocab = source.config["vocab_size"]
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def older_spelling(folder: Path) -> None:
    """Rewrite a saved config.json as Gemma 3 checkpoints from before transformers 5 spell it: no
    layer_types (a sliding_window_pattern), rope_theta + rope_local_base_freq, rope_scaling null."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config["rope_theta"] = rope["full_attention"]["rope_theta"]
    config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    config["rope_scaling"] = None
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, ModelSource]]:
    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(f"gemma3-{kind}")
        hf, _ = save_tiny(folder, kind)
        if kind == "270m":
            older_spelling(folder)
        out[kind] = (hf, source_from_folder(folder))
    return out


def load(source: ModelSource, split: ShardPlan | None = None, context: int = CONTEXT) -> Gemma3Model:
    model = load_model(source, CPU, torch.float32, split=split).model
    assert isinstance(model, Gemma3Model)
    model.allocate_cache(context)
    return model


def reference(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def prefill_in_chunks(model: Gemma3Model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    with torch.inference_mode():
        parts = [model.forward(ids[s : s + chunk], s, "all") for s in range(0, ids.shape[0], chunk)]
    return torch.cat(parts)


# --- the model against transformers --------------------------------------------------------------


def test_the_configs_read_as_intended(saved) -> None:
    tiny = Gemma3Config.from_hf(saved["tiny"][1].config)
    assert tiny.sliding_windows == (5, 5, None, 5, 5, None)
    assert tiny.global_rope.kind == "linear" and tiny.global_rope.factor == 4.0
    assert (tiny.local_rope.theta, tiny.global_rope.theta) == (10_000.0, 1_000_000.0)
    assert tiny.attention_scale == 24**-0.5
    scaled = Gemma3Config.from_hf(saved["270m"][1].config)
    assert "layer_types" not in saved["270m"][1].config  # the older spelling, read from the pattern
    assert scaled.sliding_windows == (16,) * 5 + (None,)
    assert (scaled.local_rope.theta, scaled.global_rope.theta) == (10_000.0, 1_000_000.0)
    assert scaled.global_rope.kind == "default"
    # The older spelling's rope_scaling (the 4B+ models': linear, factor 8) scales the global layers only.
    older = {**saved["270m"][1].config, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    del older["rope_local_base_freq"]
    scaled = Gemma3Config.from_hf(older)
    assert (scaled.global_rope.kind, scaled.global_rope.factor, scaled.global_rope.theta) == (
        "linear",
        8.0,
        1_000_000.0,
    )
    assert (scaled.local_rope.kind, scaled.local_rope.theta) == ("default", 10_000.0)  # transformers' default


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_transformers(saved, kind: str, chunk: int) -> None:
    """Chunk 1 is the one-token decode path at every position; 7 and 64 start chunks past the
    window, so local layers read a window that begins mid-cache."""
    hf, source = saved[kind]
    ids = prompt(source, PROMPT_LENGTH)
    ref = reference(hf, ids)
    ours = prefill_in_chunks(load(source), ids, chunk)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    worst = max(relative_error(ours[i], ref[i]) for i in range(ids.shape[0]))
    assert worst < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_laid_out_for_fused_gpu_kernels_matches_transformers(saved, kind: str) -> None:
    """The GPU's prefill layout (repeated kv heads, the causal flag) run on the CPU."""
    hf, source = saved[kind]
    ids = prompt(source, PROMPT_LENGTH)
    model = load(source)
    assert not model.fused_attention  # the CPU's choice
    model.fused_attention = True
    ref = reference(hf, ids)
    for chunk in (80, 7, 64):  # the causal flag from position 0, and aligned to later chunks
        ours = prefill_in_chunks(model, ids, chunk)
        assert max(relative_error(ours[i], ref[i]) for i in range(ids.shape[0])) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_matches_transformers(saved, kind: str) -> None:
    """Prefill, then decode steps fed their own greedy picks: each step's logits equal transformers'
    over the whole sequence so far, and the last modes behave."""
    hf, source = saved[kind]
    model = load(source)
    ids = prompt(source, 30, seed=2).tolist()
    with torch.inference_mode():
        assert model.forward(torch.tensor(ids[:-3]), 0, "none") is None
        logits = model.forward(torch.tensor(ids[-3:]), len(ids) - 3, "last")
        steps = [logits]
        for _ in range(12):
            ids.append(int(logits.argmax()))
            logits = model.forward(torch.tensor(ids[-1:]), len(ids) - 1, "last")
            steps.append(logits)
    ref = reference(hf, torch.tensor(ids))
    assert steps[0].shape == (source.config["vocab_size"],)
    for offset, got in enumerate(steps):
        assert relative_error(got, ref[len(ids) - len(steps) + offset]) < 1e-4


def test_runtime_greedy_generation_matches_transformers_generate(saved) -> None:
    """The runtime's chunked prefill and decode loop pick transformers' greedy tokens, well past
    the window."""
    hf, source = saved["270m"]
    runtime = Runtime(load(source), CPU, context=CONTEXT, chunk=7)
    ids = prompt(source, 20, seed=8).tolist()
    outcome = runtime.generate(ids, SamplingParams(), 24, set(), lambda _t: None, lambda: False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert outcome.tokens == ref[0, len(ids) :].tolist()


def test_final_logit_softcapping_matches_transformers(tmp_path: Path) -> None:
    hf, source = save_tiny(tmp_path, "tiny", seed=3, final_logit_softcapping=0.5)
    ids = prompt(source, 20)
    ref = reference(hf, ids)
    assert float(ref.abs().max()) < 0.5  # the cap really bites
    ours = prefill_in_chunks(load(source), ids, 8)
    assert relative_error(ours, ref) < 1e-4


def test_untied_head_matches_transformers(tmp_path: Path) -> None:
    hf, source = save_tiny(tmp_path, "tiny", seed=4, tie_word_embeddings=False)
    assert "lm_head.weight" in source.tensors
    ids = prompt(source, 20)
    assert relative_error(prefill_in_chunks(load(source), ids, 20), reference(hf, ids)) < 1e-4


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(saved) -> None:
    """bfloat16 rounding moves random tiny models by a few percent; ours must not move further
    from the float32 reference than transformers' own bfloat16 run does."""
    hf, source = saved["tiny"]
    model = load_model(source, CPU, torch.bfloat16).model
    model.allocate_cache(CONTEXT)
    ids = prompt(source, 40)
    ref = reference(hf, ids)
    with torch.inference_mode():
        ours = model.forward(ids, 0, "all")
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert relative_error(ours, ref) < 1.25 * relative_error(theirs, ref) + 1e-3
    assert relative_error(ours, ref) < 5e-2


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_names_are_transformers_names(saved, kind: str) -> None:
    hf, source = saved[kind]
    model = load(source)
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())  # drops the tied lm_head, as we do
    assert set(ours) == set(theirs)
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name
    assert "model.layers.0.pre_feedforward_layernorm.weight" in ours
    assert "lm_head.weight" not in ours
    # Float q/k/v (and gate/up) are row ranges of one tensor: one matmul each, no second copy.
    attn = model.model.layers[0].self_attn
    fused, _ = model.model.layers[0].fused["qkv"]
    assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.weight.shape[0] :].data_ptr()


def test_a_model_built_without_the_loader_runs_its_parts_unfused(saved) -> None:
    """Filled by load_state_dict on the CPU (no materialize): each projection reads its own weight."""
    hf, source = saved["tiny"]
    model = Gemma3Model(Gemma3Config.from_hf(source.config), torch.float32)
    model.load_state_dict(hf.state_dict(), strict=False)
    model.finish_loading()
    model.allocate_cache(CONTEXT)
    assert model.model.layers[0].fused == {}
    ids = prompt(source, 30)
    assert relative_error(prefill_in_chunks(model, ids, 11), reference(hf, ids)) < 1e-4


# --- the graphable step, set_length and snapshots -----------------------------------------------


def test_decode_graphable_equals_forward(saved) -> None:
    """The graphed step run eagerly: same logits and cache rows as forward, over a full span and a
    span just past the position; set_length then lets forward continue."""
    _, source = saved["tiny"]
    ids = prompt(source, 3)  # the steps run from inside the first window (5) to well past it
    eager, graphed = load(source), load(source)
    with torch.inference_mode():
        token = eager.forward(ids, 0, "last").argmax().view(1)
        graphed.forward(ids, 0, "none")
        pos = ids.shape[0]
        for step in range(10):
            expected = eager.forward(token, pos, "last")
            span = CONTEXT if step % 2 else pos + 1 + step % 3
            got = graphed.decode_graphable(token, torch.tensor([pos]), span)
            graphed.set_length(pos + 1)
            assert got.shape == expected.shape
            assert relative_error(got, expected) < 1e-5
            token = expected.argmax().view(1)
            pos += 1
        # Every layer's keys and values of every step were written where forward writes them.
        ours, theirs = graphed.export_state(pos), eager.export_state(pos)
        assert ours.keys() == theirs.keys() == {"kv_global", "kv_local"}
        assert all(relative_error(ours[key], theirs[key]) < 1e-5 for key in ours)
        after = graphed.forward(token, pos, "last")
        assert relative_error(after, eager.forward(token, pos, "last")) < 1e-5


def test_export_import_round_trip_continues_identically(saved) -> None:
    _, source = saved["270m"]
    ids = prompt(source, 40, seed=5)

    def greedy(model: Gemma3Model, logits: torch.Tensor, pos: int, steps: int) -> list[torch.Tensor]:
        out = []
        for _ in range(steps):
            logits = model.forward(logits.argmax().view(1), pos, "last")
            out.append(logits)
            pos += 1
        return out

    with torch.inference_mode():
        first = load(source)
        logits = first.forward(ids, 0, "last")
        state = first.export_state(ids.shape[0])
        # Global layers keep all 40 positions, local ones their ring of 16 (the window).
        assert state["kv_global"].device == CPU and state["kv_global"].shape[:4] == (1, 2, 1, 40)
        assert state["kv_local"].device == CPU and state["kv_local"].shape[:4] == (5, 2, 1, 16)
        expected = greedy(first, logits, ids.shape[0], 8)
        # Overwritten by another prompt, then restored; and restored into a fresh model.
        first.forward(prompt(source, 60, seed=6), 0, "none")
        for target in (first, load(source), load(source, context=48)):
            target.import_state(state, ids.shape[0])
            got = greedy(target, logits, ids.shape[0], 8)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


# --- a layer split -------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [(2, 4), (1, 4, 1)])
def test_a_layer_split_gives_the_same_logits(
    saved, layers: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards on several "cpu" devices run the same ops in the same order: bit-identical logits
    through chunked prefill, eager decode and the graphable step, and the same snapshot; every
    boundary hands over a copy."""
    _, source = saved["tiny"]
    ids = prompt(source, 30)
    real = base.hand_over
    copies: list[bool] = []

    def spy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = real(x, device)
        copies.append(torch.equal(out, x) and out.data_ptr() != x.data_ptr())
        return out

    def run(model: Gemma3Model) -> list[torch.Tensor]:
        with torch.inference_mode():
            out = [model.forward(ids[:13], 0, "all"), model.forward(ids[13:], 13, "all")]
            token, pos = out[-1][-1].argmax().view(1), ids.shape[0]
            for step in range(6):
                if step % 2:
                    logits = model.decode_graphable(token, torch.tensor([pos]), CONTEXT)
                    model.set_length(pos + 1)
                else:
                    logits = model.forward(token, pos, "last")
                out.append(logits)
                token, pos = logits.argmax().view(1), pos + 1
            out.extend(model.export_state(pos)[key] for key in ("kv_global", "kv_local"))
        return out

    expected = run(load(source))
    split = load(source, ShardPlan(("cpu",) * len(layers), layers))
    monkeypatch.setattr(base, "hand_over", spy)
    assert [len(shard.plans) for shard in split._shards] == list(layers)
    assert split.decode_devices() == [CPU] * len(layers)
    got = run(split)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step} differs"
    # 2 prefill chunks and 3 eager steps hand over the hidden state, 3 graphed steps it and `pos`.
    assert len(copies) == (len(layers) - 1) * (5 + 3 * 2) and all(copies)


def test_local_layers_keep_a_ring_of_their_window(saved) -> None:
    """The memory the preflight plans is the memory taken: global layers a row per position, local
    layers min(window, context) rows."""
    _, source = saved["tiny"]
    cfg = source.config
    row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    model = load(source)
    for context in (CONTEXT, 4):  # a context shorter than the window: the ring is the context
        model.allocate_cache(context)
        expected = [
            row * (context if kind == "full_attention" else min(5, context)) for kind in cfg["layer_types"]
        ]
        assert model.layer_cache_bytes_for(context) == expected
        assert model.cache_bytes() == model.cache_bytes_for(context) == sum(expected)


def test_a_context_shorter_than_the_window_matches_transformers(saved) -> None:
    hf, source = saved["270m"]  # window 16
    ids = prompt(source, 12)
    ref = reference(hf, ids)
    model = load(source, context=12)
    ours = prefill_in_chunks(model, ids[:7], 4)
    with torch.inference_mode():
        steps = [model.forward(ids[i : i + 1], i, "last") for i in range(7, 10)]
        steps += [model.decode_graphable(ids[i : i + 1], torch.tensor([i]), 12) for i in (10, 11)]
    assert relative_error(ours, ref[:7]) < 1e-4
    assert all(relative_error(got, ref[7 + i]) < 1e-4 for i, got in enumerate(steps))


# --- what the model refuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "silu"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_invalid_config_is_load_failed(saved, change: dict[str, Any], named: str) -> None:
    _, source = saved["tiny"]
    with pytest.raises(EngineFailure) as info:
        load_model(dataclasses.replace(source, config={**source.config, **change}), CPU, torch.float32)
    assert info.value.error.code == ErrorCode.LOAD_FAILED
    assert named in info.value.error.detail


def test_forward_past_the_cache_is_context_overflow(saved) -> None:
    model = load(saved["tiny"][1], context=8)
    with pytest.raises(EngineFailure) as info:
        model.forward(torch.tensor([1, 2, 3, 4]), 6, "last")
    assert info.value.error.code == ErrorCode.CONTEXT_OVERFLOW
