"""Qwen3.5 dense text against transformers (float32, random weights): prefill in chunks (the
chunked delta rule, and chunk 1: the recurrent step), token-by-token decode against transformers'
own cached decode, the graphable step, the vision-language checkpoint layout, and what the model
refuses (running from a position its state is not at, cutting its state, a layer split)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.kernels.quant.gguf_quantize import quantize
from ds4desk.engine.loader import fill, load_model, plan_load, requantize_types
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models import base
from ds4desk.engine.models.qwen3_5.config import Qwen35Config
from ds4desk.engine.models.qwen3_5.model import Qwen35Model
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.split import ShardPlan
from tests.engine.models.qwen3_5.tiny import FULL, LINEAR, TINY, make_hf_model, save_tiny
from tests.engine.tiny_dense import source_from_folder

CPU = torch.device("cpu")
CONTEXT = 160
PROMPT_LENGTH = 150  # two full chunks of the delta rule (64) and a partial one


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, ModelSource]:
    return save_tiny(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def reference_logits(saved) -> torch.Tensor:
    hf, _ = saved
    with torch.inference_mode():
        return hf(prompt(PROMPT_LENGTH)[None]).logits[0].float()


def load(source: ModelSource, context: int = CONTEXT, dtype: torch.dtype = torch.float32) -> Qwen35Model:
    model = load_model(source, CPU, dtype).model
    assert isinstance(model, Qwen35Model)
    model.allocate_cache(context)
    return model


def prefill_in_chunks(model: Qwen35Model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    with torch.inference_mode():
        parts = [model.forward(ids[s : s + chunk], s, "all") for s in range(0, ids.shape[0], chunk)]
    return torch.cat(parts)


def test_the_config_reads_as_intended(saved) -> None:
    cfg = Qwen35Config.from_hf(saved[1].config)
    assert cfg.layer_types == (LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL)
    assert cfg.linear_layers == [0, 1, 3, 4] and cfg.full_layers == [2, 5]
    assert cfg.rotary_dim == 6  # a quarter of head_dim 24
    assert cfg.conv_channels == 2 * 2 * 8 + 4 * 12
    assert cfg.weight_prefix == "model" and not cfg.tie_word_embeddings
    # Without layer_types, every fourth layer is full attention (transformers' default interval).
    derived = {k: v for k, v in saved[1].config.items() if k != "layer_types"}
    derived["num_hidden_layers"] = 8
    assert Qwen35Config.from_hf(derived).full_layers == [3, 7]
    for bad, word in (
        ({"layer_types": [LINEAR] * 5 + ["sliding_attention"]}, "unknown"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"num_experts": 8}, "num_experts_per_tok"),  # half a MoE config (test_moe.py has the rest)
        ({"linear_num_value_heads": 3}, "multiple"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope"),
    ):
        with pytest.raises(EngineFailure) as refused:
            Qwen35Config.from_hf({**saved[1].config, **bad})
        assert refused.value.error.code == ErrorCode.LOAD_FAILED and word in refused.value.error.detail


def test_one_shot_prefill_matches_transformers(saved, reference_logits) -> None:
    ours = prefill_in_chunks(load(saved[1]), prompt(PROMPT_LENGTH), PROMPT_LENGTH)
    assert ours.dtype == torch.float32 and ours.shape == reference_logits.shape
    assert max(relative_error(ours[i], reference_logits[i]) for i in range(PROMPT_LENGTH)) < 1e-4


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot_and_transformers(saved, reference_logits, chunk: int) -> None:
    """Chunk 1 runs the recurrent step at every position; 7 and 64 carry the conv window and the
    recurrent state across chunk edges that fall inside and at the delta rule's own chunks."""
    model = load(saved[1])
    ids = prompt(PROMPT_LENGTH)
    one_shot = prefill_in_chunks(model, ids, PROMPT_LENGTH)
    ours = prefill_in_chunks(model, ids, chunk)
    assert model.length == PROMPT_LENGTH
    assert max(relative_error(ours[i], one_shot[i]) for i in range(PROMPT_LENGTH)) < 1e-4
    assert max(relative_error(ours[i], reference_logits[i]) for i in range(PROMPT_LENGTH)) < 1e-4


