"""Speculative decoding on DeepSeek-V4 (tiny random checkpoints, CPU float32): greedy output is
token-identical to plain decoding for prompt lookup, a draft model (the target itself, which always
agrees, and another V4 that mostly does not) and the model's own MTP block; speculation really runs
(tokens are drafted, rejected ones rolled back); "auto" picks the MTP block where the model has one.

The MTP cases drive the decode loop (speculative/decode.py) the way Runtime.generate does for the
other drafters: the block follows the target from the prefill on (track_mtp), then
SpeculativeDecode runs with an MtpDrafter and the model's forward as its plain step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode, GenerateStats, SamplingParams
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.cache import LayerState, new_layer_state
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.runtime import Runtime
from ds4desk.engine.speculative.adaptive import AdaptiveK
from ds4desk.engine.speculative.decode import SpeculativeDecode
from ds4desk.engine.speculative.draft_model import DraftModel
from ds4desk.engine.speculative.drafter import Drafter
from ds4desk.engine.speculative.mode import resolve_mode
from ds4desk.engine.speculative.mtp import MtpDrafter, mtp_available, track_mtp
from ds4desk.engine.speculative.rollback import rollback_of
from tests.engine.speculative.tiny_pairs import CONTEXT, GREEDY, PLAIN, REPEATING, run, runtime
from tests.engine.speculative.tiny_v4_mtp import load_v4, save_tiny_v4_with_mtp

PROMPTS = {"repeating": REPEATING, "plain": PLAIN}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DeepseekV4Model]:
    root: Path = tmp_path_factory.mktemp("v4-spec")
    target = save_tiny_v4_with_mtp(root / "target", seed=6)
    return {
        "target": load_v4(target),
        "self": load_v4(target),  # the same weights: a draft that always agrees
        "other": load_v4(save_tiny_v4_with_mtp(root / "other", seed=16, template_layer=None)),
        # The MTP block shaped as an HCA layer and as a sliding one (DeepSeek-V4-Flash's is sliding).
        "hca": load_v4(save_tiny_v4_with_mtp(root / "hca", seed=6, template_layer=2)),
        "sliding": load_v4(save_tiny_v4_with_mtp(root / "sliding", seed=6, template_layer=0)),
    }


def speculate(
    model: DeepseekV4Model,
    prompt: list[int],
    drafter: Drafter,
    count: int,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    k: int = 3,
) -> tuple[list[int], GenerateStats]:
    """The runtime's speculative path, from a fresh prefill: the first `count` tokens and stats."""
    hooks = rollback_of(model)
    assert hooks is not None
    model.allocate_cache(CONTEXT)
    track_mtp(model, isinstance(drafter, MtpDrafter))
    tokens: list[int] = []
    stats = GenerateStats()

    def emit(token: int, _logprob: float) -> bool:
        tokens.append(token)
        stats.generated_tokens += 1
        return len(tokens) >= count

    def plain_step(token: torch.Tensor, at: int) -> torch.Tensor:
        logits = model.forward(token.view(1), at, "last")
        assert logits is not None
        return logits

    with torch.inference_mode():
        logits = model.forward(torch.tensor(prompt), 0, "last")
        assert logits is not None
        loop = SpeculativeDecode(
            model, hooks, drafter, sampling, generator, None, stats, emit, plain_step, count,
            AdaptiveK(k=k, k_max=7),
        )  # fmt: skip
        loop.run(list(prompt), logits, len(prompt))
    return tokens, stats


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_lookup_is_token_identical(models: dict[str, DeepseekV4Model], prompt: str) -> None:
    rt = runtime(models["target"])
    off = run(rt, PROMPTS[prompt], "off", 40)
    on = run(rt, PROMPTS[prompt], "lookup", 40)
    assert on.tokens == off.tokens
    assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
    assert on.stats.speculative == "lookup" and 0 <= on.stats.accepted_tokens <= on.stats.drafted_tokens
    if prompt == "repeating":
        assert on.stats.drafted_tokens > 0


