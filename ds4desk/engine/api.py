"""Plain data that crosses the engine's thread boundary: requests, results, events, errors.

Nothing here imports torch, so the UI can use these types without paying for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class ErrorCode(StrEnum):
    CONTEXT_OVERFLOW = "context_overflow"
    PREFILL_FAILED = "prefill_failed"
    DECODE_FAILED = "decode_failed"
    INVALID_SNAPSHOT_SLOT = "invalid_snapshot_slot"
    MODEL_PARKED = "model_parked"
    MODEL_NOT_LOADED = "model_not_loaded"
    OUT_OF_MEMORY = "out_of_memory"
    CANCELLED = "cancelled"
    BAD_REQUEST = "bad_request"
    LOAD_FAILED = "load_failed"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True, frozen=True)
class EngineError:
    code: ErrorCode
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"code": str(self.code), "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


class EngineFailure(Exception):
    """Raised inside the engine; turned into an EngineError before it crosses a thread boundary."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.error = EngineError(code, detail)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Always the most likely token: temperature 0, or a top-k of 1."""
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(slots=True)
class ThinkingBudget:
    """At most `max_tokens` of thinking, counted from the start of the answer (the prompt opens the
    thinking part); then `close_tokens` (the tokenizer's spelling of `</think>`) are forced. Left
    empty, the engine fills in the loaded tokenizer's spelling (the UI does not know the ids)."""

    max_tokens: int
    close_tokens: list[int]


@dataclass(slots=True)
class SaveSnapshot:
    """Ask for a snapshot: at a position inside the prompt, or (at None) after the answer."""

    at: int | None = None
    slot: int | None = None  # None: a free slot, else the least recently used one
    tag: str | None = None  # who the slot belongs to (the window passes its chat id)


_request_ids = itertools.count(1)

# Called on the engine thread with every newly generated token id, in order.
TokenCallback = Callable[[int], None]


@dataclass(slots=True, frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position, with its text and natural log-probability."""

    token: int
    text: str  # the token alone, decoded with its special tokens
    logprob: float


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's unmodified distribution, and the
    GenerateRequest.top_logprobs most likely tokens there, most likely first."""

    token: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(slots=True)
class GenerateRequest:
    """Exactly one of prompt_tokens, messages or raw_text says what the prompt is."""

    prompt_tokens: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # rendered with the model's chat template
    raw_text: str | None = None  # tokenized as-is
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 512
    stop_tokens: list[int] | None = None  # None: the tokenizer's end-of-turn tokens
    thinking: bool = False  # thinking mode for templates that have one (a budget implies it)
    thinking_budget: ThinkingBudget | None = None
    use_snapshots: bool = True  # continue from the longest snapshot that prefixes the prompt
    save_snapshot: SaveSnapshot | None = None
    on_token: TokenCallback | None = None
    # One of SPECULATIVE_MODES; None: the load's setting (LoadRequest.speculative).
    speculative: str | None = None
    # None: no per-token entries; 0..20: each generated token's TokenLogprob with that many most
    # likely alternatives (in TextDelta.logprobs and GenerateResult.token_logprobs). Decoding then
    # runs without speculation: the entries come from each plain step's own logits.
    top_logprobs: int | None = None
    request_id: int = field(default_factory=lambda: next(_request_ids))


@dataclass(slots=True)
class GenerateStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # taken from a snapshot instead of prefilled
    prefill_tokens: int = 0  # actually computed
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Speculative decoding: the drafter that ran ("off", "lookup" or "draft"), the tokens it
    # proposed to the target and how many of them the target accepted.
    speculative: str = "off"
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes out of prefill; the decode steps make the rest.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict[str, float | int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated_tokens,
            "time_to_first_token_s": self.time_to_first_token_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "speculative": self.speculative,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
        }


@dataclass(slots=True)
class GenerateResult:
    request_id: int
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # with GenerateRequest.top_logprobs
    text: str = ""
    finish_reason: FinishReason = FinishReason.ERROR
    error: EngineError | None = None
    stats: GenerateStats = field(default_factory=GenerateStats)
    budget_forced_close: bool = False
    snapshot_slot: int | None = None  # where save_snapshot put its snapshot

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "snapshot_slot": self.snapshot_slot,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "text": self.text,
            "finish_reason": str(self.finish_reason),
            "error": self.error.to_json() if self.error else None,
            "budget_forced_close": self.budget_forced_close,
            "stats": self.stats.to_json(),
        }


