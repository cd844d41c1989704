"""The engine thread's load steps, as plain functions: fill a planned model and start its runtime,
plan and start a draft, and what a loaded model is called, weighs and accepts as a snapshot."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds4desk.engine.api import EngineFailure, ErrorCode, LoadRequest, ModelInfo, ThinkingFormat

if TYPE_CHECKING:
    from ds4desk.engine.loader import LoadedModel, LoadPlan
    from ds4desk.engine.runtime import Runtime
    from ds4desk.engine.speculative.draft_model import DraftModel
    from ds4desk.engine.tokenizer import ChatTokenizer


def fill_and_start(
    plan: LoadPlan,
    request: LoadRequest,
    tick: Callable[[int, int], None],
    stop_if_cancelled: Callable[[], None],
    defer_graphs: bool = False,
) -> tuple[LoadedModel, Runtime]:
    """The planned model filled from its files, and the runtime around it; its CUDA graphs are
    captured here, or by the warm-up stage when `defer_graphs` (see warm_up.py)."""
    from ds4desk.engine.graphs import graphs_wanted
    from ds4desk.engine.loader import fill
    from ds4desk.engine.runtime import Runtime

    loaded = fill(plan, tick)
    stop_if_cancelled()  # after the last tensor: still before the swap
    device = plan.device
    graphs = graphs_wanted(request.cuda_graphs, device, loaded.model)
    chunk = request.chunk or auto_chunk(device.type)
    runtime = Runtime(
        loaded.model,
        device,
        context=plan.context,
        chunk=chunk,
        graphs=graphs,
        defer_graphs=defer_graphs,
        cpu_prefill=request.cpu_prefill,
    )
    return loaded, runtime


def plan_draft(
    request: LoadRequest, target_plan: LoadPlan | None, runtime: Runtime | None = None
) -> LoadPlan:
    """The draft model's load plan: on the target's first device, in its dtype, for its context;
    refused (LOAD_FAILED) before any memory is taken when it cannot draft for the target."""
    from ds4desk.engine.loader import plan_load
    from ds4desk.engine.loading.detect import read_source
    from ds4desk.engine.speculative.draft_model import check_draft_pair
    from ds4desk.engine.speculative.rollback import rollback_of

    assert request.draft
    if target_plan is not None:
        target, device, dtype, context = (
            target_plan.model,
            target_plan.device,
            target_plan.dtype,
            target_plan.context,
        )
    else:
        assert runtime is not None
        target, device, dtype, context = runtime.model, runtime.device, runtime.model.dtype, runtime.context
    if rollback_of(target) is None:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            "speculative decoding with a draft model is not supported for this model (its cache cannot "
            "roll back a rejected draft yet): load it without a draft",
        )
    path = Path(request.draft).expanduser()
    plan = plan_load(read_source(path), device, dtype, context, weights=request.weights)
    check_draft_pair(target, plan.model, path.name)
    return plan


def start_draft(plan: LoadPlan, runtime: Runtime, tick: Callable[[int, int], None] | None) -> DraftModel:
    """The planned draft filled from its files, with a cache as long as the target's (or its own
    maximum, when that is shorter: it then drafts nothing past it)."""
    from ds4desk.engine.loader import fill
    from ds4desk.engine.speculative.draft_model import DraftModel

    loaded = fill(plan, tick)
    context = min(plan.context, runtime.context)
    graphs = runtime.graphs is not None or runtime.graphs_pending  # the draft decodes as its target
    return DraftModel(
        loaded.model, context, runtime.chunk, str(plan.source.origin), loaded.weight_bytes, graphs
    )


def model_bytes(runtime: Runtime, info: ModelInfo) -> int:
    """What the loaded model takes: its weights and cache, and its draft's."""
    draft = runtime.draft.bytes() if runtime.draft is not None else 0
    return info.weight_bytes + runtime.model.cache_bytes() + draft


def release_frames(error: BaseException | None) -> None:
    """Clear the locals of every frame an exception (and its causes) keeps alive."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def auto_chunk(device_type: str) -> int:
    """Measured (docs/BENCHMARKS.md, bench/gpu_speed.py and bench/profile_v4_prefill.py sweeps): on
    an H200 both families prefill a 4k prompt fastest in one chunk of 4096 (DeepSeek-V4 synthetic:
    36k tok/s at 512, 60k at 1024, 69k at 2048, 71k at 4096); the CPU is tuned at 512."""
    return 4096 if device_type == "cuda" else 512


def probe_thinking(tokenizer: ChatTokenizer) -> ThinkingFormat:
    """Whether the window may offer Think for this model, and whether the answer starts inside <think>."""
    from ds4desk.engine.chat_template import probe_thinking

    return probe_thinking(lambda messages, variables: tokenizer.render_chat(messages, variables=variables))


def state_check(model: Any, context: int) -> tuple[Any, int | None]:
    """What a snapshot file must hold for this model: its state layout and its vocabulary size. A
    model whose layout cannot be learned gets every file refused, never trusted."""
    from ds4desk.engine.snapshots import state_layout

    vocab = getattr(model, "vocab_size", None)
    try:
        return state_layout(model, context), vocab if isinstance(vocab, int) else None
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"

        def refuse(_length: int) -> dict[str, Any]:
            raise EngineFailure(
                ErrorCode.INVALID_SNAPSHOT_SLOT, f"snapshot files of this model cannot be checked ({reason})"
            )

        return refuse, vocab if isinstance(vocab, int) else None


def fingerprint(source: Any) -> str:
    """Which weights a snapshot belongs to: the architecture, config and every tensor's header."""
    import hashlib
    import json

    tensors = sorted((name, e.dtype, e.shape, e.end - e.begin) for name, e in source.tensors.items())
    payload = json.dumps([source.architecture, source.config, tensors], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_name(origin: Path) -> str:
    return origin.stem if origin.is_file() else origin.name