@pytest.mark.parametrize(("draft", "chunk"), [("self", 64), ("other", 3)])
def test_a_draft_model_is_token_identical(models: dict[str, DeepseekV4Model], draft: str, chunk: int) -> None:
    rt = runtime(models["target"], models[draft], chunk=chunk)
    for prompt in (PLAIN, REPEATING):
        off = run(rt, prompt, "off", 24)
        on = run(rt, prompt, "draft", 24)
        assert on.tokens == off.tokens
        assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
        stats = on.stats
        assert stats.speculative == "draft" and stats.drafted_tokens > 0
        if draft == "self":
            assert stats.accepted_tokens == stats.drafted_tokens
        else:
            assert stats.accepted_tokens < stats.drafted_tokens  # rejections, rolled back


# The MTP block shaped as a CSA layer (with its indexer), an HCA one and a sliding one (as
# DeepSeek-V4-Flash's); k drafts chained a step.
@pytest.mark.parametrize(("block", "k"), [("target", 1), ("target", 4), ("hca", 3), ("sliding", 3)])
def test_mtp_is_token_identical(models: dict[str, DeepseekV4Model], block: str, k: int) -> None:
    model = models[block]
    rt = Runtime(model, torch.device("cpu"), context=CONTEXT, chunk=8)
    for prompt in (PLAIN, REPEATING):
        off = rt.generate(prompt, GREEDY, 24, set(), lambda _t: None, lambda: False)
        tokens, stats = speculate(model, prompt, MtpDrafter(model), 24, k=k)
        assert tokens == off.tokens
        assert stats.drafted_tokens > 0 and stats.accepted_tokens <= stats.drafted_tokens


def test_mtp_through_the_runtime_is_token_identical(models: dict[str, DeepseekV4Model]) -> None:
    """`speculative="mtp"` (and `auto`, which picks it for a model with a block) through
    Runtime.generate: the MTP drafter runs, with the tokens of speculation off."""
    rt = Runtime(models["target"], torch.device("cpu"), context=CONTEXT, chunk=8)
    for prompt in (PLAIN, REPEATING):
        off = rt.generate(prompt, GREEDY, 24, set(), lambda _t: None, lambda: False)
        for mode in ("mtp", "auto"):
            on = rt.generate(prompt, GREEDY, 24, set(), lambda _t: None, lambda: False, speculative=mode)
            assert on.tokens == off.tokens
            assert on.stats.speculative == "mtp" and on.stats.drafted_tokens > 0


def test_mtp_drafts_what_the_block_predicts(models: dict[str, DeepseekV4Model]) -> None:
    """The drafter's first draft is the argmax of the block's logits at the target's last position,
    computed here from the definition (DeepSeek's MTPBlock): the hnorm-normed streams through h_proj
    plus the enorm-normed embedding of the chosen token through e_proj, one layer, the block's own
    stream head and norm, the shared head."""
    model = models["target"]
    block = model.mtp[0]
    prompt = PLAIN[:12]
    with torch.inference_mode():
        model.allocate_cache(CONTEXT)
        track_mtp(model, True)
        logits = model.forward(torch.tensor(prompt), 0, "last")
        assert logits is not None
        chosen = int(torch.argmax(logits))
        drafted = MtpDrafter(model).propose([*prompt, chosen], 2, GREEDY, None).tokens
        assert len(drafted) == 2 and model.mtp_ready(len(prompt))

        # The block by its definition over the whole sequence from position 0, reading the main
        # model's final streams at each position (its head over them gives the model's logits).
        model.allocate_cache(CONTEXT)
        track_mtp(model, True)
        streams: list[torch.Tensor] = []
        for at, token in enumerate(prompt):
            step = model.forward(torch.tensor([token]), at, "last")
            pending = model._mtp_pending
            assert step is not None and pending is not None
            torch.testing.assert_close(model.logits_from(model._hc_head(pending), "last", step), step)
            streams.append(pending.clone())
        cfg = model.config
        eps = cfg.rms_norm_eps
        hidden = torch.cat(streams)  # [T, m, D]
        nxt = torch.tensor([*prompt[1:], chosen])
        e = rms(model.model.embed_tokens.weight[nxt], block.enorm.weight, eps)
        h = rms(hidden, block.hnorm.weight, eps)
        x = h @ block.h_proj.weight.t() + (e @ block.e_proj.weight.t()).unsqueeze(1)
        # The layer itself is the main model's layer code (checked against transformers elsewhere),
        # with a cache of its own.
        state = new_layer_state(cfg, cfg.mtp_layer_types[0], CONTEXT, torch.float32, torch.device("cpu"))
        y = block_layer(model, x, nxt, state)
        head = block.hc_head
        z = rms(y.reshape(y.shape[0], -1), None, eps) @ head.hc_fn.t()
        pre = torch.sigmoid(z * head.hc_scale + head.hc_base) + cfg.hc_eps
        collapsed = (pre.unsqueeze(-1) * y).sum(dim=1)
        mtp_logits = rms(collapsed, block.norm.weight, eps) @ model.head_weight().t()
        assert int(torch.argmax(mtp_logits[-1])) == drafted[0]


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def block_layer(
    model: DeepseekV4Model, x: torch.Tensor, ids: torch.Tensor, state: LayerState
) -> torch.Tensor:
    """One V4 layer (the block's weights) over streams x [T, m, D] at positions 0.."""
    block = model.mtp[0]
    own = (state, model.config.mtp_layer_types[0])
    h, post, comb = model._hc_site(x, block.attn_hc, block.input_layernorm.weight)
    streams = ops.expand(x, model._attention(-1, block.self_attn, h, 0, own), post, comb)
    h, post, comb = model._hc_site(streams, block.ffn_hc, block.post_attention_layernorm.weight)
    return ops.expand(streams, model._moe(block.mlp, h, ids), post, comb)