@dataclass(slots=True)
class LoadRequest:
    path: str | None = None  # None: the embedded default model
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on a GPU
    context: int = 4096
    chunk: int = 0  # prompt tokens per prefill step; 0: automatic (see engine._auto_chunk)
    # Decode steps replayed from a captured CUDA graph. None: on for CUDA, off for HIP and CPU.
    cuda_graphs: bool | None = None
    # A layer split across devices (ds4desk.engine.split): None runs every layer on `device`.
    # `devices` alone splits automatically by free memory; `layer_split` gives the layers per device.
    devices: tuple[str, ...] | None = None
    layer_split: tuple[int, ...] | None = None
    # A 16-bit model's linear weights as stored, or quantized while loading to GGUF blocks (one of
    # WEIGHT_MODES), so that the model fits a smaller GPU.
    weights: str = "as-stored"
    # A draft model for speculative decoding (a dense model with the target's vocabulary), loaded
    # beside the target on its first device; None: no draft.
    draft: str | None = None
    # The default of every request's GenerateRequest.speculative (one of SPECULATIVE_MODES).
    speculative: str = "auto"
    # How a prompt on the CPU multiplies GGUF weights (one of CPU_PREFILL_MODES): "float32", exact to
    # the dequantized weights, or "bfloat16", about 1.4-2x faster where the CPU multiplies bfloat16
    # natively (AVX-512 BF16; elsewhere float32 is kept), with logits rounded slightly differently.
    cpu_prefill: str = "float32"
    # Run what the first request would otherwise pay for (graph capture, kernel compilation, first
    # calls) as the load's last stage, so the first answer is as fast as the next (engine/warm_up.py).
    warm_up: bool = True


# Speculative decoding: "auto" is the draft model when one is loaded, else prompt lookup, and off
# for a model whose cache cannot roll back (DeepSeek-V4); "mtp" (DeepSeek-V4's MTP layer) is
# refused for now.
SPECULATIVE_MODES = ("off", "auto", "draft", "mtp", "lookup")

# LoadRequest.weights: "as-stored", "q8" (Q8_0 blocks) or "q4" (Q4_K blocks).
WEIGHT_MODES = ("as-stored", "q8", "q4")

# LoadRequest.cpu_prefill.
CPU_PREFILL_MODES = ("float32", "bfloat16")


@dataclass(slots=True, frozen=True)
class DeviceChoice:
    """A device this torch can run a model on, as Settings > Device lists it (devices.visible_devices)."""

    name: str  # what LoadRequest.device takes: "auto", "cpu", "cuda:0", ...
    label: str  # what the user reads: "cuda:0 · NVIDIA H200, 140 GiB"


@dataclass(slots=True, frozen=True)
class ThinkingFormat:
    """What a model's chat format does with thinking, learned at load (chat_template.probe_thinking)."""

    # The thinking switch changes the prompt: the window offers Think only then.
    switch: bool = False
    # With thinking on (off) the prompt ends inside <think>: the answer starts thinking without
    # writing the tag (off: a reasoning-only model).
    opened_when_on: bool = False
    opened_when_off: bool = False

    def opened(self, thinking: bool) -> bool:
        """Whether the answer starts inside <think> without writing the tag itself."""
        return self.opened_when_on if thinking else self.opened_when_off


@dataclass(slots=True, frozen=True)
class ModelInfo:
    name: str
    family: str  # "llama", "qwen2", "qwen3", "mistral", ...
    architecture: str  # as the config names it, e.g. "LlamaForCausalLM"
    path: str
    device: str
    dtype: str
    parameters: int
    weight_bytes: int
    context: int
    tokenizer: str  # what the tokenizer is, e.g. "BPE, 49152 tokens"
    has_chat_template: bool
    thinking: ThinkingFormat = field(default_factory=ThinkingFormat)
    draft: str = ""  # the draft model's path, "" when none is loaded
    draft_weight_bytes: int = 0
    # The products a prompt on GGUF weights runs in on the CPU ("float32", or "bfloat16" where
    # LoadRequest.cpu_prefill asked and the CPU has AVX-512 BF16); "" on a GPU.
    cpu_prefill: str = ""


@dataclass(slots=True)
class LoadResult:
    info: ModelInfo | None = None
    error: EngineError | None = None
    seconds: float = 0.0  # the whole load, its warm-up included
    warm_up_seconds: float = 0.0  # of which the warm-up stage (0 when it did not run)
    # The previous model was let go before this load (memory held only one): it could not keep
    # answering meanwhile, and after a failure it is reloaded (or left parked).
    dropped_previous: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.info is not None


