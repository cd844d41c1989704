"""Qwen3.5 MoE text against transformers' `qwen3_5_moe` (float32, random weights): the config, the
checkpoint names and the stacked experts, prefill in chunks, token-by-token decode against
transformers' own cached decode, the two ways the sparse block runs (grouped by expert, and picked
by index without a host sync) against each other, only the picked experts running, experts packed
while loading, a layer split, and the vision-language layout's text path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, SamplingParams
from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.kernels.quant.gguf_quantize import quantize
from ds4desk.engine.loader import fill, load_model, plan_load, requantize_types
from ds4desk.engine.loading.source import ModelSource
from ds4desk.engine.models.packed import PackedLinear, Projection
from ds4desk.engine.models.qwen3_5 import moe
from ds4desk.engine.models.qwen3_5.config import STACKED_EXPERTS_KEY, Qwen35Config
from ds4desk.engine.models.qwen3_5.model import Qwen35Model
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.split import ShardPlan
from tests.engine.models.qwen3_5.tiny import (
    TINY_MOE,
    make_hf_moe_model,
    randomized,
    save_tiny_moe,
    save_tiny_moe_stacked,
)
from tests.engine.tiny_dense import source_from_folder
from tests.engine.triton_check import run_triton_check

CPU = torch.device("cpu")
CONTEXT = 160
PROMPT_LENGTH = 150  # two full chunks of the delta rule (64) and a partial one
EXPERTS, TOP_K = TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def worst_row_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return max(relative_error(ours[i], ref[i]) for i in range(ref.shape[0]))


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY_MOE["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, ModelSource]:
    return save_tiny_moe(tmp_path_factory.mktemp("qwen3_5_moe"))


@pytest.fixture(scope="module")
def reference_logits(saved) -> torch.Tensor:
    hf, _ = saved
    with torch.inference_mode():
        return hf(prompt(PROMPT_LENGTH)[None]).logits[0].float()


def load(source: ModelSource, context: int = CONTEXT) -> Qwen35Model:
    model = load_model(source, CPU, torch.float32).model
    assert isinstance(model, Qwen35Model)
    model.allocate_cache(context)
    return model


def prefill_in_chunks(model: Qwen35Model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    with torch.inference_mode():
        parts = [model.forward(ids[s : s + chunk], s, "all") for s in range(0, ids.shape[0], chunk)]
    return torch.cat(parts)


def test_the_moe_config_reads_as_intended(saved) -> None:
    config = saved[1].config
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and "intermediate_size" not in config
    cfg = Qwen35Config.from_hf(config)
    assert cfg.is_moe and (cfg.num_experts, cfg.experts_per_token) == (EXPERTS, TOP_K)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (32, 48)
    assert not cfg.stacked_experts  # save_pretrained's layout: a weight per expert
    assert Qwen35Config.from_hf({**config, STACKED_EXPERTS_KEY: True}).stacked_experts
    for bad, word in (
        ({"num_experts_per_tok": EXPERTS + 1}, "more than num_experts"),
        ({"num_experts": 10**9}, "more than ds4desk loads"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
    ):
        with pytest.raises(EngineFailure) as refused:
            Qwen35Config.from_hf({**config, **bad})
        assert refused.value.error.code == ErrorCode.LOAD_FAILED and word in refused.value.error.detail


def test_parameters_are_the_checkpoints_and_the_experts_are_stacked_views(saved) -> None:
    """save_pretrained writes every expert as three 2-D weights; the model names exactly those, and
    after loading each expert's weights are rows of one stacked tensor per layer (no second copy)."""
    hf, source = saved
    model = load(source)
    ours = dict(model.named_parameters())
    assert set(ours) == set(source.tensors)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in ours
    assert model.supports_graphs
    block = model.model.layers[3].mlp
    assert isinstance(block, moe.SparseMoeBlock)
    plan = moe.plan_of(block, TOP_K)
    assert plan.stacked_gate_up is not None and plan.stacked_down is not None
    assert plan.stacked_gate_up.shape == (EXPERTS, 2 * 32, TINY_MOE["hidden_size"])
    expert = block.experts[5]
    assert expert.up_proj.weight.data_ptr() == plan.stacked_gate_up[5, 32:].data_ptr()
    assert expert.down_proj.weight.data_ptr() == plan.stacked_down[5].data_ptr()
    # transformers holds them fused in memory (its own [E, 2I, hidden] / [E, hidden, I]).
    theirs = hf.model.layers[3].mlp.experts
    torch.testing.assert_close(plan.stacked_gate_up, theirs.gate_up_proj.detach())
    torch.testing.assert_close(plan.stacked_down, theirs.down_proj.detach())