def test_auto_picks_mtp_where_the_model_has_a_block() -> None:
    assert resolve_mode("auto", True, False, has_mtp=True) == "mtp"
    assert resolve_mode("auto", True, True, has_mtp=True) == "draft"  # a loaded draft comes first
    assert resolve_mode("auto", True, False, graphed=True, has_mtp=True) == "off"  # graphs: as before
    assert resolve_mode("auto", True, False) == "lookup"
    assert resolve_mode("mtp", True, False, has_mtp=True) == "mtp"
    with pytest.raises(EngineFailure) as failure:
        resolve_mode("mtp", True, True)
    assert failure.value.error.code == ErrorCode.BAD_REQUEST
    assert "not supported for this model" in failure.value.error.detail
    assert "MTP block" in failure.value.error.detail


def test_which_models_can_draft_with_mtp(models: dict[str, DeepseekV4Model]) -> None:
    assert mtp_available(models["target"]) and not mtp_available(models["other"])
    with pytest.raises(ValueError):
        MtpDrafter(models["other"])
    with pytest.raises(EngineFailure):
        models["other"].set_mtp_tracking(True)


def test_the_block_stops_drafting_when_it_loses_step(models: dict[str, DeepseekV4Model]) -> None:
    """A forward with tracking off (or a captured step) leaves the block behind: it drafts nothing
    (decoding stays exact, plain) until the next request starts at position 0."""
    model = models["target"]
    with torch.inference_mode():
        model.allocate_cache(CONTEXT)
        track_mtp(model, True)
        model.forward(torch.tensor(PLAIN[:10]), 0, "none")
        assert model.mtp_ready(10)
        model.set_length(10)  # what a captured decode step reports after its replay
        assert not model.mtp_ready(10)
        assert MtpDrafter(model).propose(PLAIN[:11], 3, GREEDY, None).tokens == []
        model.forward(torch.tensor(PLAIN[:10]), 0, "none")
        assert model.mtp_ready(10)


def test_the_draft_model_path_restarts_a_v4_draft_it_cannot_rewind(
    models: dict[str, DeepseekV4Model],
) -> None:
    """A V4 draft whose cache already holds the whole sequence (it cannot feed the last token
    again) starts over from position 0 instead of failing."""
    draft = DraftModel(models["self"], CONTEXT, 8, "draft", 0)
    prompt = REPEATING[:20]
    with torch.inference_mode():
        first = draft.propose(prompt, 3, GREEDY, None).tokens
        draft.settle(0)
        draft.fed = list(prompt)  # as after a request that fed exactly this prompt
        assert draft.propose(prompt, 3, GREEDY, None).tokens == first
