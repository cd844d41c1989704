"""DeepSeek-V4's FFN: every layer is a mixture of experts plus one shared expert.

The router scores experts by sqrt(softplus(x · W)); the first layers route by a token-id table
(hash routing), the rest pick the top `experts_per_token` by score plus a correction bias that
chooses but never weighs. The picked experts' weights are renormalised and scaled by
`routed_scaling_factor`; each expert is a SwiGLU with its inputs clamped to `swiglu_limit`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.deepseek_v4 import route as v4_route
from ds4desk.engine.kernels.dense import gemv as decode_kernels
from ds4desk.engine.kernels.quant import gguf_experts, gguf_triton
from ds4desk.engine.kernels.quant.fp4 import fp4_experts_gemv, fp4_grouped_matmul
from ds4desk.engine.kernels.quant.fp8 import fp8_row_, fp8_row_fits
from ds4desk.engine.kernels.quant.gguf_matmul import gguf_matmul
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.modules import Experts, Moe, SharedExpert
from ds4desk.engine.models.row_buckets import FEW_ROWS, prefill_rows


def _times(x: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """x @ Wᵀ for one GGUF-layout expert weight: float, or its GGUF blocks (never dequantized whole)."""
    if type_id < 0:
        return x @ weight.t()
    return gguf_matmul(x, weight, type_id, cols)


def gguf_expert(
    experts: Experts, weights: tuple[torch.Tensor, ...], x: torch.Tensor, limit: float
) -> torch.Tensor:
    """One GGUF-layout expert's clamped SwiGLU of x [T, D]: `weights` its (gate, up, down)."""
    types, hidden = experts.type_ids, x.shape[1]
    gate, up, down = weights
    width = gate.shape[0]
    act = ops.swiglu(
        _times(x, gate, types["gate_proj"], hidden), _times(x, up, types["up_proj"], hidden), limit
    )
    return _times(act, down, types["down_proj"], width)


def _on_gguf_kernels(experts: Experts, x: torch.Tensor) -> bool:
    """Whether gguf_triton's kernels take every projection of a GGUF layout's experts for x's device
    and dtype (rows then read their picked experts in place by id: experts_gemv)."""
    return gguf_triton.enabled(x) and all(gguf_triton.covers(t, x.dtype) for t in experts.type_ids.values())


# (token, slot) pairs up to which a prefill chunk reads each pair's expert in place by id, as the
# decode step does: on an H200 experts_gemv reads an expert's projection in about 5 us (6 picked:
# 29.6 us for Q2_K gate / up, 33.3 us for Q3_K down; bench/gguf_experts_gemv.py), where
# dequantizing a whole projection's stack of 256 took about 1.8 ms, break-even near 350 pairs.
BY_ID_MAX_PAIRS = 256


def _gguf_experts_by_id(
    experts: Experts, x: torch.Tensor, chosen: torch.Tensor, limit: float, gate_in: torch.Tensor | None = None
) -> torch.Tensor:
    """Each (token, slot) pair's clamped SwiGLU through its expert, [T k, D] in (token, slot) order,
    for x [T, D] and the experts chosen [T, k]: the blocks read in place by id (experts_gemv, no copy,
    no host read), the same kernels whatever T: gate and up as one kernel with the SwiGLU folded in
    where gguf_experts.swiglu_fits, then down. gate_in: the gate's input as experts_input gives it,
    where the caller made it already (the decode router does)."""
    k = chosen.shape[1]
    ids = chosen.reshape(-1).long()
    pairs, hidden, width = ids.shape[0], x.shape[1], experts.gate_proj.shape[1]
    inputs = x if x.shape[0] == 1 else x.repeat_interleave(k, dim=0)  # one row for all, or a row a pair
    types = experts.type_ids
    # The input as the experts' kernel reads it, prepared once for gate and up where their types agree.
    if gate_in is None:
        gate_in = gguf_experts.experts_input(inputs, types["gate_proj"], hidden)
    out = x.new_empty((pairs, hidden))
    if gguf_experts.swiglu_fits(types["gate_proj"], types["up_proj"], hidden, x):
        act = x.new_empty((pairs, width))
        at = gguf_experts.write_order(width, types["down_proj"], x.device)  # where down reads
        gate_up = (experts.gate_proj, experts.up_proj)
        gguf_experts.experts_swiglu(gate_in, ids, *gate_up, types["gate_proj"], hidden, limit, act, at)
        return gguf_experts.experts_gemv(
            act, ids, experts.down_proj, types["down_proj"], width, out, ordered=True
        )
    same = types["up_proj"] == types["gate_proj"]
    up_in = gate_in if same else gguf_experts.experts_input(inputs, types["up_proj"], hidden)
    gate, up = x.new_empty((pairs, width)), x.new_empty((pairs, width))
    gguf_experts.experts_gemv(gate_in, ids, experts.gate_proj, types["gate_proj"], hidden, gate, ordered=True)
    gguf_experts.experts_gemv(up_in, ids, experts.up_proj, types["up_proj"], hidden, up, ordered=True)
    act = ops.swiglu(gate, up, limit)
    return gguf_experts.experts_gemv(act, ids, experts.down_proj, types["down_proj"], width, out)


