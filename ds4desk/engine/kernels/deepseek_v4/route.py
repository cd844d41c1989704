"""DeepSeek-V4's router for one decode token and its expert mix (any token count), one kernel each.

Eagerly the router is ~10 small kernels (softplus, sqrt, the bias, top-k or the hash table's row,
gather, sum, divide, scale) and mixing the picked experts' outputs three more (matmul, cast, add),
in every layer of a step that runs at batch 1 inside a CUDA graph, where each kernel costs a few
microseconds however little it does. `route` does the router in one program (the expert count is a
few hundred at most: top-k is k arg-max passes over a register-resident row), `mix` sums the picks
weighted into one row. Elsewhere (CPU, ROCm, no Triton) the same math runs eagerly.

`route` can also copy the token's row x into the order in which the experts' kernel reads it
(gguf_experts.experts_input): the router's one program does it in passing, where a separate gather
was a kernel of its own in every layer of the step.

The fused path goes through torch custom ops, so an op counter (bench/count_ops.py) sees one op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, nvidia, on_its_device, pdl

# Default: the kernels where they run (NVIDIA CUDA tensors, Triton importable). Forced on: always
# through the custom ops (on the CPU their bodies are the eager math); off: the eager math.
SWITCH = Switch(
    "deepseek_v4.route",
    "DeepSeek-V4's decode router and expert mix, one kernel each",
    lambda where: nvidia(where) and _kernels() is not None,
)


def reference_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    token: torch.Tensor,
    k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [1, E] (the gate's, model dtype) -> (picked experts int64 [k], float32 weights [k]).
    Scores are sqrt(softplus(logits)); a hash-routed layer picks its `table` row of `token`, a
    score-routed one the top k of scores + bias; the picks' scores, normalised, times `scale`."""
    scores = F.softplus(logits.float()).sqrt()
    if table is not None:
        chosen = table.index_select(0, token)
    else:
        assert bias is not None
        chosen = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return chosen.view(-1), weights.view(-1)


def reference_reorder(x: torch.Tensor, order: torch.Tensor, x_read: torch.Tensor) -> None:
    """x_read [1, D] = x [1, D] with its columns taken in `order` (int64 [D])."""
    x_read.copy_(x.reshape(-1).index_select(0, order).view_as(x_read))


