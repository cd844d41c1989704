"""The model contract every family implements, and what the families share.

The loader, the runtime and the CUDA-graph capture (`graphs.py`) talk to a model only through
`CausalLM`. A family is a package under `models/` with a `build(config, family, dtype, quantized)`
function that returns one (see `registry.py`).

The life of a model:

1. `build(...)` on the meta device: parameters have shapes and dtypes but no memory, so the loader
   can check every tensor against the checkpoint and size the cache before taking any memory.
2. `place(plan)` (optional): spread the layers over several devices (`split.py`).
3. `materialize(device)`: real, uninitialised storage; the loader then copies the checkpoint's
   tensors into the parameters by name (never `Module.to()`: families keep views into fused
   tensors that a copy would break).
4. `finish_loading()`: derive what the weights imply (rope tables, per-layer plans, tied heads).
5. `allocate_cache(context)`, then `forward` (prefill and eager decode) or `decode_graphable` (the
   step a CUDA graph captures), any number of times.

Activations drop the batch dimension (batch is always 1): [T, hidden].
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.models.packed import Projection, projection_of
from ds4desk.engine.split import ShardPlan, check_placement

# What forward returns: nothing (a prefill chunk that ends before the prompt does), the last
# position's logits [V], or every position's [T, V] (teacher-forced scoring, tests).
LogitsMode = Literal["none", "last", "all"]


def load_failure(detail: str) -> EngineFailure:
    """The error a model raises for a config or checkpoint it cannot run."""
    return EngineFailure(ErrorCode.LOAD_FAILED, detail)


def config_int(config: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    """config.json's integer `key` (or `default`), at least `minimum`; LOAD_FAILED otherwise."""
    value = config.get(key, default)
    if value is None:
        raise load_failure(f"config.json has no '{key}'")
    # bool is an int subclass; a `true` here is a broken config, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise load_failure(f"config.json '{key}' must be {kind}, got {value!r}")
    return value


def config_float(
    config: dict[str, Any], key: str, default: float | None = None, positive: bool = True
) -> float:
    """config.json's finite number `key` (or `default`), > 0 when `positive`; LOAD_FAILED otherwise."""
    value = config.get(key, default)
    if value is None:
        raise load_failure(f"config.json has no '{key}'")
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        kind = "a positive number" if positive else "a finite number"
        raise load_failure(f"config.json '{key}' must be {kind}, got {value!r}")
    return float(value)


def hand_over(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What crosses into the next shard of a layer split: a synchronous copy into that shard's own
    tensor, never an alias of one the previous shard may still write."""
    return x.to(device, non_blocking=False, copy=True)


def later_chunk_mask(count: int, end: int, device: torch.device) -> Any:
    """SDPA's mask for queries at end - count .. end - 1 over keys 0 .. end - 1 (a prefill chunk after
    earlier ones). On CUDA torch's lower-right causal bias lets SDPA pick a flash kernel without a
    [T, L] tensor; it is imported here, because importing it imports torch._dynamo (about 1 s of every
    start). Elsewhere SDPA builds that tensor from the bias anyway: the bool mask is the same work and
    gives the same result bit for bit."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(count, end)
    return torch.ones(count, end, dtype=torch.bool, device=device).tril(diagonal=end - count)


