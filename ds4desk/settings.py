"""Typed user settings, kept as JSON in the user config dir.

A settings file is something people edit by hand and older versions wrote, so loading never fails:
unknown keys are ignored and a value of the wrong type or range falls back to its default.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ds4desk.engine.api import WEIGHT_MODES, LoadRequest, SamplingParams, ThinkingBudget

log = logging.getLogger(__name__)

MAX_RECENT_MODELS = 8
DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


@dataclass(slots=True)
class Settings:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"; the engine resolves "auto"
    dtype: str = "auto"  # "auto": float32 on the CPU, bfloat16 on a GPU
    context: int = 4096
    chunk: int = 0  # 0: automatic (4096 on a GPU, 512 on the CPU)
    cuda_graphs: str = "auto"  # "auto" (on for CUDA, off for HIP) | "on" | "off"
    # "as-stored" | "q8" | "q4": a 16-bit model's linear weights quantized at load (Q8_0 / Q4_K).
    weights: str = "as-stored"
    # A layer split: the devices the shards run on, in order (empty: every layer on `device`), and
    # the layers per device (empty: planned from each device's free memory).
    devices: list[str] = field(default_factory=list)
    layer_split: list[int] = field(default_factory=list)
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0  # 0: no top-k cut
    max_new_tokens: int = 1024
    last_model: str | None = None  # None: the embedded default model
    recent_models: list[str] = field(default_factory=list)  # most recent first, MAX_RECENT_MODELS
    system_prompt: str = ""
    snapshot_slots: int = 16
    snapshot_memory_mb: int = 4096  # host memory for snapshots
    unpark_on_generate: bool = True  # else a request to a parked model fails with model_parked
    park_cancels_running: bool = False  # else a park waits for the answer being written
    idle_park_minutes: float = 0.0  # 0: never park by itself
    thinking: bool = False  # ask for the model's reasoning first (templates that have a thinking mode)
    thinking_budget_tokens: int = 0  # 0: no budget; else the thinking is closed after this many tokens

    # ---- engine requests ------------------------------------------------------------------

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def thinking_budget(self) -> ThinkingBudget | None:
        """The budget to send when thinking is on. `close_tokens` stays empty: only the engine knows
        the loaded tokenizer's spelling of `</think>`, so it fills them in."""
        if not self.thinking or self.thinking_budget_tokens <= 0:
            return None
        return ThinkingBudget(max_tokens=self.thinking_budget_tokens, close_tokens=[])

    def load_request(self, path: str | None = None, device: str | None = None) -> LoadRequest:
        """`path`/`device` override the stored ones for this load only (the CLI's flags)."""
        return LoadRequest(
            path=path if path is not None else self.last_model,
            device=device or self.device,
            dtype=None if self.dtype == "auto" else self.dtype,
            context=self.context,
            chunk=self.chunk,
            cuda_graphs=None if self.cuda_graphs == "auto" else self.cuda_graphs == "on",
            # A device given for this load alone means that device, not the stored split.
            devices=tuple(self.devices) if self.devices and not device else None,
            layer_split=tuple(self.layer_split) if self.devices and self.layer_split and not device else None,
            weights=self.weights,
        )

    def engine_options(self) -> dict[str, Any]:
        """The Engine's keyword arguments that these settings decide."""
        return {
            "unpark_on_generate": self.unpark_on_generate,
            "park_cancels_running": self.park_cancels_running,
            "idle_park_after_s": self.idle_park_minutes * 60 if self.idle_park_minutes > 0 else None,
            "snapshot_slots": self.snapshot_slots,
            "snapshot_budget_bytes": self.snapshot_memory_mb * 2**20,
        }

    # ---- JSON -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Settings:
        settings = cls()
        if not isinstance(data, dict):
            log.warning("settings: expected a JSON object, using defaults")
            return settings
        for f in fields(cls):
            if f.name not in data:
                continue
            value = _validated(f.name, data[f.name])
            if value is _INVALID:
                log.warning("settings: ignoring bad value for %s: %r", f.name, data[f.name])
                continue
            setattr(settings, f.name, value)
        return settings

    @classmethod
    def load(cls, path: Path) -> Settings:
        """Defaults when the file is missing, unreadable or garbage; never raises."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("settings: cannot read %s (%s), using defaults", path, exc)
            return cls()
        try:
            data = json.loads(text)
        except ValueError as exc:
            log.warning("settings: %s is not valid JSON (%s), using defaults", path, exc)
            return cls()
        return cls.from_json(data)

    def save(self, path: Path) -> None:
        """Atomic: a crash mid-write leaves the previous file, never half of the new one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=".settings-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(payload)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


_INVALID = object()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number


def _validated(name: str, value: Any) -> Any:
    """The value if it is acceptable for `name`, else _INVALID."""
    match name:
        case "device":
            ok = isinstance(value, str) and bool(_DEVICE.match(value))
        case "dtype":
            ok = value in DTYPES
        case "cuda_graphs":
            ok = value in ("auto", "on", "off")
        case "weights":
            ok = value in WEIGHT_MODES
        case "devices":
            ok = isinstance(value, list) and all(
                isinstance(v, str) and v != "auto" and bool(_DEVICE.match(v)) for v in value
            )
        case "layer_split":
            ok = isinstance(value, list) and all(_is_int(v) and v > 0 for v in value)
        case "unpark_on_generate" | "park_cancels_running" | "thinking":
            ok = isinstance(value, bool)
        case "idle_park_minutes":
            ok = (_is_int(value) or isinstance(value, float)) and value >= 0
            value = float(value) if ok else value
        case "chunk":
            ok = _is_int(value) and value >= 0
        case "context" | "max_new_tokens" | "snapshot_slots" | "snapshot_memory_mb":
            ok = _is_int(value) and value > 0
        case "top_k" | "thinking_budget_tokens":
            ok = _is_int(value) and value >= 0
        case "temperature":
            ok = (_is_int(value) or isinstance(value, float)) and 0.0 <= value <= 5.0
            value = float(value) if ok else value
        case "top_p":
            ok = (_is_int(value) or isinstance(value, float)) and 0.0 < value <= 1.0
            value = float(value) if ok else value
        case "last_model":
            ok = value is None or (isinstance(value, str) and value != "")
        case "recent_models":
            ok = isinstance(value, list) and all(isinstance(v, str) and v != "" for v in value)
            value = list(dict.fromkeys(value))[:MAX_RECENT_MODELS] if ok else value
        case "system_prompt":
            ok = isinstance(value, str)
        case _:
            ok = False
    return value if ok else _INVALID
