"""What the server did, for GET /metrics (Prometheus' text format, version 0.0.4) and GET /health.

Every number lives on the event loop's thread: the routes and the generations' callbacks update it
there, so nothing needs a lock.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds4desk.engine.api import GenerateStats, MemoryStats, ModelInfo

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds from a request's arrival to its first token, queue wait included (what a client waits).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# The endpoints requests are counted by; anything else is "other", so random paths sent by a
# scanner cannot grow the metrics without end.
ENDPOINTS = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/slots",
    "/park",
    "/unpark",
)


def endpoint_of(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/slots/"):
        return "/slots/{id}"
    return "other"


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass(slots=True, frozen=True)
class ServedAnswer:
    """One generation the server ended (answered, cancelled or failed), for whoever listens: the
    window's live chart marks these beside its own answers."""

    model: str  # the model the request was accepted for
    stats: GenerateStats  # the engine's own figures (tokens, TTFT, decode tok/s, speculation)
    outcome: str  # "answered", "cancelled" or "failed"
    waited_s: float | None = None  # arrival to first token, queue wait included (None: no token)


# Called on the server's event loop thread: it must return quickly and never block on the caller's.
ServedListener = Callable[[ServedAnswer], None]


@dataclass(slots=True)
class Metrics:
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)  # (endpoint, status)
    answers: int = 0
    cancelled: int = 0  # their client left (or a stop string ended them) before the end
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0  # every token the model produced, cancelled answers' included
    in_flight: int = 0  # generations accepted whose engine work has not ended
    last_decode_tok_s: float = 0.0
    last_ttft_s: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    listeners: list[ServedListener] = field(default_factory=list)

    def served(self, answer: ServedAnswer) -> None:
        """Tell the listeners; one that fails is logged, never the request's problem."""
        for listener in list(self.listeners):
            try:
                listener(answer)
            except Exception:
                log.exception("a served-request listener failed")

    def counted(self, path: str, status: int) -> None:
        self.requests[(endpoint_of(path), status)] += 1

    def render(self, info: ModelInfo | None, parked: bool, memory: MemoryStats | None) -> str:
        out = _Writer()
        out.family(
            "ds4desk_http_requests_total", "counter", "HTTP requests answered, by endpoint and status."
        )
        for (endpoint, status), count in sorted(self.requests.items()):
            out.sample("ds4desk_http_requests_total", count, endpoint=endpoint, status=str(status))
        out.family("ds4desk_generations_total", "counter", "Generations the engine ended, by outcome.")
        for outcome, count in (
            ("answered", self.answers),
            ("cancelled", self.cancelled),
            ("failed", self.failed),
        ):
            out.sample("ds4desk_generations_total", count, outcome=outcome)
        out.gauge("ds4desk_requests_in_flight", self.in_flight, "Generations accepted and not yet ended.")
        out.gauge(
            "ds4desk_queue_length",
            max(self.in_flight - 1, 0),
            "Generations waiting for the engine thread (it runs one at a time).",
        )
        out.family(
            "ds4desk_time_to_first_token_seconds",
            "histogram",
            "From a request's arrival to its first token, queue wait included.",
        )
        cumulative = 0
        for bound, count in zip((*self.ttft.buckets, math.inf), self.ttft.counts, strict=True):
            cumulative += count
            le = "+Inf" if math.isinf(bound) else repr(bound)
            out.sample("ds4desk_time_to_first_token_seconds_bucket", cumulative, le=le)
        out.sample("ds4desk_time_to_first_token_seconds_sum", self.ttft.total)
        out.sample("ds4desk_time_to_first_token_seconds_count", self.ttft.count)
        out.gauge("ds4desk_last_time_to_first_token_seconds", self.last_ttft_s, "The last request's TTFT.")
        out.counter("ds4desk_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of ended generations.")
        out.counter("ds4desk_generated_tokens_total", self.generated_tokens, "Tokens the model generated.")
        out.gauge(
            "ds4desk_last_decode_tokens_per_second",
            self.last_decode_tok_s,
            "Decode speed of the last generation that decoded (tokens after the first / decode time).",
        )
        out.gauge("ds4desk_model_loaded", 1 if info else 0, "1 when a model is loaded or parked.")
        out.gauge("ds4desk_model_parked", 1 if parked else 0, "1 when the model is parked (weights freed).")
        out.gauge(
            "ds4desk_model_weight_bytes",
            0 if info is None or parked else info.weight_bytes,
            "Bytes the model's weights take on its device (0 while parked).",
        )
        if memory is not None:
            where = {"device": memory.device}
            out.gauge("ds4desk_memory_allocated_bytes", memory.allocated, "Device memory in use.", **where)
            out.gauge("ds4desk_memory_reserved_bytes", memory.reserved, "Device memory reserved.", **where)
            out.gauge("ds4desk_memory_free_bytes", memory.free, "Device memory free.", **where)
            out.gauge("ds4desk_memory_total_bytes", memory.total, "Device memory in all.", **where)
        return out.text()

    def health(self) -> dict[str, int]:
        return {
            "answers": self.answers,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "generated_tokens": self.generated_tokens,
        }


class _Writer:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        shown = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
        self._lines.append(f"{name}{{{shown}}} {_number(value)}" if shown else f"{name} {_number(value)}")

    def gauge(self, name: str, value: float, help_text: str, **labels: str) -> None:
        self.family(name, "gauge", help_text)
        self.sample(name, value, **labels)

    def counter(self, name: str, value: float, help_text: str) -> None:
        self.family(name, "counter", help_text)
        self.sample(name, value)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