class CenteredNorm(nn.Module):
    """Holds an RMSNorm weight stored centred on 0, applied as 1 + weight (Gemma 3, Qwen3.5)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)


class CausalLM(nn.Module, ABC):
    """A decoder with its own preallocated cache; see the module docstring for the call order.

    Subclasses set `config` (with `vocab_size` and `num_layers`), `dtype` and `model` (a backbone
    whose `embed_tokens` is the input embedding and whose `norm` sits on the last shard).
    """

    # decode_graphable is CUDA-graph capturable: no host syncs, shapes fixed by the span.
    supports_graphs: ClassVar[bool] = True

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self._context = 0
        self._split: ShardPlan | None = None  # None: every layer on one device
        # A tied head on another device than the embedding (a split): the last shard's own copy.
        self._tied_head: torch.Tensor | None = None
        self.lm_head: nn.Module | None = None  # None: tied to the embedding

    # --- what the model is ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context(self) -> int:
        """Positions the allocated cache holds (0 when none is allocated)."""
        return self._context

    @property
    def device(self) -> torch.device:
        """The first shard's device: where the embedding is (every layer's, unsplit)."""
        return self.model.embed_tokens.weight.device

    @property
    def split(self) -> ShardPlan | None:
        """The layer split set by place(); None: every layer on `device`."""
        return self._split

    # --- loading -------------------------------------------------------------------------------

    def place(self, plan: ShardPlan) -> None:
        """Split the layers over the plan's devices; before materialize (which then ignores its
        device): layer i's weights and cache go to its shard's device, the embedding to the first,
        everything after the last layer to the last."""
        check_placement(plan, self.config.num_layers, self.parameters())
        self._split = plan

    @abstractmethod
    def materialize(self, device: torch.device) -> None:
        """Give every parameter real (uninitialised) storage on `device` (or where the split puts it)."""

    @abstractmethod
    def finish_loading(self) -> None:
        """After the weights are in: derive what they imply; calls `copy_tied_head`."""

    def head_weight(self) -> torch.Tensor:
        """The output projection [V, hidden] on the last shard's device."""
        if self._tied_head is not None:
            return self._tied_head
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head_projection(self) -> Projection:
        """The output projection as a layer calls it (models/packed.py), on the last shard's device."""
        module = self.model.embed_tokens if self.lm_head is None else self.lm_head
        projection = projection_of(module)
        if self._tied_head is None:
            return projection
        if projection.packed is not None:
            return replace(projection, packed=self._tied_head)
        return replace(projection, weight_t=self._tied_head.t())

    def copy_tied_head(self) -> None:
        """A tied head whose embedding is on another device (a split) gets a copy on the last shard."""
        self._tied_head = None
        if self.lm_head is None and self.model.norm.weight.device != self.device:
            self._tied_head = self.model.embed_tokens.weight.to(self.model.norm.weight.device, copy=True)

    # --- cache ---------------------------------------------------------------------------------

    @abstractmethod
    def allocate_cache(self, context: int) -> None:
        """Allocate the cache for `context` positions (replacing any old one)."""

    @abstractmethod
    def free_cache(self) -> None: ...

    @abstractmethod
    def cache_bytes(self) -> int:
        """What the allocated cache takes."""

    def cache_bytes_for(self, context: int) -> int:
        """What allocate_cache(context) will take, before taking it."""
        return sum(self.layer_cache_bytes_for(context))

    @abstractmethod
    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """cache_bytes_for per layer (a split plan places each with its layer)."""

    @abstractmethod
    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """Everything positions 0..length-1 left behind, as host tensors (a snapshot's payload)."""

    @abstractmethod
    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state; afterwards the model continues at `length`."""

    # --- running -------------------------------------------------------------------------------

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, writing their cache entries.
        Returns float32 logits: [V] for "last", [T, V] for "all", None for "none"."""

    def check_positions(self, start_pos: int, count: int) -> None:
        """CONTEXT_OVERFLOW unless positions start_pos..start_pos+count-1 fit the cache."""
        end = start_pos + count
        if start_pos < 0 or count == 0 or end > self._context:
            raise EngineFailure(
                ErrorCode.CONTEXT_OVERFLOW,
                f"positions {start_pos}..{end - 1} do not fit a context of {self._context}",
            )

    def logits_from(self, normed: torch.Tensor, mode: LogitsMode, like: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states [T, hidden] (already normed; one row for "last"), as
        float32 on `like`'s device (a split computes them on its last shard)."""
        out = self.head_projection()(normed).float()
        if out.device != like.device:
            out = out.to(like.device)
        return out[0] if mode == "last" else out

    def decode_graphable(self, token: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One decode step whose shapes depend on `span` only, so a CUDA graph can replay it.

        `token` and `pos` are int64 [1] device tensors (the graph's inputs); attention reads at most
        the first `span` cache positions (pos < span <= context). Writes the position's cache
        entries as forward(token, pos, "last") does and returns float32 logits [V]."""
        carry: tuple[torch.Tensor, ...] = (token, pos)
        for index, device in enumerate(self.decode_devices()):
            if index:
                carry = tuple(hand_over(t, device) for t in carry)
            carry = self.decode_shard(index, carry, span)
        logits = carry[0]
        return logits if logits.device == token.device else logits.to(token.device)

    def verify_graphable(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor | None:
        """A speculative verify step whose shapes depend on `span` and len(tokens) only, so a CUDA
        graph can replay it: tokens (int64 [T] on the device) at positions pos..pos+T-1 (`pos`: int64
        [1]), attention over the first `span` cache positions (pos + T <= span). Writes the cache
        entries as forward(tokens, pos, "all") does and returns float32 logits [T, V]. None: this
        model (or its split) has no such step, and verifies run eagerly through forward."""
        return None

    @property
    def has_graphable_verify(self) -> bool:
        """Whether this family defines verify_graphable (it may still decline a given split)."""
        return type(self).verify_graphable is not CausalLM.verify_graphable

    def verify_replayed(self, count: int, span: int) -> None:
        """After a replay of the verify graph of `count` tokens and `span`: what a family's roll-back
        needs from it that its eager verify would have handed over on the host."""

    # The tokens of a prompt-piece graph (prefill_graphable), shorter pieces padded up to it. A piece
    # costs about a read of the weights whatever its length, so longer ones mean fewer replays, as
    # long as what a piece's attention holds at once stays small.
    prefill_piece_tokens = 16

    def prefill_graphable(
        self, tokens: torch.Tensor, pos: torch.Tensor, count: torch.Tensor, span: int
    ) -> torch.Tensor | None:
        """A prompt piece as a step a CUDA graph can replay (a follow-up's short suffix): tokens
        (int64 [T] on the device) at positions pos.., of which the first `count` (int64 [1]) are the
        prompt's and the rest padding that must leave nothing a later position reads (a cache row
        per position, masked by position, is never read before decode writes it again). Writes the
        state as forward(tokens[:count], pos, "last") does and returns its float32 logits [V].
        None: this model (or its split) has no such step."""
        return None

    def prefill_row_buckets(self, chunk: int) -> list[int]:
        """The row counts this model pads its prefill chunks of up to `chunk` tokens to (none past
        its context), for the load's warm-up to run each once; empty when it runs them as they come."""
        return []

    @abstractmethod
    def decode_devices(self) -> list[torch.device]:
        """The device of every shard a decode step runs through, in order (one when unsplit)."""

    @abstractmethod
    def decode_shard(
        self, index: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `index`'s part of decode_graphable, all on its own device (so each shard can be a
        graph of its own): the first takes (token, pos), every later one what the previous one
        returned, copied to its device; the last returns (logits,)."""

    def set_length(self, length: int) -> None:
        """After decode_graphable steps (whose position is a device value): the cache now holds
        positions 0..length-1. A family that tracks its length on the host overrides this."""
