"""A scripted stand-in for EngineClient: no torch, no thread, same contract.

Answers stream in batches with an `asyncio.sleep` between them (so the Qt loop really runs in
between), cancel is honoured between batches, and loads or answers can be told to fail.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ds4desk.engine.api import (
    DeviceChoice,
    EngineError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GenerateStats,
    LoadRequest,
    LoadResult,
    MemoryStats,
    ModelInfo,
    ModelPreview,
    ParkResult,
    SlotInfo,
    SlotResult,
    TextDelta,
    ThinkingFormat,
)

DEFAULT_REPLY = "Hello! I am a **fake** model.\n\nHere is a list:\n- one\n- two\n"
# DeepSeek-V4's format (chat_template.probe_thinking finds it so): the prompt opens <think>.
PROMPT_OPENS_THINKING = ThinkingFormat(switch=True, opened_when_on=True)
CPU_ONLY = [DeviceChoice("auto", "auto (here: cpu)"), DeviceChoice("cpu", "cpu")]
TWO_GPUS = [
    DeviceChoice("auto", "auto (here: cuda:0)"),
    DeviceChoice("cpu", "cpu"),
    DeviceChoice("cuda:0", "cuda:0 · Fake GPU, 80 GiB"),
    DeviceChoice("cuda:1", "cuda:1 · Fake GPU, 80 GiB"),
]


def fake_info(
    path: str | None,
    device: str,
    thinking: ThinkingFormat = PROMPT_OPENS_THINKING,
    draft: str | None = None,
    cpu_prefill: str = "float32",
) -> ModelInfo:
    on_cpu = device in ("auto", "cpu")
    return ModelInfo(
        name="fake-llama-1b",
        family="llama",
        architecture="LlamaForCausalLM",
        path=path or "<embedded>",
        device="cpu" if device == "auto" else device,
        dtype="float32",
        parameters=1_100_000_000,
        weight_bytes=4_400_000_000,
        context=4096,
        tokenizer="BPE, 32000 tokens",
        has_chat_template=True,
        thinking=thinking,
        draft=draft or "",
        draft_weight_bytes=DRAFT_BYTES if draft else 0,
        cpu_prefill=cpu_prefill if on_cpu else "",
    )


DRAFT_BYTES = 270_000_000  # what a fake draft model frees when parked


@dataclass
class FakeBackend:
    reply: str = DEFAULT_REPLY  # answered when `replies` is empty
    replies: list[str] = field(default_factory=list)  # consumed one per request
    batch_chars: int = 6
    bf16_products: bool = True  # a CPU with AVX-512 BF16, where CPU prompt math can be bfloat16
    delay_s: float = 0.001
    fail_load: EngineError | None = None
    fail_devices: tuple[str, ...] = ()  # loads on these devices fail, as a broken GPU does
    fail_generate: EngineError | None = None
    fail_after_batches: int = 0  # batches streamed before fail_generate strikes
    on_load: Callable[[LoadResult], None] | None = None
    after_batch: Callable[[], None] | None = None  # called after each on_delta (tests look at the view)
    park_bytes: int = 4_400_000_000  # what a park frees and an unpark takes back
    fail_park: EngineError | None = None
    fail_unpark: EngineError | None = None
    raise_on_park: Exception | None = None  # a broken backend: the window must survive it
    prompt_tokens: int = 12
    reused_tokens: int = 0  # reported as taken from a snapshot
    thinking: ThinkingFormat = PROMPT_OPENS_THINKING  # what the loaded model's chat format does
    speculation: tuple[str, int, int] | None = None  # (drafter, drafted, accepted) every answer reports
    devices: list[DeviceChoice] = field(default_factory=lambda: list(CPU_ONLY))  # what list_devices says

    # What the window did.
    load_requests: list[LoadRequest] = field(default_factory=list)
    generate_requests: list[GenerateRequest] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    park_calls: list[tuple[str, str]] = field(default_factory=list)  # ("park" | "unpark", selector)
    batches_sent: int = 0

    _info: ModelInfo | None = None
    _progress: asyncio.Event | None = None
    _parked: bool = False
    _draft_parked: bool = False

    @property
    def model_info(self) -> ModelInfo | None:
        return self._info

    @property
    def parked(self) -> bool:
        return self._parked

    async def park(self, selector: str) -> ParkResult:
        self.park_calls.append(("park", selector))
        await asyncio.sleep(self.delay_s)
        if self.raise_on_park is not None:
            raise self.raise_on_park
        if self.fail_park is not None:
            return ParkResult(selector, self._parked, error=self.fail_park)
        if selector == "draft":  # like the engine: frees a loaded draft, else nothing to do
            if self._info is None or self._parked or not self._info.draft or self._draft_parked:
                return ParkResult(selector, self._parked)
            self._draft_parked = True
            return ParkResult(selector, False, bytes=DRAFT_BYTES, seconds=0.01)
        if self._info is None or self._parked:
            return ParkResult(selector, self._parked)
        self._parked = True
        return ParkResult(selector, True, bytes=self.park_bytes, seconds=0.02, memory=self._memory_now())

    async def unpark(self, selector: str) -> ParkResult:
        self.park_calls.append(("unpark", selector))
        await asyncio.sleep(self.delay_s)
        if self.fail_unpark is not None:
            return ParkResult(selector, self._parked, error=self.fail_unpark)
        if selector == "draft":
            if self._info is None or self._parked or not self._info.draft or not self._draft_parked:
                return ParkResult(selector, self._parked)
            self._draft_parked = False
            return ParkResult(selector, False, bytes=DRAFT_BYTES, seconds=0.01)
        if not self._parked:
            return ParkResult(selector, self._parked)
        self._parked = False
        return ParkResult(selector, False, bytes=self.park_bytes, seconds=0.5, memory=self._memory_now())

    async def load(
        self, request: LoadRequest, on_progress: Callable[[int, int, str], None] | None = None
    ) -> LoadResult:
        self.load_requests.append(request)
        await asyncio.sleep(self.delay_s)
        cancelled = await self._simulate_load_progress(on_progress)
        if cancelled is not None:
            result = cancelled
        elif self.fail_load is not None:
            result = LoadResult(error=self.fail_load, seconds=0.01)
        elif request.device in self.fail_devices:
            detail = f"CUDA error: no kernel image is available for execution on {request.device}"
            result = LoadResult(error=EngineError(ErrorCode.LOAD_FAILED, detail), seconds=0.01)
        else:
            # The CPU's products as the engine settles them: bfloat16 only where it multiplies them.
            prefill = request.cpu_prefill if self.bf16_products else "float32"
            self._info = fake_info(request.path, request.device, self.thinking, request.draft, prefill)
            self._parked = False  # a new model replaces a parked one
            self._draft_parked = False
            result = LoadResult(info=self._info, seconds=0.25)
        if self.on_load is not None:
            self.on_load(result)
        return result

    async def generate(
        self, request: GenerateRequest, on_delta: Callable[[TextDelta], None] | None = None
    ) -> GenerateResult:
        self.generate_requests.append(request)
        rid = request.request_id
        if self._info is None:
            return GenerateResult(rid, error=EngineError(ErrorCode.MODEL_NOT_LOADED, "no model is loaded"))
        if self._parked:  # the engine's default: an answer to a parked model loads it back first
            await self.unpark("all")
        text = self.replies.pop(0) if self.replies else self.reply
        chunks = [text[i : i + self.batch_chars] for i in range(0, len(text), self.batch_chars)]
        sent: list[str] = []
        for index, chunk in enumerate(chunks):
            await asyncio.sleep(self.delay_s)
            if rid in self.cancelled:
                return self._result(rid, "".join(sent), len(sent), FinishReason.CANCELLED)
            if self.fail_generate is not None and index >= self.fail_after_batches:
                return GenerateResult(rid, error=self.fail_generate, finish_reason=FinishReason.ERROR)
            sent.append(chunk)
            self.batches_sent += 1
            if on_delta is not None:
                on_delta(TextDelta(rid, tuple(range(index, index + 1)), chunk))
            if self.after_batch is not None:
                self.after_batch()
            self._wake()
        self._save_slot(request, len(chunks))
        return self._result(rid, text, len(chunks), FinishReason.STOP)

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    async def list_devices(self) -> list[DeviceChoice]:
        """The window's device lister (app.engine_devices in the app)."""
        await asyncio.sleep(self.delay_s)
        return list(self.devices)

    async def wait_for_batches(self, count: int) -> None:
        """Until `count` batches were streamed in total (an event, not a timer)."""
        while self.batches_sent < count:
            self._progress = asyncio.Event()
            await self._progress.wait()

    def _wake(self) -> None:
        if self._progress is not None:
            self._progress.set()

    def _result(self, rid: int, text: str, tokens: int, reason: FinishReason) -> GenerateResult:
        stats = GenerateStats(
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            prefill_tokens=self.prompt_tokens - self.reused_tokens,
            generated_tokens=tokens,
            time_to_first_token_s=0.05,
            prefill_s=0.05,
            decode_s=0.1,
        )
        if self.speculation is not None:
            stats.speculative, stats.drafted_tokens, stats.accepted_tokens = self.speculation
        return GenerateResult(rid, tokens=list(range(tokens)), text=text, finish_reason=reason, stats=stats)

    # ---- snapshot slots and memory: like the engine's, kept in a list ---------------------------

    slot_infos: list[SlotInfo] = field(default_factory=list)
    slot_calls: list[tuple[str, int | None, Path | None]] = field(default_factory=list)
    fail_slots: EngineError | None = None
    memory_total: int = 80_000_000_000
    idle_park_in_s: float | None = None  # what memory() reports for the engine's idle auto-park
    memory_calls: int = 0

    def _save_slot(self, request: GenerateRequest, tokens: int) -> None:
        save = request.save_snapshot
        if save is None:
            return
        # The next turn of a chat continues from its previous snapshot: that one gets the hit.
        for index, info in enumerate(self.slot_infos):
            if save.tag is not None and info.tag == save.tag:
                self.slot_infos[index] = replace(info, hits=info.hits + 1)
        used = {info.slot for info in self.slot_infos}
        slot = min(set(range(len(used) + 1)) - used)
        # About 4 characters a token: a later turn of a chat holds more tokens than the one before.
        count = self.prompt_tokens + tokens + sum(len(m["content"]) for m in request.messages or []) // 4
        self.slot_infos.append(SlotInfo(slot, count, count * 36_864, tag=save.tag))
        self.slot_infos.sort(key=lambda info: info.slot)

    async def slots(self, op: str = "list", slot: int | None = None, path: Path | None = None) -> SlotResult:
        self.slot_calls.append((op, slot, path))
        await asyncio.sleep(self.delay_s)
        if self.fail_slots is not None:
            return SlotResult(slot=slot, error=self.fail_slots)
        if self._info is None:
            return SlotResult(slot=slot, error=EngineError(ErrorCode.MODEL_NOT_LOADED, "no model is loaded"))
        by_slot = {info.slot: info for info in self.slot_infos}
        if op in ("free", "pin", "unpin", "save") and slot not in by_slot:
            error = EngineError(ErrorCode.INVALID_SNAPSHOT_SLOT, f"slot {slot} holds no snapshot")
            return SlotResult(slot=slot, error=error)
        if op == "free":
            del by_slot[slot]  # type: ignore[arg-type]
        elif op in ("pin", "unpin"):
            by_slot[slot] = replace(by_slot[slot], pinned=op == "pin")  # type: ignore[index]
        elif op == "save" and path is not None:
            info = by_slot[slot]  # type: ignore[index]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fake-snapshot": [info.tokens, info.bytes, info.tag]}))
            by_slot[info.slot] = replace(info, path=str(path))
        elif op == "load" and path is not None:
            try:
                tokens, size, tag = json.loads(path.read_text())["fake-snapshot"]
            except (OSError, ValueError, KeyError, TypeError):
                error = EngineError(ErrorCode.INVALID_SNAPSHOT_SLOT, f"{path.name} is no snapshot")
                return SlotResult(slot=slot, error=error)
            slot = slot if slot is not None else min(set(range(len(by_slot) + 1)) - by_slot.keys())
            by_slot[slot] = SlotInfo(slot, tokens, size, tag=tag, path=str(path))
        elif op != "list":
            return SlotResult(slot=slot, error=EngineError(ErrorCode.BAD_REQUEST, f"bad slot op {op!r}"))
        self.slot_infos = sorted(by_slot.values(), key=lambda info: info.slot)
        return SlotResult(list(self.slot_infos), slot)

    def _memory_now(self) -> MemoryStats:
        allocated = self.park_bytes if self._info is not None and not self._parked else 0
        reserved = allocated + 100_000_000 if allocated else 0
        return MemoryStats(
            device="cuda:0",
            name="Fake GPU",
            allocated=allocated,
            reserved=reserved,
            free=self.memory_total - reserved,
            total=self.memory_total,
            idle_park_in_s=self.idle_park_in_s if allocated else None,
        )

    async def memory(self) -> MemoryStats:
        self.memory_calls += 1
        await asyncio.sleep(self.delay_s)
        return self._memory_now()

    # ---- opening models: preflight, load progress and cancel ------------------------------------

    previews: dict[str, ModelPreview] = field(default_factory=dict)  # by path; else a preview that fits
    preview_requests: list[LoadRequest] = field(default_factory=list)
    load_steps: int = 0  # tensors a load reports progress for (0: none)
    pause_load_at: int | None = None  # the load waits after this step until cancel_load or resume_load
    cancel_load_calls: int = 0
    _load_paused: asyncio.Event | None = None
    _load_resume: asyncio.Event | None = None
    _load_cancelled: bool = False

    async def preview(self, request: LoadRequest) -> ModelPreview:
        self.preview_requests.append(request)
        await asyncio.sleep(self.delay_s)
        path = request.path or "<embedded>"
        if path in self.previews:
            return self.previews[path]
        return ModelPreview(
            path,
            family="llama",
            architecture="LlamaForCausalLM",
            parameters=1_100_000_000,
            weight_bytes=4_400_000_000,
            cache_bytes=100_000_000,
            free_bytes=self.memory_total,
            fits=True,
            message="1.1B parameters (LlamaForCausalLM), needs 4.5 GB",
            device="cpu",
            dtype="float32",
            context=request.context,
        )

    def cancel_load(self) -> None:
        self.cancel_load_calls += 1
        self._load_cancelled = True
        if self._load_resume is not None:
            self._load_resume.set()

    def resume_load(self) -> None:
        if self._load_resume is not None:
            self._load_resume.set()

    async def wait_load_paused(self) -> None:
        """Until a load reached `pause_load_at` (an event, not a timer)."""
        if self._load_paused is None:
            self._load_paused = asyncio.Event()
        await self._load_paused.wait()

    async def _simulate_load_progress(
        self, on_progress: Callable[[int, int, str], None] | None
    ) -> LoadResult | None:
        """Steps like the engine's tensors; a cancelled load comes back like the engine's."""
        self._load_cancelled = False
        for step in range(1, self.load_steps + 1):
            await asyncio.sleep(self.delay_s)
            if self._load_cancelled:
                return LoadResult(error=EngineError(ErrorCode.CANCELLED, "loading was cancelled"))
            if on_progress is not None:
                on_progress(step, self.load_steps, "tensors")
            if step == self.pause_load_at:
                self._load_resume = asyncio.Event()
                if self._load_paused is None:
                    self._load_paused = asyncio.Event()
                self._load_paused.set()
                await self._load_resume.wait()
        if self._load_cancelled:
            return LoadResult(error=EngineError(ErrorCode.CANCELLED, "loading was cancelled"))
        return None
