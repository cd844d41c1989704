"""Decode steps replayed from captured CUDA graphs.

A decode step at batch 1 is a few hundred small kernels; launched one by one from Python, the GPU
idles between them. Captured once, a step is one `replay()`. The graph's inputs are two static
device tensors (the token and its position) and its output is one static logits buffer; the
model's cache tensors are captured by address, so the model must keep them in place
(import_state copies into them, and a new cache means a new Runtime and new graphs).

Attention spans are bucketed (256, 512, 1024, ... up to the context): a step at position p
replays the graph of the smallest span above p, so a short chat does not pay for reading the
whole cache. All buckets are captured up front, because capturing executes a warm-up step that
writes the cache; before any request that is harmless (every request prefills from position 0 or
imports a snapshot, and attention never reads rows the request did not write).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds4desk.engine.models.base import CausalLM

log = logging.getLogger(__name__)

SMALLEST_SPAN = 256
# The most tokens one graphed verify step takes: the drafts of speculative/adaptive.DEFAULT_MAX_K and
# the token before them, with room for a larger --max-draft-tokens.
MAX_VERIFY_TOKENS = 16


def graphs_wanted(setting: bool | None, device: torch.device, model: CausalLM) -> bool:
    """None (the default) means on for CUDA and off for HIP, whose graphs are less proven. A split
    over several GPUs is captured shard by shard (a graph runs on one device's stream), which every
    model can do: decode_shard is part of the contract."""
    if device.type != "cuda" or not model.supports_graphs:
        return False
    if setting is None:
        return torch.version.hip is None
    return setting


def span_buckets(context: int) -> list[int]:
    spans = []
    span = SMALLEST_SPAN
    while span < context:
        spans.append(span)
        span *= 2
    spans.append(context)
    return spans


@dataclass(slots=True)
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # one per shard, replayed in order
    outputs: list[tuple[torch.Tensor, ...]]  # each graph's output buffers, overwritten by every replay
    greedy: torch.Tensor  # float64 [2]: the argmax token and its logprob, picked inside the last graph


class GraphedDecode:
    """Owns the graphs of one model's cache; `step` is a drop-in for forward(token, pos, "last").

    A model split over several GPUs gets a graph per shard (`decode_shard`) and span: a graph is
    captured on one device's stream. Between replays the previous shard's outputs are
    copied into the next one's static inputs; copies between devices are ordered after the source
    device's stream and before the destination's, so no shard reads a buffer still being written."""

    def __init__(
        self, model: CausalLM, device: torch.device, on_captured: Callable[[], None] | None = None
    ) -> None:
        """`on_captured` runs after each span's capture (the load's progress; it may raise to stop)."""
        self.model = model
        self.device = device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.spans = span_buckets(model.context)
        split = model.split
        self.devices = list(model.decode_devices()) if split is not None and split.multi_device else [device]
        # Static inputs per shard: the first reads (token, pos); later ones are sized at capture.
        self._inputs: list[tuple[torch.Tensor, ...]] = [(self.token, self.pos)]
        self._pools = {d: torch.cuda.graph_pool_handle() for d in self.devices}
        # One side stream per device for every capture: cuBLAS keeps a workspace per stream.
        self._streams = {d: torch.cuda.Stream(d) for d in self.devices}
        # One device: each replay ends by writing its greedy pick into `token` and pos + 1 into
        # `pos`, so a greedy step launches nothing but the replay. (A split's pick is on another
        # GPU than `token`; a graph captured on one device does not copy to another.)
        self._chained = len(self.devices) == 1
        self._captured: list[_Captured] = []
        # Verify steps of speculative decoding (one device only), captured on first use per
        # (tokens, span) in a pool of their own: their outputs never alias a decode graph's buffers.
        self._verifies = len(self.devices) == 1
        self._verify_tokens = torch.zeros(MAX_VERIFY_TOKENS, dtype=torch.long, device=device)
        self._verify_pos = torch.zeros(1, dtype=torch.long, device=device)
        self._verify_pool = torch.cuda.graph_pool_handle() if self._verifies else None
        self._verify_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Prompt pieces (`prefill`): the model's prefill_piece_tokens, `count` of them real, one
        # graph a span, captured here with the decode steps, in the verify pool.
        self.piece_tokens = model.prefill_piece_tokens
        self._piece_tokens = torch.zeros(self.piece_tokens, dtype=torch.long, device=device)
        self._piece_count = torch.zeros(1, dtype=torch.long, device=device)
        self._piece_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pieces = self._verifies
        with torch.inference_mode():
            for span in self.spans:
                self._captured.append(self._capture(span))
                if pieces and span >= self.piece_tokens:
                    pieces = self._capture_piece(span)
                if on_captured is not None:
                    on_captured()
        self._next_pos: int | None = None  # what `pos` holds on the device after the last replay

    def step(self, token: torch.Tensor | None, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `token` (a tensor of one element on any device) at position `pos`; None: the greedy
        pick of the previous step, at the position after it (see `chains`). Returns float32 logits
        [V] (on the last shard's device) and the greedy pick (float64 [2]: token, logprob), in
        buffers the next step overwrites."""
        if token is not None:
            self.token.copy_(token.view(1))
        elif not self.chains(pos):
            raise RuntimeError(f"no greedy pick from the step before position {pos} to chain from")
        if self._next_pos != pos:
            self.pos.fill_(pos)
        captured = self._captured[bisect.bisect_right(self.spans, pos)]
        last = len(self.devices) - 1
        for shard, (graph, device) in enumerate(zip(captured.graphs, self.devices, strict=True)):
            with torch.cuda.device(device):
                graph.replay()
            if shard < last:
                for dst, src in zip(self._inputs[shard + 1], captured.outputs[shard], strict=True):
                    dst.copy_(src)
        self._next_pos = pos + 1 if self._chained else None
        self.model.set_length(pos + 1)  # a model that tracks its length on the host learns it here
        # On the last shard's device: sampling runs wherever the logits are, and a greedy step
        # reads only the pick, so no step copies the vocabulary's logits between GPUs.
        return captured.outputs[-1][0], captured.greedy

    def chains(self, pos: int) -> bool:
        """Whether step(None, pos) may run: the last replay was at pos - 1 and left its pick in place."""
        return self._chained and self._next_pos == pos

    @property
    def verifies(self) -> bool:
        """Whether verify steps replay graphs: one device and a model with a graphable verify (until
        its first capture, where the model may still decline)."""
        return self._verifies and self.model.has_graphable_verify

    def verify(self, tokens: torch.Tensor, pos: int) -> torch.Tensor | None:
        """Logits [T, V] after each of `tokens` (int64 [T] on the device) fed at pos..pos+T-1, from
        the graph of (T, the smallest span that holds them), in a buffer the next verify of that
        size overwrites; None where the model has no graphable verify (then forward runs it).

        A (T, span) seen for the first time is captured here, inside the request: the eager run that
        precedes a capture feeds these very tokens at these positions, and its logits are this
        call's (the capture itself runs nothing; a replay now would feed the tokens a second time,
        which DeepSeek-V4's compressor carries do not absorb)."""
        count = tokens.shape[0]
        if not self._verifies or not 1 <= count <= MAX_VERIFY_TOKENS:
            return None
        span = self.spans[bisect.bisect_left(self.spans, pos + count)]
        self._verify_tokens[:count].copy_(tokens)
        self._verify_pos.fill_(pos)
        captured = self._verify_graphs.get((count, span))
        if captured is None:
            logits = self._capture_verify(count, span)
            if logits is None:
                self._verifies = False
                return None
        else:
            graph, logits = captured
            graph.replay()
            self.model.verify_replayed(count, span)
        self._next_pos = None  # `token` and `pos` no longer hold the decode chain's next input
        self.model.set_length(pos + count)
        return logits

    def prefill(self, tokens: torch.Tensor, pos: int) -> torch.Tensor | None:
        """Logits [V] after the last of `tokens` (int64 [1..piece_tokens] on the device) fed at pos..,
        from the span's prompt-piece graph (the piece padded to piece_tokens; the model ignores the
        padding), in a buffer the next piece overwrites; None where there is no such graph (the
        model has none, or the padded piece would pass the context): then forward runs it."""
        count, size = tokens.shape[0], self.piece_tokens
        if not 1 <= count <= size or pos + size > self.spans[-1]:
            return None
        captured = self._piece_graphs.get(self.spans[bisect.bisect_left(self.spans, pos + size)])
        if captured is None:
            return None
        self._piece_tokens[:count].copy_(tokens)
        self._verify_pos.fill_(pos)
        self._piece_count.fill_(count)
        graph, logits = captured
        graph.replay()
        self._next_pos = None
        self.model.set_length(pos + count)
        return logits

    def close(self) -> None:
        self._captured.clear()
        self._verify_graphs.clear()
        self._piece_graphs.clear()

    def _capture_piece(self, span: int) -> bool:
        """The prompt-piece graph of `span`; False where the model has none. Its warm-up run and the
        capture feed the (zero) static tokens at position 0, before any request."""
        tokens = self._piece_tokens
        self._verify_pos.zero_()
        self._piece_count.fill_(self.piece_tokens)
        side = self._streams[self.device]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            if self.model.prefill_graphable(tokens, self._verify_pos, self._piece_count, span) is None:
                return False
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._verify_pool, stream=side):
            logits = self.model.prefill_graphable(tokens, self._verify_pos, self._piece_count, span)
        assert logits is not None
        self._piece_graphs[span] = (graph, logits)
        return True

    def _capture_verify(self, count: int, span: int) -> torch.Tensor | None:
        """Run the verify of (count, span) eagerly, then capture its graph; the eager logits, or
        None where the model has no graphable verify."""
        tokens = self._verify_tokens[:count]
        current = torch.cuda.current_stream(self.device)
        side = self._streams[self.device]
        side.wait_stream(current)
        with torch.inference_mode(), torch.cuda.stream(side):
            first = self.model.verify_graphable(tokens, self._verify_pos, span)
            if first is None:
                return None
        current.wait_stream(side)
        first.record_stream(current)  # made on the side stream, read on this one
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._verify_pool, stream=side):
            logits = self.model.verify_graphable(tokens, self._verify_pos, span)
        assert logits is not None
        self._verify_graphs[(count, span)] = (graph, logits)
        return first

    def _run(self, shard: int, span: int) -> tuple[torch.Tensor, ...]:
        if len(self.devices) == 1:
            return (self.model.decode_graphable(self.token, self.pos, span),)
        return self.model.decode_shard(shard, self._inputs[shard], span)

    def _capture(self, span: int) -> _Captured:
        self.pos.fill_(span - 1)
        graphs, outputs = [], []
        greedy = torch.empty(0)
        for shard, device in enumerate(self.devices):
            with torch.cuda.device(device):
                # cuBLAS and friends allocate workspaces on first use; that must happen outside capture.
                side = self._streams[device]
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._run(shard, span)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pools[device], stream=side):
                    out = self._run(shard, span)
                    if shard == len(self.devices) - 1:
                        # Greedy decoding then needs no launches of its own between steps: one small
                        # copy. (max, not logits[best]: indexing with a tensor reads it on the host.)
                        logits = out[0]
                        top, best = logits.max(0)
                        greedy = torch.stack((best.double(), (top - torch.logsumexp(logits, 0)).double()))
                        if self._chained:
                            self.token.copy_(best.view(1))
                            self.pos.add_(1)
            graphs.append(graph)
            outputs.append(out)
            if shard + 1 < len(self.devices) and len(self._inputs) == shard + 1:
                following = self.devices[shard + 1]
                self._inputs.append(tuple(torch.zeros_like(t, device=following) for t in out))
        return _Captured(graphs, outputs, greedy)