def reference_mix(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row t: Σ_i weights[t, i] y[t k + i] for float32 weights [T, k] (or [k]: T = 1) and y [T k, D],
    [T, D] in y's dtype (summed in float32, rounded once)."""
    rows = weights.view(-1, weights.shape[-1])
    count, picks = rows.shape
    return torch.bmm(rows.unsqueeze(1), y.view(count, picks, -1).float()).squeeze(1).to(y.dtype)


@torch.library.custom_op("ds4desk::v4_route", mutates_args=("x_read",))
def _route_op(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    token: torch.Tensor,
    k: int,
    scale: float,
    x: torch.Tensor | None,
    order: torch.Tensor | None,
    x_read: torch.Tensor | None,  # no default: a dispatcher drops trailing defaults, then cannot find it
) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _kernels() if SWITCH.kernel_runs_on(logits) else None
    if kernels is None:
        chosen, weights = _eager_route(logits, bias, table, token, k, scale, x, order, x_read)
        return chosen.contiguous(), weights.contiguous()
    return kernels.route(logits, bias, table, token, k, scale, x, order, x_read)


def _eager_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    token: torch.Tensor,
    k: int,
    scale: float,
    x: torch.Tensor | None,
    order: torch.Tensor | None,
    x_read: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_route, and reference_reorder where x_read is given."""
    if x_read is not None:
        assert x is not None and order is not None
        reference_reorder(x, order, x_read)
    return reference_route(logits, bias, table, token, k, scale)


@_route_op.register_fake
def _(logits, bias, table, token, k, scale, x, order, x_read):
    return logits.new_empty((k,), dtype=torch.int64), logits.new_empty((k,), dtype=torch.float32)


@torch.library.custom_op("ds4desk::v4_mix", mutates_args=())
def _mix_op(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    kernels = _kernels() if SWITCH.kernel_runs_on(y) else None
    if kernels is None:
        return reference_mix(weights, y)
    return kernels.mix(weights, y)


@_mix_op.register_fake
def _(weights, y):
    return y.new_empty((y.shape[0] // weights.shape[-1], y.shape[1]))


def enabled(where: Where) -> bool:
    """Whether route and mix run the kernels for tensors on `where` (see SWITCH)."""
    return SWITCH.on(where)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    token: torch.Tensor,
    k: int,
    scale: float,
    reorder: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference_route; one kernel where it can be (see SWITCH). reorder (x, order, x_read):
    also fill x_read [1, D] with x [1, D] (both contiguous) taken in `order` (int64 [D])."""
    x = order = x_read = None
    if reorder is not None:
        x, order, x_read = reorder
        if x.shape != x_read.shape or x.shape[0] != 1 or order.shape != (x.shape[1],):
            raise ValueError(
                f"reorder: x {tuple(x.shape)}, order {tuple(order.shape)}, x_read {tuple(x_read.shape)}"
            )
        if not (x.is_contiguous() and x_read.is_contiguous() and order.dtype == torch.int64):
            raise ValueError("reorder needs contiguous rows and an int64 order")
    if enabled(logits):
        return _route_op(logits.contiguous(), bias, table, token, k, scale, x, order, x_read)
    return _eager_route(logits, bias, table, token, k, scale, x, order, x_read)


def mix(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """See reference_mix; one kernel where it can be (see SWITCH). Prefill's rows too: no float32
    copy of the [T k, D] expert outputs."""
    if enabled(y):
        return _mix_op(weights.contiguous(), y.contiguous())
    return reference_mix(weights, y)


@dataclass(slots=True)
class _Kernels:
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    mix: Callable[..., torch.Tensor]


@functools.cache
def _kernels() -> _Kernels | None:
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the eager form runs
        return None

    @triton.jit
    def route_kernel(
        logits,
        bias,
        table,
        token_ptr,
        chosen_out,
        weights_out,
        experts,
        scale,
        x,
        order,
        x_read,
        K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        HASHED: tl.constexpr,
        PDL: tl.constexpr,
        X_COLS: tl.constexpr,  # 0: no reorder
        BLOCK_X: tl.constexpr = 1024,
    ):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if X_COLS > 0:  # x's columns in the experts kernel's read order (a few thousand values)
            for start in range(0, X_COLS, BLOCK_X):
                c = start + tl.arange(0, BLOCK_X)
                inside = c < X_COLS
                source = tl.load(order + c, mask=inside, other=0)
                tl.store(x_read + c, tl.load(x + source, mask=inside), mask=inside)
        e = tl.arange(0, BLOCK_E)
        live = e < experts
        z = tl.load(logits + e, mask=live, other=0.0).to(tl.float32)
        softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's threshold
        scores = tl.sqrt(softplus)
        slot = tl.arange(0, BLOCK_K)
        valid = slot < K
        if HASHED:
            token = tl.load(token_ptr)
            chosen = tl.load(table + token * K + slot, mask=valid, other=0)
            picked = e[None, :] == chosen[:, None]
            weights = tl.sum(tl.where(picked, scores[None, :], 0.0), axis=1)
        else:
            ranked = tl.where(live, scores + tl.load(bias + e, mask=live, other=0.0), float("-inf"))
            chosen = tl.zeros((BLOCK_K,), dtype=tl.int64)
            weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for i in range(K):  # k arg-max passes: the highest first, as topk orders them
                best = tl.argmax(ranked, axis=0)
                chosen = tl.where(slot == i, best, chosen)
                weights = tl.where(slot == i, tl.sum(tl.where(e == best, scores, 0.0), axis=0), weights)
                ranked = tl.where(e == best, float("-inf"), ranked)
        weights = tl.where(valid, weights, 0.0)
        weights = weights / (tl.sum(weights, axis=0) + 1e-20) * scale
        tl.store(chosen_out + slot, chosen.to(tl.int64), mask=valid)
        tl.store(weights_out + slot, weights, mask=valid)

    @triton.jit
    def mix_kernel(weights, y, out, D, PICKS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)  # tokens on axis 0: a prefill chunk may exceed axis 1's 65,535
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = d < D
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(PICKS):
            w = tl.load(weights + t * PICKS + i)
            acc += w * tl.load(y + (t * PICKS + i) * D + d, mask=live, other=0.0).to(tl.float32)
        tl.store(out + t * D + d, acc.to(out.dtype.element_ty), mask=live)

    def route(
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        table: torch.Tensor | None,
        token: torch.Tensor,
        k: int,
        scale: float,
        x: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
        x_read: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        experts = logits.shape[-1]
        chosen = torch.empty((k,), device=logits.device, dtype=torch.int64)
        weights = torch.empty((k,), device=logits.device, dtype=torch.float32)
        use_pdl = pdl(logits)
        route_kernel[(1,)](
            logits,
            bias if bias is not None else logits,
            table if table is not None else chosen,
            token,
            chosen,
            weights,
            experts,
            scale,
            x if x is not None else logits,
            order if order is not None else chosen,
            x_read if x_read is not None else logits,
            K=k,
            BLOCK_K=triton.next_power_of_2(k),
            BLOCK_E=max(16, triton.next_power_of_2(experts)),
            HASHED=table is not None,
            PDL=use_pdl,
            X_COLS=0 if x is None else x.shape[1],
            launch_pdl=use_pdl,
        )
        return chosen, weights

    def mix(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        picks, width = weights.shape[-1], y.shape[1]
        count = y.shape[0] // picks
        out = y.new_empty((count, width))
        block = 1024
        use_pdl = pdl(y)
        mix_kernel[(count, triton.cdiv(width, block))](
            weights, y, out, width, PICKS=picks, BLOCK=block, PDL=use_pdl, launch_pdl=use_pdl
        )
        return out

    return _Kernels(on_its_device(route), on_its_device(mix))