# Called on the engine thread while a model loads: (done, total, unit), unit "tensors" while the weights
# are read (total 0 while the amount of work is not known yet: a GGUF being converted), then
# WARM_UP_UNIT while the warm-up stage runs (LoadRequest.warm_up).
WARM_UP_UNIT = "warm-up steps"
ProgressCallback = Callable[[int, int, str], None]


@dataclass(slots=True)
class ModelPreview:
    """What loading `path` would take, worked out from headers alone (nothing allocated)."""

    path: str
    family: str = ""
    architecture: str = ""
    parameters: int = 0
    weight_bytes: int = 0  # in the dtype it would be loaded in
    cache_bytes: int = 0  # the KV cache for `context` positions
    free_bytes: int | None = None  # free memory on `device` (None: unknown), before any unload
    fits: bool = False
    message: str = ""  # one line for the user: the sizes, or why it does not fit, or the error
    error: EngineError | None = None
    device: str = ""
    dtype: str = ""
    context: int = 0  # after clamping to the model's own maximum
    # Stored type (safetensors dtype, FP8 / FP4, GGML type) -> bytes in the files, largest first.
    stored_types: tuple[tuple[str, int], ...] = ()
    # Fits only once the current model is let go: that one cannot keep answering during the load.
    needs_unload: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes


# ---- memory readout and snapshot-slot listing ---------------------------------------------------


@dataclass(slots=True, frozen=True)
class MemoryStats:
    """The device memory as the engine thread read it. On CUDA: the caching allocator's allocated
    bytes on the model's devices and its reserved bytes, the driver's free/total; on the CPU: the
    model's weights + cache (0 with no model) as allocated, the process RSS as reserved, the system's
    MemAvailable/MemTotal. `allocated` is what the memory readout shows and what a park frees. 0
    where the platform cannot say."""

    device: str  # "cuda:0", "cpu", ...
    name: str  # e.g. "NVIDIA H200" or the CPU model
    allocated: int = 0
    reserved: int = 0
    free: int = 0
    total: int = 0
    # Seconds until the idle auto-park, None when it is off or nothing is loaded to park.
    idle_park_in_s: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "name": self.name,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "free": self.free,
            "total": self.total,
            "idle_park_in_s": self.idle_park_in_s,
        }


@dataclass(slots=True, frozen=True)
class SlotInfo:
    """One snapshot slot as listed: `age_s` since it was made, `idle_s` since it was last restored."""

    slot: int
    tokens: int
    bytes: int
    pinned: bool = False
    hits: int = 0  # how many requests continued from it
    age_s: float = 0.0
    idle_s: float = 0.0
    tag: str | None = None  # the owner the request named (the window's chat id)
    path: str | None = None  # the file it was last saved to or loaded from

    def to_json(self) -> dict[str, object]:
        return {
            "slot": self.slot,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "pinned": self.pinned,
            "hits": self.hits,
            "age_s": self.age_s,
            "idle_s": self.idle_s,
            "tag": self.tag,
            "path": self.path,
        }


PARK_SELECTORS = ("", "all", "target", "draft")


@dataclass(slots=True)
class ParkResult:
    """What a park or unpark did: `bytes` freed by a park, taken by an unpark."""

    selector: str
    parked: bool  # the state of the target model afterwards
    bytes: int = 0
    seconds: float = 0.0
    error: EngineError | None = None
    memory: MemoryStats | None = None  # read right after the action

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, object]:
        return {
            "selector": self.selector,
            "parked": self.parked,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "error": self.error.to_json() if self.error else None,
            "memory": self.memory.to_json() if self.memory else None,
        }


@dataclass(slots=True)
class SlotResult:
    """The answer to a snapshot-slot command: `slots` lists them all afterwards."""

    slots: list[SlotInfo] = field(default_factory=list)
    slot: int | None = None
    error: EngineError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, object]:
        return {
            "slot": self.slot,
            "slots": [info.to_json() for info in self.slots],
            "error": self.error.to_json() if self.error else None,
        }


# Events the client delivers on the asyncio loop.


@dataclass(slots=True, frozen=True)
class TextDelta:
    """A batch of streamed output: the new token ids and the text they completed."""

    request_id: int
    tokens: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, with GenerateRequest.top_logprobs
