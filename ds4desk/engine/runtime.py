"""One loaded model and its KV cache: chunked prefill, the decode loop, sampling and stats."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ds4desk.engine.api import (
    EngineFailure,
    ErrorCode,
    FinishReason,
    GenerateStats,
    SamplingParams,
    SaveSnapshot,
    ThinkingBudget,
)
from ds4desk.engine.budget import ThinkingGate
from ds4desk.engine.graphs import GraphedDecode
from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.engine.logprobs import token_logprobs
from ds4desk.engine.models.base import CausalLM
from ds4desk.engine.sampling import check_sampling, make_generator, sample
from ds4desk.engine.snapshots import Snapshot, SnapshotStore
from ds4desk.engine.speculative.adaptive import CPU_CURVE, DEFAULT_MAX_K, GRAPHED_CURVE, AdaptiveK
from ds4desk.engine.speculative.decode import SpeculativeDecode
from ds4desk.engine.speculative.draft_model import DraftModel
from ds4desk.engine.speculative.drafter import Drafter, LookupDrafter
from ds4desk.engine.speculative.mode import resolve_mode
from ds4desk.engine.speculative.mtp import MtpDrafter, mtp_available, track_mtp
from ds4desk.engine.speculative.rollback import rollback_of

log = logging.getLogger(__name__)

# A kept token's log-probability and its most likely alternatives [(id, log-probability)].
Scored = tuple[float, list[tuple[int, float]]]

# Snapshots this runtime saved also stay on its GPU, newest first, within this many bytes and a
# quarter of the device's free memory: a follow-up turn then restores with a copy inside the GPU
# rather than one over the bus (the host copy stays the store's, for disk, parking and eviction).
RESIDENT_SNAPSHOT_BYTES = 2**30
# A prompt suffix (after a restored snapshot, or a short prompt) up to this long runs through the
# captured prompt-piece graphs (GraphedDecode.prefill): eagerly, its forward costs the launches of
# a whole prefill chunk, about 20 ms on an H200 whatever its length.
GRAPHED_SUFFIX_TOKENS = 64
# torch's SDPA may pick cuDNN's attention on NVIDIA GPUs, which builds an execution plan for every
# new sequence length: on an H200 the first 3,000-token prompt of a 28-layer model spent 45 ms in
# it (bench/first_answer.py --profile), and every prompt of a length not seen before pays again.
# Flash attention has no plan to build. Off by default; True lets SDPA choose as it would.
CUDNN_ATTENTION = False


@dataclass(slots=True)
class _Resident:
    """The device copy of one snapshot's state and logits."""

    snapshot: Snapshot
    state: dict[str, torch.Tensor]
    logits: torch.Tensor


@dataclass(slots=True)
class RunOutcome:
    tokens: list[int] = field(default_factory=list)  # generated, without the stop token
    logprobs: list[float] = field(default_factory=list)  # one per entry of tokens
    finish_reason: FinishReason = FinishReason.LENGTH
    stats: GenerateStats = field(default_factory=GenerateStats)
    budget_forced_close: bool = False
    snapshot_slot: int | None = None


