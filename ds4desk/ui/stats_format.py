"""Short human texts for engine numbers: byte counts and an answer's speed footer.

The footer is built from the stats dict stored with each message (GenerateStats.to_json plus the
finish reason), not from a live GenerateStats, so an answer read back after a restart shows the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def format_bytes(count: int) -> str:
    """Decimal units, matching the MB/GB labels (not MiB/GiB)."""
    if count >= 1e9:
        return f"{count / 1e9:.2f} GB"
    if count >= 1e6:
        return f"{count / 1e6:.0f} MB"
    return f"{count / 1e3:.0f} kB" if count >= 1e3 else f"{count} B"


def _number(stats: Mapping[str, Any], key: str) -> float:
    """Missing or malformed values read as 0: rows written by older versions lack some keys."""
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def stats_footer(stats: Mapping[str, Any] | None) -> str | None:
    """E.g. "first token 0.21 s · prefill 812 tok/s · decode 31.4 tok/s · reused 1,812 of 1,840
    prompt tokens"; parts that were not measured are left out, None when nothing was."""
    if not stats:
        return None
    parts: list[str] = []
    ttft = _number(stats, "time_to_first_token_s")
    if ttft > 0:
        parts.append(f"first token {ttft:.2f} s")
    prefill = _number(stats, "prefill_tok_s")
    if prefill > 0:
        parts.append(f"prefill {prefill:,.0f} tok/s")
    decode = _number(stats, "decode_tok_s")
    if decode > 0:
        parts.append(f"decode {decode:,.1f} tok/s")
    reused = int(_number(stats, "reused_tokens"))
    prompt = int(_number(stats, "prompt_tokens"))
    if reused > 0:
        parts.append(f"reused {reused:,} of {prompt:,} prompt tokens")
    return "  ·  ".join(parts) or None
