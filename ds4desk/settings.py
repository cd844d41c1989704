"""Typed user settings, kept as JSON in the user config dir.

A settings file is something people edit by hand and older versions wrote, so loading never fails:
unknown keys are ignored and a value of the wrong type or range falls back to its default. What
could not be read is never overwritten: `Settings.load_checked` keeps a copy of such a file beside it and
says so, so the user can see what went wrong and take back what was in it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ds4desk.engine.api import CPU_PREFILL_MODES, WEIGHT_MODES, LoadRequest, SamplingParams, ThinkingBudget

log = logging.getLogger(__name__)

MAX_RECENT_MODELS = 8
# The embedded SmolLM2 as a load path (File > Open recent, the no-model bar): no file is named so.
BUILT_IN_MODEL = "<built-in>"
BUILT_IN_LABEL = "Built-in SmolLM2-135M-Instruct"
MAX_SETTINGS_BYTES = 4 * 2**20  # a settings file is a few KB; a long system prompt, a few hundred
# Every number is bounded where it is read, as the settings dialog bounds it: a hand-edited
# snapshot_slots of 10^8 would otherwise cost 12 GB on every answer.
INT_RANGES: dict[str, tuple[int, int]] = {
    "context": (2, 1_048_576),
    "chunk": (0, 65_536),
    "max_new_tokens": (1, 1_048_576),
    "snapshot_slots": (1, 1024),
    "snapshot_memory_mb": (1, 1_048_576),
    "top_k": (0, 1_000_000),
    "thinking_budget_tokens": (0, 1_048_576),
    "serve_port": (0, 65_535),
}
MAX_IDLE_PARK_MINUTES = 10_000.0
MAX_DEVICES = 64
# The window's saved geometry and dock layout (QMainWindow.saveGeometry / saveState, a splitter's
# saveState) as base64 text: a few hundred bytes; anything far larger is no window state.
MAX_WINDOW_STATE_CHARS = 64 * 1024
_BASE64 = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# What Settings > Speculative decoding offers (the engine's SPECULATIVE_MODES but "mtp", which it
# refuses for now): the default of every answer and of every load.
SPECULATIVE_CHOICES = ("auto", "off", "draft", "lookup")
DEFAULT_SERVE_PORT = 8000
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
    # A prompt's products on GGUF weights on the CPU: "float32" (exact) | "bfloat16" (faster where
    # the CPU has AVX-512 BF16).
    cpu_prefill: str = "float32"
    # Speculative decoding (SPECULATIVE_CHOICES): auto is the draft model when one is loaded (File >
    # Load draft model…), else prompt lookup; off for models whose cache cannot roll back.
    speculative: str = "auto"
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
    models_folder: str | None = None  # where the model picker looks for .gguf files and model folders
    # The last server of File > Connect to a server… (never its API key).
    remote_url: str = ""
    remote_model: str = ""
    # Settings > "Serve the loaded model on localhost": the OpenAI API on 127.0.0.1:serve_port
    # (0: any free port) while the window runs.
    serve_on_localhost: bool = False
    serve_port: int = DEFAULT_SERVE_PORT
    # The window as it was closed (base64 of Qt's own blobs; "" or a damaged value: the defaults).
    window_geometry: str = ""
    window_state: str = ""  # the docks: which are open, where, how wide
    splitter_state: str = ""  # the chat list's width

    # ---- engine requests ------------------------------------------------------------------

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def thinking_budget(self) -> ThinkingBudget | None:
        """The budget to send when thinking is on. `close_tokens` stays empty: only the engine knows
        the loaded tokenizer's spelling of `</think>`, so it fills them in."""
        if not self.thinking or self.thinking_budget_tokens <= 0:
            return None
        return ThinkingBudget(max_tokens=self.thinking_budget_tokens, close_tokens=[])

    def load_request(
        self, path: str | None = None, device: str | None = None, draft: str | None = None
    ) -> LoadRequest:
        """`path`/`device` override the stored ones for this load only (the CLI's flags);
        BUILT_IN_MODEL asks for the embedded model whatever was loaded last. `draft`: a draft model
        loaded beside it (File > Load draft model…): never stored, it belongs to this target."""
        chosen = path if path is not None else self.last_model
        return LoadRequest(
            path=None if chosen == BUILT_IN_MODEL else chosen,
            device=device or self.device,
            dtype=None if self.dtype == "auto" else self.dtype,
            context=self.context,
            chunk=self.chunk,
            cuda_graphs=None if self.cuda_graphs == "auto" else self.cuda_graphs == "on",
            # A device given for this load alone means that device, not the stored split.
            devices=tuple(self.devices) if self.devices and not device else None,
            layer_split=tuple(self.layer_split) if self.devices and self.layer_split and not device else None,
            weights=self.weights,
            cpu_prefill=self.cpu_prefill,
            draft=draft,
            speculative=self.speculative,
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
        except (ValueError, RecursionError) as exc:
            log.warning("settings: %s is not valid JSON (%s), using defaults", path, exc)
            return cls()
        return cls.from_json(data)

    @classmethod
    def load_checked(cls, path: Path) -> OpenedSettings:
        """Like `load`, and what the user must be told: a file that is not valid JSON is moved
        aside (settings.json.broken-TIME) so the next save cannot overwrite it; one with values
        that were ignored is copied aside before anything is saved over it; one that cannot be read
        at all is left in place and must not be saved over (`writable` False)."""
        try:
            size = path.stat().st_size
            if size > MAX_SETTINGS_BYTES:
                raise ValueError(f"it is {size} bytes, more than a settings file can be")
            raw = path.read_bytes()
        except FileNotFoundError:
            return OpenedSettings(cls())
        except OSError as exc:
            problem = (
                f"The settings in {path} could not be read ({exc.strerror or exc}); defaults are used "
                "and changes will not be saved this session."
            )
            return OpenedSettings(cls(), problem, writable=False)
        except ValueError as exc:
            return _set_aside(path, cls(), str(exc), move=True)
        try:
            data = json.loads(raw.decode("utf-8"))  # Infinity/NaN parse, and fail as values
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            return _set_aside(path, cls(), f"not valid JSON: {exc}", move=True)
        if not isinstance(data, dict):
            return _set_aside(path, cls(), "not a JSON object", move=True)
        settings = cls.from_json(data)
        ignored = [
            f.name for f in fields(cls) if f.name in data and _validated(f.name, data[f.name]) is _INVALID
        ]
        if ignored:
            return _set_aside(path, settings, f"invalid values for {', '.join(ignored)}", move=False)
        return OpenedSettings(settings)

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


@dataclass(slots=True)
class OpenedSettings:
    settings: Settings
    problem: str | None = None  # what to tell the user, once
    writable: bool = True  # False: the file could not be read and is still there


def _set_aside(path: Path, settings: Settings, why: str, *, move: bool) -> OpenedSettings:
    """Keep the unreadable (move) or partly ignored (copy) file as settings.json.broken-TIME."""
    kept = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        if move:
            os.replace(path, kept)
        else:
            shutil.copy2(path, kept)
    except OSError as exc:
        problem = (
            f"The settings file {path} has problems ({why}) and could not be set aside "
            f"({exc.strerror or exc}); defaults are used and changes will not be saved this session."
        )
        return OpenedSettings(settings, problem, writable=False)
    log.warning("settings: %s: %s; kept as %s", path, why, kept.name)
    what = "Defaults are used" if move else "Those settings are back to their defaults"
    problem = f"The settings file had problems ({why}). {what}; the file was kept as {kept.name}."
    return OpenedSettings(settings, problem)


_INVALID = object()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number


def _is_number(value: object) -> bool:
    """A finite JSON number (Python's json reads Infinity and NaN; they are no setting)."""
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


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
        case "cpu_prefill":
            ok = value in CPU_PREFILL_MODES
        case "devices":
            ok = (
                isinstance(value, list)
                and len(value) <= MAX_DEVICES
                and all(isinstance(v, str) and v != "auto" and bool(_DEVICE.match(v)) for v in value)
            )
        case "layer_split":
            ok = (
                isinstance(value, list)
                and len(value) <= MAX_DEVICES
                and all(_is_int(v) and 0 < v <= 1_000_000 for v in value)
            )
        case "speculative":
            ok = value in SPECULATIVE_CHOICES
        case "unpark_on_generate" | "park_cancels_running" | "thinking" | "serve_on_localhost":
            ok = isinstance(value, bool)
        case "idle_park_minutes":
            ok = _is_number(value) and 0 <= value <= MAX_IDLE_PARK_MINUTES
            value = float(value) if ok else value
        case "context" | "chunk" | "max_new_tokens" | "snapshot_slots" | "snapshot_memory_mb":
            low, high = INT_RANGES[name]
            ok = _is_int(value) and low <= value <= high
        case "top_k" | "thinking_budget_tokens" | "serve_port":
            low, high = INT_RANGES[name]
            ok = _is_int(value) and low <= value <= high
        case "temperature":
            ok = _is_number(value) and 0.0 <= value <= 5.0
            value = float(value) if ok else value
        case "top_p":
            ok = _is_number(value) and 0.0 < value <= 1.0
            value = float(value) if ok else value
        case "window_geometry" | "window_state" | "splitter_state":
            ok = (
                isinstance(value, str)
                and len(value) <= MAX_WINDOW_STATE_CHARS
                and len(value) % 4 == 0
                and bool(_BASE64.match(value))
            )
        case "remote_url" | "remote_model":
            ok = isinstance(value, str) and len(value) <= 4096 and "\0" not in value
        case "last_model" | "models_folder":
            ok = value is None or (isinstance(value, str) and value != "" and "\0" not in value)
        case "recent_models":
            ok = isinstance(value, list) and all(
                isinstance(v, str) and v != "" and "\0" not in v for v in value
            )
            value = list(dict.fromkeys(value))[:MAX_RECENT_MODELS] if ok else value
        case "system_prompt":
            ok = isinstance(value, str)
        case _:
            ok = False
    return value if ok else _INVALID