class Runtime:
    """Owns `model`'s cache for `context` positions. Every generate starts at position 0; the
    cache is overwritten in place and attention never reads past what this request wrote, so no
    state carries over from one request to the next."""

    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        context: int,
        chunk: int = 512,
        graphs: bool = False,
        defer_graphs: bool = False,
        cpu_prefill: str = "float32",
    ) -> None:
        """`graphs`: decode through captured CUDA graphs, captured here, or by `capture_graphs` when
        `defer_graphs` (the load's warm-up stage does, with its progress). `cpu_prefill`: the products
        of a prompt on GGUF weights on the CPU (LoadRequest.cpu_prefill)."""
        if context <= 0 or chunk <= 0:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"context ({context}) and chunk ({chunk}) must be positive"
            )
        self.model = model
        self.device = device
        self.context = context
        self.chunk = chunk
        # bfloat16 products only where the CPU multiplies bfloat16 natively: elsewhere they are slower.
        self.bf16_prefill = (
            cpu_prefill == "bfloat16" and device.type == "cpu" and gguf_cpu.bf16_products_run_fast()
        )
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(CUDNN_ATTENTION)  # process-wide, as SDPA's choice is
        try:
            model.allocate_cache(context)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            # The CPU allocator says so with a plain RuntimeError.
            if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(exc):
                raise
            raise EngineFailure(
                ErrorCode.OUT_OF_MEMORY, f"the cache for {context} positions does not fit on {device}"
            ) from exc
        # A draft model for speculative decoding (the engine attaches and detaches it), and the most
        # tokens one step drafts (the adaptive k's ceiling).
        self.draft: DraftModel | None = None
        self.max_draft_tokens = DEFAULT_MAX_K
        self.graphs: GraphedDecode | None = None
        self.graphs_pending = graphs and defer_graphs  # wanted, not captured yet
        self.resident_snapshot_bytes = RESIDENT_SNAPSHOT_BYTES if device.type == "cuda" else 0
        self._resident: list[_Resident] = []  # oldest first
        # The snapshot the model's state still is, as saved after the last answer and not moved
        # since: a follow-up turn continues from it in place, with no copy (see _restore).
        self._live: Snapshot | None = None
        if graphs and not defer_graphs:
            self.capture_graphs()

    def capture_graphs(self, on_captured: Callable[[], None] | None = None) -> None:
        """Capture the decode graphs (see GraphedDecode); `on_captured` runs after each span and may
        raise EngineFailure to stop (a cancelled load), which propagates."""
        self.graphs_pending = False
        self._live = None  # the captures run the model
        try:
            self.graphs = GraphedDecode(self.model, self.device, on_captured)
        except EngineFailure:
            raise
        except Exception:
            # Out of memory, or an op the capture refuses: either way eager decode still works.
            log.exception("could not capture decode graphs; decoding eagerly")

    def close(self) -> None:
        """Free the cache and graphs (the weights belong to whoever loaded the model)."""
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._resident.clear()
        self._live = None
        self.model.free_cache()

    def _decode(self, token: torch.Tensor | None, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits after `token` at `pos`, and from a graph also its greedy pick (see GraphedDecode;
        token None: that pick, chained on the device)."""
        if self.graphs is not None:
            return self.graphs.step(token, pos)
        assert token is not None
        logits = self.model.forward(token.view(1), pos, "last")
        assert logits is not None
        return logits, None

    def prefill_logits(self, ids: list[int], split_at: int | None = None) -> torch.Tensor:
        """Prefill `ids` from position 0 in chunks and return the last position's float32 logits [V].
        `split_at`: a chunk also ends there (the warm-up's prompt in two chunks)."""
        if not ids:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
        if len(ids) > self.context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW, f"{len(ids)} prompt tokens do not fit a context of {self.context}"
            )
        if split_at is not None and not 0 < split_at < len(ids):
            split_at = None
        self._live = None
        logits = self._prefill(ids, 0, lambda: False, split_at)
        assert logits is not None
        return logits

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new_tokens: int,
        stop_ids: set[int],
        on_token: Callable[[int], None],
        should_cancel: Callable[[], bool],
        thinking: ThinkingBudget | None = None,
        snapshots: SnapshotStore | None = None,
        use_snapshots: bool = True,
        save: SaveSnapshot | None = None,
        speculative: str = "off",
        top_logprobs: int | None = None,
        scored: list[Scored] | None = None,
    ) -> RunOutcome:
        """`speculative`: one of SPECULATIVE_MODES (speculative/mode.py resolves "auto").
        `top_logprobs`: each kept token's log-probability and its `top_logprobs` most likely
        alternatives go into `scored` before `on_token` sees the token; decoding then runs without
        speculation (the entries come from each plain step's logits)."""
        started = time.perf_counter()
        if not prompt_ids:
            raise EngineFailure(ErrorCode.BAD_REQUEST, "the prompt is empty")
        if max_new_tokens < 0:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"max_new_tokens must not be negative, got {max_new_tokens}"
            )
        if len(prompt_ids) + max_new_tokens > self.context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW,
                f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens exceed the context of "
                f"{self.context}",
            )
        vocab = self.model.vocab_size
        # min and max in C: a comprehension over a long conversation's ids cost ~0.15 ms a request.
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        check_sampling(sampling)
        can_roll_back = rollback_of(self.model) is not None
        mode = resolve_mode(
            speculative,
            can_roll_back,
            self.draft is not None,
            self.graphs is not None,
            has_mtp=mtp_available(self.model),
        )
        if top_logprobs is not None:
            mode = "off"
        # Before the prefill (and any snapshot restore): the MTP block follows the target's forwards.
        track_mtp(self.model, mode == "mtp")
        gate = ThinkingGate(thinking, vocab) if thinking is not None else None

        out = RunOutcome()
        stats = out.stats
        stats.prompt_tokens = len(prompt_ids)
        stats.speculative = mode
        if max_new_tokens == 0:
            return out

        save_at = self._check_save(save, snapshots, len(prompt_ids))
        generator = make_generator(sampling, self.device)
        start, restored = self._restore(prompt_ids, snapshots if use_snapshots else None, save_at)
        stats.reused_tokens = start
        stats.prefill_tokens = len(prompt_ids) - start

        def keep(at: int, at_logits: torch.Tensor) -> None:
            assert snapshots is not None and save is not None
            snap = snapshots.put(prompt_ids[:at], self._host_state(at), at_logits, save.slot)
            self._keep_resident(snapshots, snap)
            out.snapshot_slot = snap.slot

        if save_at is not None and save_at == start and restored is not None:
            keep(save_at, restored)  # the snapshot asked for is the one just restored: refresh it
        if start == len(prompt_ids):
            logits = restored  # the whole prompt was a snapshot: no prefill at all
        else:
            logits = self._prefill(prompt_ids, start, should_cancel, save_at, keep)
        stats.prefill_s = time.perf_counter() - started
        if logits is None:
            out.finish_reason = FinishReason.CANCELLED
            return out

        pos = len(prompt_ids)
        emission = _Emission(out, gate, stop_ids, on_token, should_cancel, max_new_tokens, started, scored)
        with torch.inference_mode():
            if mode == "off":
                pos, logits = self._decode_plain(
                    logits, pos, sampling, generator, gate, emission, top_logprobs
                )
            else:
                pos, logits = self._decode_speculative(
                    mode, [*prompt_ids], logits, pos, sampling, generator, gate, emission, max_new_tokens
                )
        stats.decode_s = time.perf_counter() - emission.decode_start if emission.decode_start else 0.0
        out.budget_forced_close = gate is not None and gate.forced
        if save is not None and save.at is None and out.finish_reason != FinishReason.CANCELLED:
            # The cache now holds the prompt and every generated token that was fed back; the
            # logits are the ones after the last of them. The next turn starts with these tokens.
            assert snapshots is not None
            seq = [*prompt_ids, *out.tokens][:pos]
            snap = snapshots.put(seq, self._host_state(pos), logits, save.slot)
            self._keep_resident(snapshots, snap)
            out.snapshot_slot = snap.slot
            self._live = snap
        return out

    def _decode_plain(
        self,
        logits: torch.Tensor,
        pos: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        gate: ThinkingGate | None,
        emit: _Emission,
        top_logprobs: int | None = None,
    ) -> tuple[int, torch.Tensor]:
        """One token a step until the answer ends; returns the final position and logits."""
        greedy_pick: torch.Tensor | None = None
        while True:
            try:
                forced = gate.forced_token() if gate is not None else None
                token_t: torch.Tensor | None
                if forced is None and greedy_pick is not None and sampling.greedy:
                    pick = greedy_pick  # already chosen inside the captured graph
                    # None: the graph feeds its own pick to the next step, with no launch here.
                    assert self.graphs is not None
                    token_t = None if self.graphs.chains(pos) else pick[0].long()
                else:
                    if forced is None:
                        token_t, logprob_t = sample(logits, sampling, generator)
                    else:
                        token_t = torch.tensor(forced, device=logits.device)
                        logprob_t = logits[forced] - torch.logsumexp(logits, dim=0)
                    pick = torch.stack((token_t.double(), logprob_t.double()))
                # The one host sync per step (stop checks and streaming need the token), as
                # one copy: float64 holds every token id exactly.
                token_f, logprob = pick.tolist()
                token = int(token_f)
                # The graph's own pick left `logits` as its output row: the same call works there.
                top = token_logprobs(logits, token, top_logprobs)[1] if top_logprobs is not None else None
            except EngineFailure:
                raise
            except Exception as exc:
                raise _failure(exc, ErrorCode.DECODE_FAILED) from exc
            if emit(token, logprob, top):
                return pos, logits
            try:
                logits, greedy_pick = self._decode(token_t, pos)
            except EngineFailure:
                raise
            except Exception as exc:
                raise _failure(exc, ErrorCode.DECODE_FAILED) from exc
            pos += 1

    def _decode_speculative(
        self,
        mode: str,
        seq: list[int],
        logits: torch.Tensor,
        pos: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        gate: ThinkingGate | None,
        emit: _Emission,
        max_new_tokens: int,
    ) -> tuple[int, torch.Tensor]:
        """Draft, verify in one forward, keep the agreeing prefix (speculative/decode.py)."""
        hooks = rollback_of(self.model)
        assert hooks is not None  # resolve_mode chose a drafter only for a model that rolls back
        drafter: Drafter
        if mode == "draft":
            assert self.draft is not None
            drafter = self.draft
        elif mode == "mtp":
            drafter = MtpDrafter(self.model)
        else:
            drafter = LookupDrafter()

        def plain_step(token: torch.Tensor, at: int) -> torch.Tensor:
            if mode == "mtp":  # eagerly: a captured step does not feed the MTP block
                out = self.model.forward(token.view(1), at, "last")
                assert out is not None
                return out
            return self._decode(token, at)[0]

        graphed = self.graphs is not None and self.graphs.verifies
        curve = GRAPHED_CURVE if graphed else CPU_CURVE  # a graph's verify costs nearly one step
        loop = SpeculativeDecode(
            self.model, hooks, drafter, sampling, generator, gate, emit.out.stats, emit, plain_step,
            max_new_tokens, AdaptiveK(k_max=self.max_draft_tokens, curve=curve),
            self.graphs.verify if self.graphs is not None else None,
        )  # fmt: skip
        try:
            return loop.run(seq, logits, pos)
        except EngineFailure:
            raise
        except Exception as exc:
            if isinstance(drafter, DraftModel):
                drafter.forget()
            raise _failure(exc, ErrorCode.DECODE_FAILED) from exc

    def _host_state(self, length: int) -> dict[str, torch.Tensor]:
        """The model's state for a snapshot; for a CUDA model in page-locked memory, so restoring it
        (the follow-up turn's first step) copies at the bus's speed rather than through a staging
        buffer. Pinning costs one host copy here, after the answer, not before the next one."""
        state = self.model.export_state(length)
        if self.device.type != "cuda":
            return state
        return {k: v.pin_memory() for k, v in state.items()}

    @staticmethod
    def _check_save(
        save: SaveSnapshot | None, snapshots: SnapshotStore | None, prompt_len: int
    ) -> int | None:
        """The prompt position to snapshot at, if any (None also for a save after the answer)."""
        if save is None:
            return None
        if snapshots is None:
            raise EngineFailure(ErrorCode.INVALID_SNAPSHOT_SLOT, "this model keeps no snapshots")
        if save.at is not None and not 1 <= save.at <= prompt_len:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, f"a snapshot position must be in 1..{prompt_len}, got {save.at}"
            )
        return save.at

    def _restore(
        self, prompt: list[int], snapshots: SnapshotStore | None, save_at: int | None
    ) -> tuple[int, torch.Tensor | None]:
        """Continue from the longest snapshot that prefixes the prompt (and does not pass a requested
        snapshot position). Returns the first position to prefill and the snapshot's logits.

        The snapshot saved after the previous answer is, unless something ran since, the model's
        state as it is (export_state of the live state, which import_state would copy back): the
        usual follow-up turn then continues in place, without the restore's copy."""
        live, self._live = self._live, None  # whatever this request runs moves the state on
        if snapshots is None:
            return 0, None
        limit = prompt if save_at is None else prompt[:save_at]
        snap = snapshots.longest_prefix(limit)
        if snap is None:
            return 0, None
        length = len(snap.tokens)
        resident = next((r for r in self._resident if r.snapshot is snap), None)
        # An MTP block's place is reset by each request's track_mtp and put back by import_state.
        with torch.inference_mode():
            if snap is live and not mtp_available(self.model):
                self.model.set_length(length)
            elif resident is not None:
                self.model.import_state(resident.state, length)
            else:
                # From page-locked memory the copies are DMA transfers that need no staging on the host.
                state = {k: v.to(self.device, non_blocking=v.is_pinned()) for k, v in snap.state.items()}
                self.model.import_state(state, length)
        return length, resident.logits.clone() if resident is not None else snap.logits.to(self.device)

    def _keep_resident(self, store: SnapshotStore, snap: Snapshot) -> None:
        """Keep a device copy of `snap` (just put in `store`), dropping the oldest copies, and those
        of snapshots the store no longer holds, to stay within the budget."""
        live = {id(s) for s in store.list()}  # each held by its entry, so no id is reused
        self._resident = [r for r in self._resident if id(r.snapshot) in live]
        nbytes, limit = snap.nbytes, self.resident_snapshot_bytes
        if limit and self.device.type == "cuda":
            limit = min(limit, torch.cuda.mem_get_info(self.device)[0] // 4)
        if nbytes > limit:
            return
        while self._resident and sum(r.snapshot.nbytes for r in self._resident) + nbytes > limit:
            self._resident.pop(0)
        try:
            # From the pinned host copy, asynchronously: the answer is already out.
            state = {k: v.to(self.device, non_blocking=True, copy=True) for k, v in snap.state.items()}
            logits = snap.logits.to(self.device, non_blocking=True, copy=True)
        except torch.OutOfMemoryError:
            return
        self._resident.append(_Resident(snap, state, logits))

    def _prefill(
        self,
        ids: list[int],
        start: int,
        should_cancel: Callable[[], bool],
        split_at: int | None = None,
        at_split: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Prefill ids[start:] in chunks; returns the last position's logits, None when cancelled.
        A chunk also ends at `split_at`, where `at_split` gets the logits of that position."""
        # The load's choice of products holds for this model's prompts only (the switch is the process's).
        products = gguf_cpu.BF16_PREFILL.force(True) if self.bf16_prefill else contextlib.nullcontext()
        with torch.inference_mode(), products:
            try:
                if split_at is None and len(ids) - start <= GRAPHED_SUFFIX_TOKENS:
                    start, logits = self._graphed_prefill(ids, start, should_cancel)
                    if start == len(ids):
                        return logits
                # Only the ids still to prefill: a long conversation's whole list cost ~0.2 ms.
                rest = torch.tensor(ids[start:], dtype=torch.long, device=self.device)
                bounds = sorted(
                    {*range(start, len(ids), self.chunk), len(ids)} | ({split_at} if split_at else set())
                )
                logits = None
                for begin, stop in itertools.pairwise(bounds):
                    if should_cancel():
                        return None
                    # Only the chunk that ends the prompt or a snapshot position computes logits.
                    wanted = stop in (len(ids), split_at)
                    logits = self.model.forward(
                        rest[begin - start : stop - start], begin, "last" if wanted else "none"
                    )
                    if stop == split_at and at_split is not None:
                        assert logits is not None
                        at_split(stop, logits)
            except EngineFailure:
                raise
            except Exception as exc:
                raise _failure(exc, ErrorCode.PREFILL_FAILED) from exc
        return logits

    def _graphed_prefill(
        self, ids: list[int], start: int, should_cancel: Callable[[], bool]
    ) -> tuple[int, torch.Tensor | None]:
        """ids[start:] through the prompt-piece graphs (GraphedDecode.prefill), a piece a replay,
        while there is one; returns the position reached (the rest, if any, is for the
        eager path: cancelled, no graph, or too near the end of the context) and the logits there."""
        if self.graphs is None:
            return start, None
        end = len(ids)
        # From page-locked memory without waiting: a copy from pageable memory would first wait for
        # the device to finish the snapshot's restore, and only then launch the piece.
        tail = torch.tensor(ids[start:], dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
        pos, logits = start, None
        while pos < end and not should_cancel():
            count = min(self.graphs.piece_tokens, end - pos)
            out = self.graphs.prefill(tail[pos - start : pos - start + count], pos)
            if out is None:
                break
            logits = out.clone()  # the graph's buffer is the next piece's
            pos += count
        return pos, logits


class _Emission:
    """Takes each token the decode loop settles on, in order: counts it, lets the thinking budget
    see it, ends the answer on a stop token, at the length limit or on cancel, else keeps and
    streams it. Called as emit(token, logprob) -> True once the answer has ended."""

    def __init__(
        self,
        out: RunOutcome,
        gate: ThinkingGate | None,
        stop_ids: set[int],
        on_token: Callable[[int], None],
        should_cancel: Callable[[], bool],
        max_new_tokens: int,
        started: float,
        scored: list[Scored] | None = None,
    ) -> None:
        self.out = out
        self._scored = scored
        self._gate = gate
        self._stop_ids = stop_ids
        self._on_token = on_token
        self._should_cancel = should_cancel
        self._max_new_tokens = max_new_tokens
        self._started = started
        self.decode_start = 0.0

    def __call__(self, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> bool:
        out, stats = self.out, self.out.stats
        stats.generated_tokens += 1
        if self._gate is not None:
            self._gate.observe(token)
        if stats.generated_tokens == 1:
            self.decode_start = time.perf_counter()
            stats.time_to_first_token_s = self.decode_start - self._started
        if token in self._stop_ids:
            out.finish_reason = FinishReason.STOP
            return True
        out.tokens.append(token)
        out.logprobs.append(logprob)
        if self._scored is not None and top is not None:
            self._scored.append((logprob, top))
        self._on_token(token)
        if stats.generated_tokens >= self._max_new_tokens:
            out.finish_reason = FinishReason.LENGTH
            return True
        if self._should_cancel():
            out.finish_reason = FinishReason.CANCELLED
            return True
        return False


def _failure(exc: Exception, code: ErrorCode) -> EngineFailure:
    if isinstance(exc, torch.OutOfMemoryError):
        return EngineFailure(ErrorCode.OUT_OF_MEMORY, str(exc))
    return EngineFailure(code, f"{type(exc).__name__}: {exc}")