# The share of a layer's experts a prefill chunk must reach for the grouped GEMM on whole
# dequantized projections (below it, the chunk loops over its experts). On an H200 with Flash's
# shapes (bench/flash_one_gpu.py --grouped-share) an 8k prompt took 2,053-2,078 ms to its first
# token at 1/3, 1,834 ms at 1/16 and 1,836 ms at 0: for the chunks that reach between 1/16 and 1/3
# of 256 experts, the loop (three dequantize + matmul pairs an expert) cost more than dequantizing
# all of them.
GROUPED_MIN_SHARE = 1 / 16


def _grouped_on_whole(experts: Experts, x: torch.Tensor, sizes: list[int]) -> bool:
    """Whether a prefill chunk's GGUF experts run as grouped GEMMs on each projection dequantized
    whole: on the GGUF kernels, where torch's grouped GEMM takes x (bf16 on a GPU from Hopper on,
    the GPUs its CUTLASS kernel is built for; any float on the CPU), and when the chunk reaches
    GROUPED_MIN_SHARE of the experts."""
    takes_dtype = not x.is_cuda or (
        x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )
    active = sum(1 for size in sizes if size)
    return takes_dtype and active >= GROUPED_MIN_SHARE * len(sizes) and _on_gguf_kernels(experts, x)


# Values dequantized in one launch: keeps the kernel's int32 offsets (row x stride) in range.
_DEQUANTIZE_VALUES = 1 << 30