@pytest.mark.parametrize("chunk", [PROMPT_LENGTH, 1, 7, 64])
def test_chunked_prefill_matches_transformers(saved, reference_logits, chunk: int) -> None:
    """Every chunk groups its tokens by expert; chunk 1 is eager decode's path (a token's k experts)."""
    model = load(saved[1])
    ours = prefill_in_chunks(model, prompt(PROMPT_LENGTH), chunk)
    assert ours.dtype == torch.float32 and ours.shape == reference_logits.shape
    assert model.length == PROMPT_LENGTH
    assert worst_row_error(ours, reference_logits) < 1e-4


def transformers_decode(
    hf: torch.nn.Module, ids: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own incremental decode: the prompt once, then one greedy token at a time
    through its cache. The picked tokens and each step's logits."""
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
    for ours, ref in zip(got, expected, strict=True):
        assert relative_error(ours, ref) < 1e-4


def test_the_graphable_step_equals_forward(saved) -> None:
    """decode_graphable picks experts by index on the device; forward groups them on the host (the
    two sum in other orders: the states agree to float32 rounding)."""
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
    for name, value in eager.export_state(26).items():
        torch.testing.assert_close(graphable.export_state(26)[name], value, rtol=1e-4, atol=1e-5)


def test_the_block_picked_by_index_equals_grouped_by_expert_and_transformers(saved) -> None:
    """The one-token path (experts gathered by index on the device) and the grouped path give the
    same output token by token, and both equal transformers' own sparse block."""
    hf, source = saved
    model = load(source)
    block = model.model.layers[1].mlp
    assert isinstance(block, moe.SparseMoeBlock)
    plan = moe.plan_of(block, TOP_K)
    x = torch.randn(12, TINY_MOE["hidden_size"], generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        grouped = moe.forward(plan, x)
        one_by_one = torch.cat([moe.forward(plan, x[i : i + 1], graphable=True) for i in range(12)])
        reference = hf.model.layers[1].mlp(x[None])[0]
    assert relative_error(one_by_one, grouped) < 1e-6
    assert relative_error(grouped, reference) < 1e-6


def test_only_the_picked_experts_run(saved) -> None:
    """A chunk runs each picked expert once, on exactly the tokens that picked it; the others never."""
    _, source = saved
    model = load(source)
    block = model.model.layers[0].mlp
    assert isinstance(block, moe.SparseMoeBlock)
    plan = moe.plan_of(block, TOP_K)
    rows: dict[int, int] = {}

    def counting(expert: int, projection: Projection) -> Projection:
        def call(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            rows[expert] = rows.get(expert, 0) + x.shape[0]
            return projection(x, out)

        return call  # type: ignore[return-value]

    plan.gate_up = [counting(e, p) for e, p in enumerate(plan.gate_up)]
    x = torch.randn(3, TINY_MOE["hidden_size"], generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        chosen, _ = moe.route(plan, x)
        moe.forward(plan, x)
    expected = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    assert rows == {e: int(n) for e, n in enumerate(expected) if n}
    assert sum(rows.values()) == 3 * TOP_K and len(rows) < EXPERTS  # 3 tokens reach 6 of 8 at most


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(saved, reference_logits) -> None:
    hf, source = saved
    model = load_model(source, CPU, torch.bfloat16).model
    assert isinstance(model, Qwen35Model)
    model.allocate_cache(CONTEXT)
    ids = prompt(PROMPT_LENGTH)
    with torch.inference_mode():
        ours = torch.cat([model.forward(ids[:100], 0, "all"), model.forward(ids[100:], 100, "all")])
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    block = model.model.layers[0].mlp
    assert isinstance(block, moe.SparseMoeBlock) and block.experts[0].gate_proj.weight.dtype == torch.bfloat16
    ours_error, theirs_error = (
        relative_error(ours, reference_logits),
        relative_error(theirs, reference_logits),
    )
    assert ours_error < 1.25 * theirs_error + 1e-3


def test_the_runtime_generates_transformers_greedy_tokens(saved) -> None:
    hf, source = saved
    runtime = Runtime(load(source), CPU, context=CONTEXT, chunk=7)
    ids = prompt(20, seed=8).tolist()
    outcome = runtime.generate(ids, SamplingParams(), 24, set(), lambda _t: None, lambda: False)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert outcome.tokens == ref[0, len(ids) :].tolist()


def test_experts_quantized_while_loading_equal_transformers_on_the_same_blocks(saved) -> None:
    """`--weights q8`: every expert kept in Q8_0 blocks (PackedLinear, not stacked: decode picks them
    on the host, so no CUDA graph) computes what transformers computes on those blocks dequantized."""
    hf, source = saved
    types = requantize_types(source, "q8")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in types
    assert (
        types["model.layers.0.mlp.experts.3.gate_proj.weight"]
        == types["model.layers.0.mlp.experts.3.up_proj.weight"]
    )
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            # transformers holds each layer's experts fused ([E, 2I, hidden] gate then up, and
            # [E, hidden, I]): each expert's rows rounded by the type of its own checkpoint weight
            # (GGUF blocks run along rows, so gate and up round alike together or apart).
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stored = "gate_proj" if name.endswith("gate_up_proj") else "down_proj"
                for e in range(param.shape[0]):
                    kind = types[f"{name.rsplit('.', 1)[0]}.{e}.{stored}.weight"]
                    param[e] = dequantized(param[e], kind)
            elif name in types:
                param.copy_(dequantized(param.data, types[name]))
    model = fill(plan_load(source, CPU, torch.float32, CONTEXT, weights="q8")).model
    assert isinstance(model, Qwen35Model)
    assert isinstance(model.model.layers[0].mlp.experts[3].gate_proj, PackedLinear)
    assert not model.supports_graphs
    model.allocate_cache(CONTEXT)
    ids = prompt(40, seed=9)
    with torch.inference_mode():
        ref = rounded(ids[None]).logits[0]
        ours = torch.cat(
            [
                model.forward(ids[:33], 0, "all"),
                *(model.forward(ids[i : i + 1], i, "all") for i in range(33, 40)),
            ]
        )
    assert worst_row_error(ours, ref) < 1e-4


def dequantized(weight: torch.Tensor, kind: int) -> torch.Tensor:
    return gguf.dequantize(quantize(weight.contiguous(), kind), kind, tuple(weight.shape))


def test_a_layer_split_equals_one_device(saved) -> None:
    """Each shard stacks its own layers' experts on its device; logits and state equal one device's."""
    _, source = saved
    whole = load(source)
    split_model = load_model(source, CPU, torch.float32, split=ShardPlan(("cpu", "cpu"), (2, 4))).model
    assert isinstance(split_model, Qwen35Model) and len(split_model.decode_devices()) == 2
    split_model.allocate_cache(CONTEXT)
    ids = prompt(40, seed=4)
    with torch.inference_mode():
        expected = torch.cat([whole.forward(ids[:33], 0, "all"), whole.forward(ids[33:], 33, "all")])
        got = torch.cat([split_model.forward(ids[:33], 0, "all"), split_model.forward(ids[33:], 33, "all")])
        assert relative_error(got, expected) < 1e-6
        token = torch.tensor([9])
        stepped = split_model.decode_graphable(token, torch.tensor([40]), span=64)
        split_model.set_length(41)
        assert relative_error(stepped, whole.forward(token, 40, "last")) < 1e-6


def test_the_vision_language_moe_layout_loads_its_text_model(tmp_path: Path) -> None:
    """Qwen3_5MoeForConditionalGeneration (the published checkpoints' architecture): text settings in
    text_config, weights under model.language_model.*, a vision tower beside them (not loaded)."""
    import transformers

    text = make_hf_moe_model(seed=5).config.to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, architectures=["Qwen3_5MoeForConditionalGeneration"]
    )
    torch.manual_seed(5)
    hf = randomized(transformers.Qwen3_5MoeForConditionalGeneration(config).eval())
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    source = source_from_folder(tmp_path)
    assert source.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in source.tensors
    assert any(name.startswith("model.visual.") for name in source.tensors)
    model = load(source)
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name, _ in model.named_parameters())
    ids = prompt(40, seed=6)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0]
    assert worst_row_error(prefill_in_chunks(model, ids, 16), ref) < 1e-4


def test_stacked_experts_load_by_their_names_and_match_transformers(tmp_path: Path) -> None:
    """A checkpoint with the experts stored stacked (the published layout): the model's parameters
    are those names, no per-expert ones; prefill (grouped), eager decode and the graphable step (by
    index) equal transformers."""
    hf, source = save_tiny_moe_stacked(tmp_path, seed=12)
    assert "model.layers.0.mlp.experts.gate_up_proj" in source.tensors
    assert not any(".experts.0." in name for name in source.tensors)
    model = load(source)
    names = dict(model.named_parameters())
    assert set(names) == set(source.tensors)
    assert names["model.layers.2.mlp.experts.down_proj"].shape == (EXPERTS, TINY_MOE["hidden_size"], 32)
    assert model.supports_graphs
    ids = prompt(70, seed=13)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    assert worst_row_error(prefill_in_chunks(model, ids, 64), ref) < 1e-4
    assert worst_row_error(prefill_in_chunks(model, ids, 1), ref) < 1e-4
    stepped = load(source)
    with torch.inference_mode():
        stepped.forward(ids[:60], 0, "none")
        for at in range(60, 70):
            got = stepped.decode_graphable(ids[at : at + 1], torch.tensor([at]), span=96)
            stepped.set_length(at + 1)
            assert relative_error(got, ref[at]) < 1e-4


_KERNEL_CHECK = """
import tempfile
from pathlib import Path
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.loader import load_model
from tests.engine.models.qwen3_5.tiny import save_tiny_moe

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
calls = []
real = kd.experts_gemv
kd.experts_gemv = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
torch.set_num_threads(1)
# An expert width the GEMV tiles divide (64 columns of the down projection).
_, source = save_tiny_moe(Path(tempfile.mkdtemp()), seed=7, moe_intermediate_size=64)
models = [load_model(source, device, torch.float32).model for _ in range(2)]
prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1)).to(device)
with torch.inference_mode():
    for model in models:
        model.allocate_cache(64)
        model.forward(prompt, 0, "none")
    for step in range(3):
        token = prompt[step : step + 1]
        at = torch.tensor([12 + step], device=device)
        with kd.SWITCH.force(False):
            expected = models[0].decode_graphable(token, at, 32)
        assert len(calls) == 2 * 6 * step, len(calls)  # none on the gathering step
        with kd.SWITCH.force(True):
            got = models[1].decode_graphable(token, at, 32)
        assert len(calls) == 2 * 6 * (step + 1), len(calls)  # two a layer
        for model in models:
            model.set_length(13 + step)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
print("moe kernels ok")
"""


def test_the_graphable_step_on_the_gemv_kernels_equals_the_gathered_step() -> None:
    """On the GEMV kernels (Triton's interpreter without a GPU) the picked experts are read by id,
    never gathered: the same logits as the gathering step."""
    assert "moe kernels ok" in run_triton_check(_KERNEL_CHECK)


def test_a_published_style_moe_config_reads_its_text_part() -> None:
    """The vision-language config.json layout (written here by hand, sizes invented): MoE settings in
    text_config, with keys that older Qwen MoE configs carry set to what Qwen3.5 does anyway (an empty
    mlp_only_layers, sparse step 1, renormalised top-k) and the router's training-only keys."""
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "vision_config": {"depth": 2, "hidden_size": 32},
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 1000,
            "hidden_size": 128,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "full_attention_interval": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "mtp_num_hidden_layers": 1,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000_000,
                "partial_rotary_factor": 0.25,
            },
        },
    }
    cfg = Qwen35Config.from_hf(config)
    assert cfg.weight_prefix == "model.language_model" and cfg.is_moe and cfg.intermediate_size == 0
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (256, 8, 64)
    assert cfg.full_layers == [3, 7] and not cfg.stacked_experts
    assert Qwen35Config.from_hf({**config, STACKED_EXPERTS_KEY: True}).stacked_experts
