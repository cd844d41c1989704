"""Short human texts for engine numbers: byte counts, an answer's speed and the memory readout.

Every place that shows a speed (the answer's footer, the status bar, the Live speed charts) reads it
through `AnswerSpeed.of` and writes it with the `format_*` functions here, so one answer never shows
two different figures. `AnswerSpeed.of` takes the live GenerateStats or the stats dict stored with
each message (GenerateStats.to_json plus the finish reason): both give the same numbers, so an answer
read back after a restart shows the same as it did live.

The memory readout is one figure, MemoryStats.allocated: what the engine holds for the model (0 with
no model), the quantity a park frees. Everything else (free, the allocator's reserved pool, the
process's resident set) is labelled as what it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ds4desk.engine.api import GenerateStats, MemoryStats


def format_bytes(count: int) -> str:
    """Decimal units, matching the MB/GB labels (not MiB/GiB)."""
    if count >= 1e9:
        return f"{count / 1e9:.2f} GB"
    if count >= 1e6:
        return f"{count / 1e6:.0f} MB"
    return f"{count / 1e3:.0f} kB" if count >= 1e3 else f"{count} B"


def format_decode(tok_s: float) -> str:
    return f"{tok_s:,.1f} tok/s"


def format_prefill(tok_s: float) -> str:
    return f"{tok_s:,.0f} tok/s"


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s"


def format_percent(percent: float) -> str:
    return f"{percent:.0f}%"


def _number(stats: Mapping[str, Any], key: str) -> float:
    """Missing or malformed values read as 0: rows written by older versions lack some keys."""
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


@dataclass(slots=True, frozen=True)
class AnswerSpeed:
    """One answer's measured numbers, as the engine timed them (0: not measured)."""

    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    first_token_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    # Speculative decoding: the drafter that ran ("off" when none did), tokens drafted and accepted.
    speculative: str = "off"
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_percent(self) -> float:
        """Accepted of drafted, in percent (0 when nothing was drafted)."""
        return 100.0 * self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def speculated(self) -> bool:
        return self.speculative != "off" and self.drafted_tokens > 0

    @classmethod
    def of(cls, stats: GenerateStats | Mapping[str, Any] | None) -> AnswerSpeed:
        if stats is None:
            return cls()
        values = stats.to_json() if isinstance(stats, GenerateStats) else stats
        return cls(
            decode_tok_s=_number(values, "decode_tok_s"),
            prefill_tok_s=_number(values, "prefill_tok_s"),
            first_token_s=_number(values, "time_to_first_token_s"),
            generated_tokens=int(_number(values, "generated_tokens")),
            prompt_tokens=int(_number(values, "prompt_tokens")),
            reused_tokens=int(_number(values, "reused_tokens")),
            speculative=_word(values, "speculative"),
            drafted_tokens=int(_number(values, "drafted_tokens")),
            accepted_tokens=int(_number(values, "accepted_tokens")),
        )


def _word(stats: Mapping[str, Any], key: str) -> str:
    value = stats.get(key)
    return value if isinstance(value, str) and value.isalpha() and len(value) <= 16 else "off"


def speculation_text(speed: AnswerSpeed) -> str | None:
    """E.g. "draft: 34 of 40 drafted tokens accepted (85%)"; None when no speculation ran."""
    if not speed.speculated:
        return None
    return (
        f"{speed.speculative}: {speed.accepted_tokens:,} of {speed.drafted_tokens:,} drafted tokens "
        f"accepted ({format_percent(speed.acceptance_percent)})"
    )


def stats_footer(stats: GenerateStats | Mapping[str, Any] | None) -> str | None:
    """E.g. "first token 0.21 s · prefill 812 tok/s · decode 31.4 tok/s · reused 1,812 of 1,840
    prompt tokens · lookup: 34 of 40 drafted tokens accepted (85%)"; parts that were not measured are
    left out, None when nothing was."""
    speed = AnswerSpeed.of(stats)
    parts: list[str] = []
    if speed.first_token_s > 0:
        parts.append(f"first token {format_seconds(speed.first_token_s)}")
    if speed.prefill_tok_s > 0:
        parts.append(f"prefill {format_prefill(speed.prefill_tok_s)}")
    if speed.decode_tok_s > 0:
        parts.append(f"decode {format_decode(speed.decode_tok_s)}")
    if speed.reused_tokens > 0:
        parts.append(f"reused {speed.reused_tokens:,} of {speed.prompt_tokens:,} prompt tokens")
    if (speculated := speculation_text(speed)) is not None:
        parts.append(speculated)
    return "  ·  ".join(parts) or None


def status_speed(stats: GenerateStats | Mapping[str, Any] | None) -> tuple[str, str]:
    """The status bar's speed: ("51 tokens · 31.4 tok/s", tooltip); ("", "") when nothing was made."""
    speed = AnswerSpeed.of(stats)
    if not speed.generated_tokens:
        return "", ""
    text = f"{speed.generated_tokens:,} tokens  ·  {format_decode(speed.decode_tok_s)}"
    tip = (
        f"prompt {speed.prompt_tokens:,} tokens ({speed.reused_tokens:,} reused), "
        f"prefill {format_prefill(speed.prefill_tok_s)}\n"
        f"first token after {format_seconds(speed.first_token_s)}, "
        f"decode {format_decode(speed.decode_tok_s)}"
    )
    if (speculated := speculation_text(speed)) is not None:
        tip += f"\nspeculative {speculated}"
    return text, tip


# ---- memory ---------------------------------------------------------------------------------------


def memory_text(stats: MemoryStats) -> str:
    """The park row's readout, "model 1.20 GB": one short figure, so a narrow row never cuts it;
    free and the rest are in its tooltip (memory_details) and the Live speed dock."""
    return f"model {format_bytes(stats.allocated)}"


def memory_others(stats: MemoryStats) -> list[str]:
    """The device and the figures that are not the model's, each named for what it is."""
    lines = [f"{stats.name} ({stats.device})"]
    if stats.device.startswith("cuda"):
        lines.append(f"allocator reserved {format_bytes(stats.reserved)} (model included)")
    elif stats.reserved:
        lines.append(f"process RSS {format_bytes(stats.reserved)} (the whole app)")
    if stats.total:
        lines.append(f"free {format_bytes(stats.free)} of {format_bytes(stats.total)}")
    return lines


def memory_details(stats: MemoryStats) -> str:
    """The readout's tooltip: what its figure means, then the other figures."""
    meaning = f"model {format_bytes(stats.allocated)}: what the engine holds for the model, what Park frees"
    device, *others = memory_others(stats)
    return "\n".join([device, meaning, *others])