def transformers_decode(
    hf: torch.nn.Module, ids: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own incremental decode: the prompt once, then one greedy token at a time
    through its cache (conv and recurrent states, KV). The picked tokens and each step's logits."""
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
        logits, cache = out.logits[0, -1].float(), out.cache
        tokens, seen = [], [logits]
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits, cache = out.logits[0, -1].float(), out.cache
            seen.append(logits)
    return tokens, seen


def test_decode_token_by_token_matches_transformers_cached_decode(saved) -> None:
    hf, source = saved
    model = load(source)
    ids = prompt(30, seed=2).tolist()
    expected_tokens, expected = transformers_decode(hf, ids, 20)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids), 0, "last")
        got, tokens = [logits], []
        for _ in range(20):
            tokens.append(int(logits.argmax()))
            logits = model.forward(torch.tensor(tokens[-1:]), len(ids) + len(tokens) - 1, "last")
            got.append(logits)
    assert tokens == expected_tokens
    assert got[0].shape == (TINY["vocab_size"],)
    for ours, ref in zip(got, expected, strict=True):
        assert relative_error(ours, ref) < 1e-4


def test_the_graphable_step_equals_forward(saved) -> None:
    """decode_graphable (device-side position, a span past it) writes the same state and returns
    the same logits as forward; set_length then lets forward continue after it."""
    _, source = saved
    eager, graphable = load(source), load(source)
    ids = prompt(20, seed=3)
    with torch.inference_mode():
        eager.forward(ids, 0, "none")
        graphable.forward(ids, 0, "none")
        for step in range(6):
            at = 20 + step
            token = torch.tensor([int(ids[step])])
            expected = eager.forward(token, at, "last")
            got = graphable.decode_graphable(token, torch.tensor([at]), span=64)
            graphable.set_length(at + 1)
            assert relative_error(got, expected) < 1e-5
        tail = torch.tensor([5, 6, 7])
        assert relative_error(graphable.forward(tail, 26, "all"), eager.forward(tail, 26, "all")) < 1e-5
    for name, value in eager.export_state(29).items():
        torch.testing.assert_close(graphable.export_state(29)[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("start", "real"), [(20, 5), (20, 16), (0, 9)])
def test_a_padded_prompt_piece_equals_forward(saved, start: int, real: int) -> None:
    """prefill_graphable on 16 tokens of which `real` are the prompt's (the rest junk): its logits
    at the last real token, and the state it leaves, equal forward over the real tokens alone; from
    position 0 it starts over from a state a request before left behind."""
    _, source = saved
    eager, graphable = load(source), load(source)
    ids, junk = prompt(start + real, seed=4), prompt(16, seed=5)
    with torch.inference_mode():
        graphable.forward(prompt(30, seed=6), 0, "none")  # a previous request's state
        if start:
            eager.forward(ids[:start], 0, "none")
            graphable.forward(ids[:start], 0, "none")
        expected = eager.forward(ids[start:], start, "all")
        piece = torch.cat((ids[start:], junk[real:]))
        got = graphable.prefill_graphable(piece, torch.tensor([start]), torch.tensor([real]), span=64)
        assert got is not None
        graphable.set_length(start + real)
        assert got.shape == expected[-1].shape and relative_error(got, expected[-1]) < 1e-5
        for name, value in eager.export_state(start + real).items():
            torch.testing.assert_close(
                graphable.export_state(start + real)[name], value, rtol=1e-4, atol=1e-4
            )
        token = torch.tensor([3])
        after = graphable.forward(token, start + real, "last")
        assert relative_error(after, eager.forward(token, start + real, "last")) < 1e-5


@pytest.mark.parametrize("kept", [0, 2, 5])
def test_a_graphable_verify_equals_forward_and_rolls_back(saved, kept: int) -> None:
    """verify_graphable of 5 tokens at a device position: forward's logits at every row, and a
    roll-back to `kept` of them (from what it recorded) leaves the state forward over those alone
    leaves."""
    _, source = saved
    eager, graphable = load(source), load(source)
    ids = prompt(30, seed=9)
    with torch.inference_mode():
        for model in (eager, graphable):
            model.forward(ids[:20], 0, "none")
        expected = eager.forward(ids[20:25], 20, "all")
        saved_state = graphable.verify_checkpoint(20, 5)
        got = graphable.verify_graphable(ids[20:25], torch.tensor([20]), span=64)
        assert got is not None and got.shape == expected.shape
        assert relative_error(got, expected) < 1e-5
        graphable.set_length(25)
        graphable.verify_rollback(saved_state, 20, kept)
        reference = load(source)
        reference.forward(ids[: 20 + kept], 0, "none")
        for name, value in reference.export_state(20 + kept).items():
            torch.testing.assert_close(graphable.export_state(20 + kept)[name], value, rtol=1e-4, atol=1e-4)
        token = ids[20 + kept : 21 + kept]
        after = graphable.forward(token, 20 + kept, "last")
        assert relative_error(after, reference.forward(token, 20 + kept, "last")) < 1e-5


def test_the_runtime_generates_transformers_greedy_tokens(saved) -> None:
    hf, source = saved
    runtime = Runtime(load(source), CPU, context=CONTEXT, chunk=7)
    ids = prompt(20, seed=8).tolist()
    outcome = runtime.generate(ids, SamplingParams(), 24, set(), lambda _t: None, lambda: False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert outcome.tokens == ref[0, len(ids) :].tolist()


def test_the_state_only_moves_forward(saved) -> None:
    """A recurrent state holds exactly the positions run: running from another position, or
    exporting a shorter state, is refused; position 0 starts over."""
    model = load(saved[1])
    ids = prompt(12)
    with torch.inference_mode():
        first = model.forward(ids, 0, "all")
        with pytest.raises(ValueError, match="only moves forward"):
            model.forward(ids[:2], 5, "last")
        with pytest.raises(ValueError, match="cannot be cut"):
            model.export_state(8)
        again = model.forward(ids, 0, "all")  # starts over: the old state is gone
    torch.testing.assert_close(again, first)
    empty = model.export_state(0)
    assert empty["kv"].shape[3] == 0 and not empty["conv"].any() and not empty["recurrent"].any()


@pytest.mark.parametrize("counts", [(3, 3), (1, 2, 3)])
def test_a_layer_split_equals_one_device(saved, monkeypatch, counts: tuple[int, ...]) -> None:
    """Shards over CPU "devices": each keeps its layers' state; the hidden state crosses every
    boundary (prefill and each graphable decode step); logits and the joined snapshot payload equal
    the unsplit model's, and a payload moves between a split and an unsplit model."""
    _, source = saved
    crossings = []
    real_hand_over = base.hand_over

    def spy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        crossings.append(tuple(x.shape))
        return real_hand_over(x, device)

    monkeypatch.setattr(base, "hand_over", spy)
    whole = load(source)
    split_model = load_model(
        source, CPU, torch.float32, split=ShardPlan(("cpu",) * len(counts), counts)
    ).model
    assert isinstance(split_model, Qwen35Model) and len(split_model.decode_devices()) == len(counts)
    split_model.allocate_cache(CONTEXT)
    ids = prompt(40, seed=4)
    with torch.inference_mode():
        expected = torch.cat([whole.forward(ids[:33], 0, "all"), whole.forward(ids[33:], 33, "all")])
        got = torch.cat([split_model.forward(ids[:33], 0, "all"), split_model.forward(ids[33:], 33, "all")])
        assert relative_error(got, expected) < 1e-6
        assert len(crossings) == 2 * (len(counts) - 1)
        token = torch.tensor([9])
        stepped = split_model.decode_graphable(token, torch.tensor([40]), span=64)
        split_model.set_length(41)
        assert relative_error(stepped, whole.forward(token, 40, "last")) < 1e-6
        state = split_model.export_state(41)
        for name, value in whole.export_state(41).items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6)
        fresh = load(source)
        fresh.import_state(state, 41)  # a split's payload restores into an unsplit model
        split_model.import_state(whole.export_state(41), 41)  # and the other way
        tail = torch.tensor([3, 4])
        assert relative_error(fresh.forward(tail, 41, "all"), split_model.forward(tail, 41, "all")) < 1e-6


def test_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    hf, source = save_tiny(tmp_path, seed=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in source.tensors
    ids = prompt(40)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    assert relative_error(prefill_in_chunks(load(source), ids, 40), ref) < 1e-4


def test_the_vision_language_layout_loads_its_text_model(tmp_path: Path) -> None:
    """The published checkpoints are Qwen3_5ForConditionalGeneration: text settings in text_config,
    weights under model.language_model.*, a vision tower beside them (not loaded). Their text path
    equals transformers' on token ids."""
    import transformers

    torch.manual_seed(5)
    text = make_hf_model(seed=5).config.to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, architectures=["Qwen3_5ForConditionalGeneration"]
    )
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(-3.0, 1.0)
            elif name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
            else:
                param.normal_(0.0, 0.08)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    source = source_from_folder(tmp_path)
    saved_config = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in saved_config and "hidden_size" not in saved_config
    assert any(name.startswith("model.visual.") for name in source.tensors)
    model = load(source)
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name, _ in model.named_parameters())
    ids = prompt(40, seed=6)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0]
    assert relative_error(prefill_in_chunks(model, ids, 16), ref) < 1e-4


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(saved, reference_logits) -> None:
    hf, source = saved
    model = load(source, dtype=torch.bfloat16)
    ids = prompt(PROMPT_LENGTH)
    with torch.inference_mode():
        ours = model.forward(ids, 0, "all")
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.export_state(PROMPT_LENGTH)["recurrent"].dtype == torch.float32
    ours_error, theirs_error = (
        relative_error(ours, reference_logits),
        relative_error(theirs, reference_logits),
    )
    assert ours_error < 1.25 * theirs_error + 1e-3


