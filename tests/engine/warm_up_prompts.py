"""The whole prompts a runtime's load warm-up prefills (the two-chunk prompt left out), for the row
bucket tests of each family."""

from __future__ import annotations

import torch

from ds4desk.engine.runtime import Runtime
from ds4desk.engine.warm_up import WarmUpReport, warm_up


def warm_up_prompts(runtime: Runtime) -> tuple[list[int], WarmUpReport]:
    """Run the warm-up on `runtime`; the lengths of the prompts it prefilled whole, and its report."""
    prompts: list[int] = []
    real = runtime.prefill_logits

    def recording(ids: list[int], split_at: int | None = None) -> torch.Tensor:
        if split_at is None:
            prompts.append(len(ids))
        return real(ids, split_at)

    runtime.prefill_logits = recording  # type: ignore[method-assign]
    try:
        report = warm_up(runtime, "off", lambda: False, lambda _done, _total: None)
    finally:
        del runtime.prefill_logits  # back to the class's method
    return prompts, report