def _gguf_experts_grouped(
    experts: Experts, inputs: torch.Tensor, ends: torch.Tensor, limit: float
) -> torch.Tensor:
    """The clamped SwiGLU of each expert's rows of `inputs` [P, D] (sorted by expert, expert e's
    rows ending at ends[e], int32 on the device): each projection's stacked blocks dequantized whole
    into one scratch of the inputs' dtype (reused by the next projection), then one grouped GEMM,
    instead of three launches a routed expert and a host loop over them."""
    count, width, hidden = experts.gate_proj.shape[0], experts.gate_proj.shape[1], inputs.shape[1]
    scratch = inputs.new_empty(count * width * hidden)  # every projection holds E x I x D values

    def times(x: torch.Tensor, name: str, cols: int) -> torch.Tensor:
        stacked = getattr(experts, name)
        rows = stacked.shape[1]
        whole = scratch.view(count, rows, cols)
        step = max(1, _DEQUANTIZE_VALUES // (rows * cols))
        for first in range(0, count, step):
            last = min(count, first + step)
            flat = stacked[first:last].reshape(-1, stacked.shape[2])
            gguf_triton.dequantize_into(flat, experts.type_ids[name], cols, whole[first:last].view(-1, cols))
        return torch._grouped_mm(x, whole.transpose(1, 2), offs=ends)

    act = ops.swiglu(times(inputs, "gate_proj", hidden), times(inputs, "up_proj", hidden), limit)
    return times(act, "down_proj", width)


class MixtureOfExperts:
    """DeepseekV4Model's MoE methods (a mixin): `_moe` for a prefill chunk, `_decode_moe` for the
    graphable decode step."""

    config: DeepseekV4Config
    # Graphable MoE: None picks by cost (see _decode_moe); True / False force all experts / a gather.
    graph_dense_moe: bool | None = None

    def _route(self, moe: Moe, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts and their weights, float32: [T, k] each (no host read)."""
        cfg = self.config
        gate = moe.gate
        scores = F.softplus(ops.product(x, lambda rows: rows @ gate.weight.t()).float()).sqrt()  # [T, E]
        tid2eid = getattr(gate, "tid2eid", None)
        if tid2eid is not None:
            chosen = tid2eid[ids]
        else:
            chosen = (scores + gate.e_score_correction_bias).topk(cfg.experts_per_token, dim=-1).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor

    def _moe(self, moe: Moe, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        chosen, weights = self._route(moe, x, ids)
        experts, limit = moe.experts, cfg.swiglu_limit
        if chosen.numel() <= BY_ID_MAX_PAIRS and self._reads_by_id(moe, x):  # few pairs: no grouping
            return self._moe_by_id(moe, x, chosen, weights)

        # Grouped by expert: the (token, slot) pairs sorted by expert and one host read of the group
        # sizes; no per-token work.
        count, k = chosen.shape
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # pair indices, by expert
        sizes = torch.bincount(flat, minlength=cfg.num_experts)
        host_sizes = sizes.tolist()
        largest, width = max(host_sizes), x.shape[1]
        if cfg.gguf_experts and _grouped_on_whole(experts, x, host_sizes):
            inputs = x.index_select(0, order // k)  # [T k, D], by expert
            grouped = _gguf_experts_grouped(experts, inputs, torch.cumsum(sizes, 0).int(), limit)
            by_pair = torch.empty_like(inputs).index_copy_(0, order, grouped)
        elif cfg.gguf_experts:  # one SwiGLU per expert that has tokens, on its GGUF blocks
            inputs = x.index_select(0, order // k)  # [T k, D], by expert
            parts, first = [], 0
            for expert, size in enumerate(host_sizes):
                if size:
                    own = (experts.gate_proj[expert], experts.up_proj[expert], experts.down_proj[expert])
                    parts.append(gguf_expert(experts, own, inputs[first : first + size], limit))
                    first += size
            by_pair = torch.empty_like(inputs).index_copy_(0, order, torch.cat(parts))
        elif cfg.num_experts * largest <= 2 * count * k and experts.gate_up_proj.dtype != torch.uint8:
            # Balanced enough (so most experts have tokens: their weights are read anyway): two
            # batched GEMMs over all experts, each group padded to the largest, at most twice the
            # rows (and memory) of the pairs themselves. The padded rows are gathered straight
            # from x (a padding row repeats token 0: its output is never read), and each pair's
            # output straight from the result: one pass over the rows each way.
            if ops.pads_rows(x.device) and largest > FEW_ROWS:
                largest = prefill_rows(largest)  # the GEMMs' rows (see ops.PAD_PRODUCT_ROWS)
            ranked = flat.index_select(0, order)  # the expert of each sorted pair
            starts = (torch.cumsum(sizes, 0) - sizes).index_select(0, ranked)
            offset = torch.arange(count * k, device=x.device) - starts  # rank within its group
            slots = ranked * largest + offset  # each sorted pair's row in the padded [E, largest] layout
            sources = order.new_zeros(cfg.num_experts * largest).index_copy_(0, slots, order // k)
            padded = x.index_select(0, sources).view(cfg.num_experts, largest, width)
            hidden = ops.swiglu(
                *torch.bmm(padded, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1), limit
            )
            ys = torch.bmm(hidden, experts.down_proj.transpose(1, 2)).view(-1, width)
            by_pair = ys.index_select(0, torch.empty_like(slots).index_copy_(0, order, slots))
        else:
            inputs = x.index_select(0, order // k)  # [T k, D], by expert
            if experts.gate_up_proj.dtype == torch.uint8:
                # Packed FP4: one grouped kernel a projection widens the weight tiles in registers
                # (no bf16 copy of an expert, one launch for all of them).
                scales = experts.gate_up_proj_scale
                gate_up = fp4_grouped_matmul(inputs, host_sizes, experts.gate_up_proj, scales)
                hidden = ops.swiglu(*gate_up.chunk(2, dim=-1), limit)
                grouped = fp4_grouped_matmul(hidden, host_sizes, experts.down_proj, experts.down_proj_scale)
            else:  # one GEMM pair per expert that has tokens
                parts, first = [], 0
                for expert, size in enumerate(host_sizes):
                    if size:
                        gate_up = inputs[first : first + size] @ experts.gate_up_proj[expert].t()
                        parts.append(
                            ops.swiglu(*gate_up.chunk(2, dim=-1), limit) @ experts.down_proj[expert].t()
                        )
                        first += size
                grouped = torch.cat(parts)
            by_pair = torch.empty_like(inputs).index_copy_(0, order, grouped)  # back to (token, slot) order
        return v4_route.mix(weights, by_pair) + ops.shared_expert(moe.shared_experts, x, limit)

    def _reads_by_id(self, moe: Moe, x: torch.Tensor) -> bool:
        """Whether rows of x can read their GGUF experts in place by id (_moe_by_id)."""
        return self.config.gguf_experts and _on_gguf_kernels(moe.experts, x)

    def _moe_by_id(
        self, moe: Moe, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The MoE of rows x [T, D] routed to `chosen` [T, k] with `weights`, every pair's GGUF expert
        read in place by id: no host read, so a graph can hold it (prompt pieces, verify steps)."""
        limit = self.config.swiglu_limit
        by_pair = _gguf_experts_by_id(moe.experts, x, chosen, limit)
        return v4_route.mix(weights, by_pair) + ops.shared_expert(moe.shared_experts, x, limit)

    def _decode_moe(self, moe: Moe, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """_moe for one token without a host sync: the router is one op (v4_route), the picked
        experts are read by id on the device (packed FP4, GGUF blocks, or bf16 on the GEMV kernels), their
        outputs mixed in one op and the shared expert added in its down projection. Without those
        kernels the routed experts' weights are gathered by index (what scales to 256 experts), or,
        when the active experts are a large share of all (a gather is a copy plus a read of k
        experts), every expert runs and the unchosen ones weigh zero."""
        cfg = self.config
        gate = moe.gate
        tid2eid = getattr(gate, "tid2eid", None)
        bias = None if tid2eid is not None else gate.e_score_correction_bias
        experts, limit = moe.experts, cfg.swiglu_limit
        by_id = self._reads_by_id(moe, x)
        order = gguf_experts.input_order(experts.type_ids["gate_proj"], x.shape[1], x) if by_id else None
        # The router's kernel also lays x out as the experts' kernel reads it (no gather kernel).
        reorder = None if order is None or not x.is_contiguous() else (x, order, torch.empty_like(x))
        picked, weights = v4_route.route(
            ops.linear(x, gate),
            bias,
            tid2eid,
            token,
            cfg.experts_per_token,
            cfg.routed_scaling_factor,
            reorder,
        )  # [k], float32 [k]
        if by_id:
            # The picked experts' blocks read in place by id (no host sync, no copy): three kernels.
            gate_in = None if reorder is None else reorder[2]
            y = _gguf_experts_by_id(experts, x, picked.view(1, -1), limit, gate_in)
            return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))
        if cfg.gguf_experts:
            # The picked experts' blocks gathered on the device (no host sync), one SwiGLU each.
            picks = [experts.gate_proj.index_select(0, picked), experts.up_proj.index_select(0, picked)]
            picks.append(experts.down_proj.index_select(0, picked))
            k = picked.shape[0]
            y = torch.cat([gguf_expert(experts, tuple(w[j] for w in picks), x, limit) for j in range(k)])
            return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))
        if experts.gate_up_proj.dtype == torch.uint8:  # packed FP4: the kernel reads the picked experts
            gate_up = fp4_experts_gemv(x, picked, experts.gate_up_proj, experts.gate_up_proj_scale)
            # [k, D], the clamped SwiGLU of gate_up [k, 2I] taken inside the down projection.
            y = fp4_experts_gemv(gate_up, picked, experts.down_proj, experts.down_proj_scale, limit)
            return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))
        if decode_kernels.one_row(x, experts.gate_up_proj.flatten(0, 1)) and decode_kernels.fits(
            experts.down_proj.flatten(0, 1)
        ):
            # Only the picked experts' rows are read, and the clamped SwiGLU is the down
            # projection's input: two kernels.
            gate_up = x.new_empty((picked.numel(), experts.gate_up_proj.shape[1]))
            decode_kernels.experts_gemv(x, experts.gate_up_proj, picked, gate_up)
            y = x.new_empty((picked.numel(), experts.down_proj.shape[1]))
            decode_kernels.experts_gemv(gate_up, experts.down_proj, picked, y, limit)
            return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))
        dense = self.graph_dense_moe
        if dense is None:
            dense = cfg.num_experts <= 3 * cfg.experts_per_token
        vector = x.view(-1)
        if dense:
            gate_up, down = experts.gate_up_proj, experts.down_proj
            weights = x.new_zeros((cfg.num_experts,), dtype=torch.float32).scatter_(0, picked, weights)
        else:
            gate_up = experts.gate_up_proj.index_select(0, picked)  # [k, 2I, D]
            down = experts.down_proj.index_select(0, picked)  # [k, D, I]
        hidden = ops.swiglu(*torch.matmul(gate_up, vector).chunk(2, dim=-1), limit)  # [E or k, I]
        y = torch.bmm(down, hidden.unsqueeze(-1)).squeeze(-1)  # [E or k, D]
        return self._add_shared_expert(moe.shared_experts, x, v4_route.mix(weights, y))

    def _add_shared_expert(self, shared: SharedExpert, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """routed [1, D] plus the shared expert's output for x; on the GEMV kernels (bf16, or FP8 on
        the one-row FP8 kernel) two kernels where gate and up are one tensor (SharedExpert.gate_up),
        else three; the SwiGLU and the sum run inside the down projection."""
        limit = self.config.swiglu_limit
        gate, up, down = shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight
        fused = shared.gate_up()
        if gate.dtype == torch.float8_e4m3fn:
            scales = [m.weight_scale_inv for m in (shared.gate_proj, shared.up_proj, shared.down_proj)]
            width = gate.shape[0]
            if (
                fp8_row_fits(x, gate, scales[0])
                and fp8_row_fits(x, up, scales[1])
                and fp8_row_fits(x, down, scales[2])
                and routed.is_contiguous()
                and routed.dtype == x.dtype
            ):
                gate_up = x.new_empty((1, 2 * width))
                if fused:
                    fp8_row_(x, *fused, gate_up)
                else:
                    fp8_row_(x, gate, scales[0], gate_up[:, :width])
                    fp8_row_(x, up, scales[1], gate_up[:, width:])
                return fp8_row_(gate_up, down, scales[2], routed, swiglu_limit=limit, residual=True)
        if decode_kernels.one_row(x, gate) and decode_kernels.one_row(x, up) and decode_kernels.fits(down):
            width = gate.shape[0]
            gate_up = x.new_empty((1, 2 * width))
            if fused and decode_kernels.one_row(x, fused[0]):
                decode_kernels.gemv(x, fused[0], gate_up)
            else:
                decode_kernels.gemv(x, gate, gate_up[:, :width])
                decode_kernels.gemv(x, up, gate_up[:, width:])
            return decode_kernels.gemv_add_(routed, gate_up, down, None, silu=True, swiglu_limit=limit)
        return routed + ops.shared_expert(shared, x, limit)