def test_a_published_style_vision_language_config_reads_its_text_part() -> None:
    """The published config.json layout (written here by hand, sizes invented): the text settings
    in text_config with multimodal RoPE keys, the head tied by the top-level flag, vision and MTP
    settings beside them (ignored)."""
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "image_token_id": 9,
        "vision_config": {"depth": 2, "hidden_size": 32},
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 1000,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "mtp_num_hidden_layers": 1,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        },
    }
    cfg = Qwen35Config.from_hf(config)
    assert cfg.weight_prefix == "model.language_model" and cfg.tie_word_embeddings
    assert cfg.full_layers == [3, 7] and len(cfg.linear_layers) == 6
    assert (cfg.rotary_dim, cfg.rope.theta, cfg.max_position_embeddings) == (16, 10_000_000.0, 4096)
    assert cfg.conv_channels == 2 * 4 * 32 + 8 * 32


@pytest.mark.parametrize("chunk", [PROMPT_LENGTH, 7, 64])
def test_prefill_laid_out_for_fused_gpu_kernels_matches_transformers(
    saved, reference_logits, chunk: int
) -> None:
    """The GPU's prefill attention (SDPA, repeated kv heads, the causal flag from position 0 and a
    lower-right causal bias for later chunks) run on the CPU."""
    model = load(saved[1])
    assert not model.fused_attention  # the CPU's choice
    model.fused_attention = True
    ours = prefill_in_chunks(model, prompt(PROMPT_LENGTH), chunk)
    assert max(relative_error(ours[i], reference_logits[i]) for i in range(PROMPT_LENGTH)) < 1e-4


@pytest.mark.parametrize("weights", ["q8", "q4"])
def test_weights_quantized_while_loading_equal_transformers_on_the_same_blocks(saved, weights: str) -> None:
    """`--weights q8 / q4`: every 2-D weight kept in GGUF blocks (PackedLinear, PackedEmbedding)
    computes what transformers computes with those blocks dequantized."""
    hf, source = saved
    types = requantize_types(source, weights)
    assert {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.2.self_attn.q_proj.weight"} <= set(
        types
    )
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if name in types:
                blocks = quantize(param.data, types[name])
                param.copy_(gguf.dequantize(blocks, types[name], tuple(param.shape)))
    model = fill(plan_load(source, CPU, torch.float32, CONTEXT, weights=weights)).model
    assert isinstance(model, Qwen35Model)
    model.allocate_cache(CONTEXT)
    ids = prompt(70, seed=9)
    with torch.inference_mode():
        ref = rounded(ids[None]).logits[0]
    assert relative_error(prefill_in_chunks(model, ids, 32), ref) < 1e-4
