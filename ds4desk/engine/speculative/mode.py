"""Which drafter a request gets: the setting (SPECULATIVE_MODES) against what the model allows."""

from __future__ import annotations

from ds4desk.engine.api import SPECULATIVE_MODES, EngineFailure, ErrorCode


def check_mode(mode: str) -> None:
    """BAD_REQUEST for a word that is no mode at all."""
    if mode not in SPECULATIVE_MODES:
        raise EngineFailure(
            ErrorCode.BAD_REQUEST,
            f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}",
        )


def resolve_mode(
    mode: str, can_roll_back: bool, has_draft: bool, graphed: bool = False, has_mtp: bool = False
) -> str:
    """The drafter ("off", "lookup", "draft" or "mtp") for a request asking `mode` of a model whose
    cache can (or cannot) roll back, that has (or has not) a draft model loaded, and that has (or has
    not) an MTP block of its own that can draft (`has_mtp`, speculative/mtp.mtp_available). "auto"
    picks what pays: the draft when there is one, else the model's MTP block (its drafts come from
    the target's own hidden state: far more of them are kept than prompt lookup's on ordinary
    text), else prompt lookup, except where decode steps replay from CUDA graphs (`graphed`): there the
    speculative loop reads every token back to the host, where the graphs' own greedy steps chain on
    the device, and on text with nothing to look up that loses about a third of the speed (1,189
    against 771 tok/s on the dense 1.07B model on an H200, no draft accepted) for what lookup saves
    on quotes. Off where the cache cannot roll back. An explicit mode the model cannot run is a
    BAD_REQUEST that says why."""
    check_mode(mode)
    if mode == "off":
        return "off"
    if mode == "auto":
        if not can_roll_back:
            return "off"
        if has_draft:
            return "draft"
        return "off" if graphed else "mtp" if has_mtp else "lookup"
    if mode == "mtp" and not has_mtp:
        raise EngineFailure(
            ErrorCode.BAD_REQUEST,
            "speculative mtp is not supported for this model: it has no MTP block of its own (a "
            "DeepSeek-V4 checkpoint that keeps its mtp.0.* tensors has one)",
        )
    if not can_roll_back:
        raise EngineFailure(
            ErrorCode.BAD_REQUEST,
            f"speculative {mode} is not supported for this model: its cache cannot roll back a "
            "rejected draft yet",
        )
    if mode == "draft" and not has_draft:
        raise EngineFailure(
            ErrorCode.BAD_REQUEST, "speculative draft needs a draft model (load one with --draft PATH)"
        )
    return mode
