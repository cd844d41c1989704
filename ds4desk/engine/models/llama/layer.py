"""One dense decoder layer's forward, and the backend each way of running it uses.

A layer is six steps, in this order on every path (`LayerSteps.layer`):

1. `qkv`: RMSNorm, then the fused q/k/v projection;
2. `rope_write`: RoPE on the queries and keys (after Qwen3's per-head norm), keys and values into
   the cache;
3. `attend`: attention over the cache;
4. `out_residual`: the output projection, added into the residual;
5. `gate_up`: RMSNorm, then the fused gate/up projection;
6. `down_residual`: SiLU(gate) · up through the down projection, added into the residual.

What differs between the paths is how each step runs: one subclass per path, made once per call
and shard with what that call reads (positions, rope rows, buffers, masks).

- `PrefillSteps` (T > 1 tokens, `forward`): fresh tensors; SDPA attention, in the flash-shaped
  layout on a GPU and the kv-head-major layout (fastest there) on the CPU.
- `EagerDecodeSteps` (one token, `forward`): the projections write into preallocated buffers whose
  views were made once, because every torch call saved counts at one token; the position is a host
  int, so attention reads exactly the valid rows and needs no mask. On the CPU, in float32, with
  every projection GGUF-packed, all six steps of every layer run in one C call instead
  (models/cpu_decode.py, gguf_cpu.FusedLayer): there the torch calls cost as much as the GEMVs.
- `GraphDecodeSteps` (one token, `decode_graphable`): the position is a device tensor and the span a
  fixed shape, so a CUDA graph can replay it; attention masks by position: a Triton kernel pair,
  one SDPA call or two batched matmuls (`DenseModel.decode_attention`).
- `KernelDecodeSteps` (`decode_graphable` on the fused GPU kernels, where they fit): seven kernels a
  layer (norm+qkv, rope+cache write, the attention pair, o + residual, norm+gate/up, SiLU·up +
  down + residual), writing into the same preallocated buffers. On GGUF-packed weights the one-row
  GEMVs read an input prepared by a kernel before them; where it can, that is the kernel whose
  output it is (the attention for o, the gate/up GEMV for down: `LayerPlan.o_input`, `down_input`),
  not an input kernel of their own.

Every projection is a `Projection` (models/packed.py): float weights are kept transposed (views,
no copies) and run through mm/addmm directly, which skips linear's dispatch layers and lets addmm
fold the residual add in; weights kept in a GGUF block type run through the packed matmuls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.dense import decode_attention as fused_decode
from ds4desk.engine.kernels.dense import gemv as kernels
from ds4desk.engine.kernels.dense.silu_mul import silu_mul
from ds4desk.engine.kernels.quant import gguf_cpu, gguf_triton
from ds4desk.engine.models import cpu_decode
from ds4desk.engine.models.base import later_chunk_mask
from ds4desk.engine.models.packed import Projection

if TYPE_CHECKING:
    from ds4desk.engine.models.llama.config import DenseConfig


@dataclass(slots=True)
class LayerPlan:
    """The tensors one layer's forward touches, gathered once so the hot loop does no lookups."""

    ln1: torch.Tensor
    qkv: Projection  # -> [(H + 2 KV) * D]; q/k/v_proj.weight are views of one fused base where they can be
    qk_norm: torch.Tensor | None  # [H + KV, D]: q_norm for the query heads, k_norm for the key heads
    o: Projection
    ln2: torch.Tensor
    gate_up: Projection  # -> [2 * ffn]; gate/up_proj.weight are views of one fused base where they can be
    down: Projection
    window: int | None
    kv_cache: torch.Tensor | None = None  # [2, KV, context, D]: keys then values
    keys: torch.Tensor | None = None  # [1, KV, context, D] views of kv_cache, shaped for SDPA
    values: torch.Tensor | None = None
    cpu_layer: object | None = None  # cpu_decode.cached_layer's slot: the fused one-token CPU layer
    # The down projection's input as the one-token gate/up GEMV writes it (silu_pair_input)
    down_input: torch.Tensor | None = None
    # (buffer, type id, groups a tile): the o projection's input as the fused attention writes it
    o_input: tuple[torch.Tensor, int, int] | None = None


@dataclass(slots=True)
class DecodeBuffers:
    """Reused outputs for the one-token step, with their views made once: every torch call saved
    there counts, because after each weight-streaming matmul the caches are cold and even a view
    costs microseconds."""

    qkv: torch.Tensor  # [1, (H + 2 KV) D]
    qk: torch.Tensor  # [H + KV, D] view: queries and keys, rotated in place
    kv: torch.Tensor  # [2, KV, D] view: this position's keys and values, as the cache lays them out
    q: torch.Tensor  # [1, KV, G, D] view: queries grouped by the kv head they share
    gate_up: torch.Tensor  # [1, 2 F]
    gate: torch.Tensor  # [1, F] view
    up: torch.Tensor  # [1, F] view


def decode_buffers(cfg: DenseConfig, device: torch.device, dtype: torch.dtype) -> DecodeBuffers:
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.empty((1, (heads + 2 * kv_heads) * dim), device=device, dtype=dtype)
    gate_up = torch.empty((1, 2 * cfg.intermediate_size), device=device, dtype=dtype)
    return DecodeBuffers(
        qkv=qkv,
        qk=qkv[0, : (heads + kv_heads) * dim].view(heads + kv_heads, dim),
        kv=qkv[0, heads * dim :].view(2, kv_heads, dim),
        q=qkv[0, : heads * dim].view(1, kv_heads, heads // kv_heads, dim),
        gate_up=gate_up,
        gate=gate_up[:, : cfg.intermediate_size],
        up=gate_up[:, cfg.intermediate_size :],
    )


@dataclass(slots=True)
class Shard:
    """Consecutive layers on one device and what their loop reads there (ds4desk.engine.split):
    unsplit, the one shard holds every layer. Shards on one device share the tables and buffers."""

    device: torch.device
    plans: list[LayerPlan]
    first: bool  # reads the embedding's output; a later shard gets the activation handed over
    cache: torch.Tensor | None = None  # [its layers, 2, KV, context, D]
    cos: torch.Tensor | None = None  # [context, D]
    sin: torch.Tensor | None = None  # [context, D], sign-folded: see DenseModel.allocate_cache
    half_swap: torch.Tensor | None = None  # [D]: index d -> (d + D/2) mod D
    key_positions: torch.Tensor | None = None  # [context]: 0..context-1, for the graphed step's masks
    decode: DecodeBuffers | None = None


class LayerSteps(ABC):
    """One layer's forward in six steps (see the module docstring); a subclass is one path's way of
    running them. x is the residual stream [T, hidden]."""

    def layer(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        qkv = self.qkv(x, plan)
        self.rope_write(qkv, plan)
        x = self.out_residual(x, self.attend(qkv, plan), plan)
        return self.down_residual(x, self.gate_up(x, plan), plan)

    @abstractmethod
    def qkv(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """RMSNorm(x) @ [q|k|v]ᵀ (+ bias): [T, (H + 2 KV) D]."""

    @abstractmethod
    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        """Rotate the queries and keys of qkv in place; keys and values into the layer's cache."""

    @abstractmethod
    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """The queries' attention over the cache: [T, H * D]."""

    @abstractmethod
    def out_residual(self, x: torch.Tensor, attn: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """x + attn @ oᵀ (+ bias)."""

    @abstractmethod
    def gate_up(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """RMSNorm(x) @ [gate|up]ᵀ (+ bias): [T, 2 F]."""

    @abstractmethod
    def down_residual(self, x: torch.Tensor, gate_up: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """x + (SiLU(gate) · up) @ downᵀ (+ bias)."""


class _TorchSteps(LayerSteps):
    """The steps the three torch paths share: fresh projections, residual adds folded into addmm."""

    def __init__(self, cfg: DenseConfig, exact: bool) -> None:
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.exact = exact  # one-pass RMSNorm: see DenseModel.one_pass_norm

    def _fused_shard(self, shard: Shard, pos: int, count: int) -> cpu_decode.FusedShard | None:
        """On the CPU, the layers whose projections are all GGUF-packed as one C call for these
        `count` tokens (models/cpu_decode.py); None where that path is off."""
        fit = cpu_decode.enabled and self.exact and shard.device.type == "cpu"
        if not fit or count > gguf_cpu.MAX_TOKENS or shard.cos is None or shard.sin is None:
            return None
        cos, sin = shard.cos, shard.sin

        def fused(plan: LayerPlan) -> gguf_cpu.FusedLayer | None:
            return cpu_decode.cached_layer(plan, cos, sin, lambda: self._spec(plan, cos, sin))

        return cpu_decode.FusedShard(shard.plans, fused, pos)

    def _spec(self, plan: LayerPlan, cos: torch.Tensor, sin: torch.Tensor) -> gguf_cpu.LayerSpec | None:
        projections = cpu_decode.packed_projections(plan.qkv, plan.o, plan.gate_up, plan.down)
        if projections is None or plan.kv_cache is None:
            return None
        qkv, o, gate_up, down = projections
        cfg = self.cfg
        return gguf_cpu.LayerSpec(
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            ffn=cfg.intermediate_size,
            eps=self.eps,
            attention_scale=cfg.head_dim**-0.5,  # SDPA's default, as attend uses
            activation="silu",
            sin_folded=True,
            window=plan.window,
            input_norm=plan.ln1,
            pre_ffn_norm=plan.ln2,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            kv_cache=plan.kv_cache,
            cos=cos,
            sin=sin,
            qk_norm=plan.qk_norm,
        )

    def qkv(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return plan.qkv(rms_norm(x, plan.ln1, self.eps, self.exact))

    def out_residual(self, x: torch.Tensor, attn: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return plan.o.add_into(x, attn)  # the residual add rides along

    def gate_up(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return plan.gate_up(rms_norm(x, plan.ln2, self.eps, self.exact))

    def down_residual(self, x: torch.Tensor, gate_up: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return plan.down.add_into(x, self.act(gate_up))

    @abstractmethod
    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) · up of the gate/up rows: [T, F]."""


class PrefillSteps(_TorchSteps):
    """T > 1 tokens at positions start..start+T-1."""

    def __init__(
        self, cfg: DenseConfig, exact: bool, flash: bool, shard: Shard, start: int, count: int
    ) -> None:
        super().__init__(cfg, exact)
        self.start, self.count, self.end = start, count, start + count
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.heads // self.kv_heads
        self.q_width = self.heads * self.dim
        self.qk_width = (self.heads + self.kv_heads) * self.dim
        assert shard.cos is not None and shard.sin is not None and shard.half_swap is not None
        self.cos_rows, self.sin_rows = shard.cos[start : self.end], shard.sin[start : self.end]  # [T, D]
        self.cos, self.sin = self.cos_rows.unsqueeze(1), self.sin_rows.unsqueeze(1)  # [T, 1, D]
        self.swap = shard.half_swap
        self.flash = flash  # DenseModel.fused_attention
        self.masks: dict[int | None, torch.Tensor] = {}  # per window, made by the first layer
        # A few tokens (a verify step of speculative decoding) take the one-call CPU layer too.
        self.fused = self._fused_shard(shard, start, count)

    def layer(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        if self.fused is None:
            return super().layer(x, plan)
        return self.fused.layer(x, plan, lambda: super(PrefillSteps, self).layer(x, plan))

    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        assert plan.kv_cache is not None
        qk = qkv[:, : self.qk_width].view(self.count, self.heads + self.kv_heads, self.dim)
        # Written back into qkv, so keys and values reach the cache in one copy.
        if self.exact and gguf_cpu.row_ops_take(qkv):  # on the CPU: one C pass
            gguf_cpu.rope_(qk, self.cos_rows, self.sin_rows, True, plan.qk_norm, self.eps)
        else:
            _rotate(qk, plan.qk_norm, self.cos, self.sin, self.swap, self.eps, self.exact)
        plan.kv_cache[:, :, self.start : self.end].copy_(
            qkv[:, self.q_width :].view(self.count, 2, self.kv_heads, self.dim).permute(1, 2, 0, 3)
        )

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        keys, values = plan.keys, plan.values
        assert keys is not None and values is not None
        count, kv_heads, group, dim, q_width = self.count, self.kv_heads, self.group, self.dim, self.q_width
        if self.flash and plan.window is None:
            return _causal_attention(qkv[:, :q_width], keys, values, self.start, group)
        # GQA without copying keys: the `group` query heads that share one kv head become
        # group * T query rows of that kv head, so SDPA's batch dimension is the kv head.
        q = qkv[:, :q_width].reshape(count, kv_heads, group, dim).permute(1, 2, 0, 3)
        q = q.reshape(1, kv_heads, group * count, dim)
        mask = self.masks.get(plan.window)
        if mask is None:
            mask = self.masks[plan.window] = _causal_mask(self.start, count, group, plan.window, qkv.device)
        attn = F.scaled_dot_product_attention(
            q, keys[:, :, : self.end], values[:, :, : self.end], attn_mask=mask
        )  # [1, KV, G * T, D]
        return attn.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, q_width)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gguf_cpu.row_ops_take(gate_up):
            return gguf_cpu.gated_rows(gate_up, "silu")
        return silu_mul(gate_up)


class EagerDecodeSteps(_TorchSteps):
    """One token at host position `pos`, in as few torch calls as possible: outputs go into the
    preallocated buffers, whose views were made once, and no mask is needed. On the CPU, a layer
    whose projections are all GGUF-packed runs as one C call instead (models/cpu_decode.py)."""

    def __init__(self, cfg: DenseConfig, exact: bool, shard: Shard, pos: int) -> None:
        super().__init__(cfg, exact)
        buffers, cos, sin, self.swap = shard.decode, shard.cos, shard.sin, shard.half_swap
        assert buffers is not None and cos is not None and sin is not None and self.swap is not None
        self.fused = self._fused_shard(shard, pos, 1)
        self.pos, self.end = pos, pos + 1
        self.q_width = cfg.num_heads * cfg.head_dim
        self.cos, self.sin = cos[pos], sin[pos]  # [D], broadcast over the heads
        self.qkv_out, self.qk, self.kv, self.q = buffers.qkv, buffers.qk, buffers.kv, buffers.q
        self.gate_up_out, self.gate, self.up = buffers.gate_up, buffers.gate, buffers.up

    def layer(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        if self.fused is None:
            return super().layer(x, plan)
        return self.fused.layer(x, plan, lambda: super(EagerDecodeSteps, self).layer(x, plan))

    def qkv(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return plan.qkv(rms_norm(x, plan.ln1, self.eps, self.exact), out=self.qkv_out)

    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        assert plan.kv_cache is not None
        _rotate(self.qk, plan.qk_norm, self.cos, self.sin, self.swap, self.eps, self.exact)
        plan.kv_cache.select(2, self.pos).copy_(self.kv)

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.keys is not None and plan.values is not None
        low = 0 if plan.window is None else max(0, self.end - plan.window)
        rows = self.end - low
        attn = F.scaled_dot_product_attention(
            self.q, plan.keys.narrow(2, low, rows), plan.values.narrow(2, low, rows)
        )
        # reshape: a view on CPU; GPU kernels may hand back a [1, G, KV, D] memory layout.
        return attn.reshape(1, self.q_width)

    def gate_up(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return plan.gate_up(rms_norm(x, plan.ln2, self.eps, self.exact), out=self.gate_up_out)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate, inplace=True).mul_(self.up)  # in the buffer: it is rewritten next layer


class GraphDecodeSteps(_TorchSteps):
    """One token at device position `here`, attention over the first `span` cache rows under a
    mask, because the number of valid rows must not be a shape. `attention`: "triton" (the kernel
    pair of kernels/dense/decode_attention.py, which masks by `here` itself), "sdpa" or "matmul"."""

    def __init__(
        self, cfg: DenseConfig, exact: bool, attention: str, shard: Shard, here: torch.Tensor, span: int
    ) -> None:
        super().__init__(cfg, exact)
        cos, sin, keys_at, self.swap = shard.cos, shard.sin, shard.key_positions, shard.half_swap
        assert cos is not None and sin is not None and keys_at is not None and self.swap is not None
        self.here, self.span, self.attention = here, span, attention
        heads, kv_heads = self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.dim = cfg.head_dim
        self.q_width = heads * self.dim
        self.qk_width = (heads + kv_heads) * self.dim
        self.scale = self.dim**-0.5
        self.cos, self.sin = cos.index_select(0, here), sin.index_select(0, here)  # [1, D]
        keys_at = keys_at[:span]
        self.biases: dict[int | None, torch.Tensor] = {}  # 0 where a key may be read, -inf elsewhere
        windows = set() if attention == "triton" else {plan.window for plan in shard.plans}
        for window in windows:
            allowed = keys_at <= here
            if window is not None:
                allowed = allowed & (keys_at > here - window)
            bias = torch.zeros(span, dtype=cos.dtype, device=keys_at.device).masked_fill_(
                ~allowed, -torch.inf
            )
            self.biases[window] = bias.expand(kv_heads, heads // kv_heads, span)

    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        assert plan.kv_cache is not None
        qk = qkv[0, : self.qk_width].view(self.heads + self.kv_heads, self.dim)
        _rotate(qk, plan.qk_norm, self.cos, self.sin, self.swap, self.eps, self.exact)
        plan.kv_cache.index_copy_(2, self.here, qkv[0, self.q_width :].view(2, self.kv_heads, 1, self.dim))

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        keys, values = plan.keys, plan.values
        assert keys is not None and values is not None
        span, kv_heads, group, dim = self.span, self.kv_heads, self.heads // self.kv_heads, self.dim
        if self.attention == "triton":  # the kernel masks by `here` itself, on the device
            q = qkv[0, : self.q_width].view(kv_heads, group, dim)
            attn = fused_decode.decode_attention(
                q, keys[0, :, :span], values[0, :, :span], self.here, self.scale, plan.window
            )
        elif self.attention == "sdpa":
            q = qkv[0, : self.q_width].view(1, kv_heads, group, dim)
            attn = F.scaled_dot_product_attention(
                q, keys[:, :, :span], values[:, :, :span], attn_mask=self.biases[plan.window]
            )
        else:
            # Two batched matmuls over the span: a fused attention kernel gives each kv head
            # one thread block, which leaves most of the GPU idle on a long cache.
            q = qkv[0, : self.q_width].view(kv_heads, group, dim)
            scores = torch.baddbmm(
                self.biases[plan.window], q, keys[0, :, :span].transpose(1, 2), alpha=self.scale
            )  # [KV, G, span]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attn = torch.bmm(probs, values[0, :, :span])  # [KV, G, D]
        return attn.reshape(1, self.q_width)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        width = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :width]) * gate_up[:, width:]


class KernelDecodeSteps(LayerSteps):
    """GraphDecodeSteps on the fused GPU kernels (kernels/dense/gemv.py): the residual x is updated in
    place, so the caller hands in a tensor of its own, never a graph's input buffer."""

    def __init__(self, cfg: DenseConfig, shard: Shard, here: torch.Tensor, span: int) -> None:
        buffers, cos, sin = shard.decode, shard.cos, shard.sin
        assert buffers is not None and cos is not None and sin is not None
        self.eps = cfg.rms_norm_eps
        self.here, self.span = here, span
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_width = self.heads * self.dim
        self.cos, self.sin = cos, sin  # the whole tables: rope_write reads the row at `here`
        self.qkv_out, self.gate_up_out = buffers.qkv, buffers.gate_up

    def qkv(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        return norm_project(x, plan.ln1, plan.qkv, self.eps, self.qkv_out)

    def rope_write(self, qkv: torch.Tensor, plan: LayerPlan) -> None:
        assert plan.kv_cache is not None
        kernels.rope_write(
            qkv, self.cos, self.sin, self.here, plan.kv_cache, self.heads, plan.qk_norm, self.eps
        )

    def attend(self, qkv: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.keys is not None and plan.values is not None
        span = self.span
        q = qkv[0, : self.q_width].view(self.kv_heads, self.heads // self.kv_heads, self.dim)
        attn = fused_decode.decode_attention(
            q,
            plan.keys[0, :, :span],
            plan.values[0, :, :span],
            self.here,
            self.dim**-0.5,
            plan.window,
            ordered=plan.o_input,
        )
        return attn.view(1, self.q_width)

    def out_residual(self, x: torch.Tensor, attn: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        o = plan.o
        if plan.o_input is None:
            return add_project_(x, attn, o, silu=False)
        assert o.packed is not None
        return gguf_triton.gemv_prepared(plan.o_input[0], o.packed, o.type_id, o.cols, x, residual=True)

    def gate_up(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        gate_up, down = plan.gate_up, plan.down
        if plan.down_input is None:
            return norm_project(x, plan.ln2, gate_up, self.eps, self.gate_up_out)
        assert gate_up.packed is not None and down.packed is not None
        return gguf_triton.norm_gemv_silu(
            x, plan.ln2, gate_up.packed, gate_up.type_id, gate_up.cols, self.eps, self.gate_up_out,
            plan.down_input, down.packed, down.type_id,
        )  # fmt: skip

    def down_residual(self, x: torch.Tensor, gate_up: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        down = plan.down
        if plan.down_input is None:
            return add_project_(x, gate_up, down, silu=True)
        assert down.packed is not None
        return gguf_triton.gemv_prepared(plan.down_input, down.packed, down.type_id, down.cols, x, True)


def silu_pair_input(plan: LayerPlan) -> torch.Tensor | None:
    """A buffer for the down projection's input, where the one-token gate/up GEMV can write it
    itself (gguf_triton.norm_gemv_silu: packed gate | up of one type and a packed down that
    silu_pair_fits, no biases), which saves the down's input kernel; else None."""
    gate_up, down = plan.gate_up, plan.down
    if gate_up.packed is None or down.packed is None or gate_up.parts:
        return None
    if gate_up.bias is not None or down.bias is not None:
        return None
    if not gguf_triton.silu_pair_fits(gate_up.packed, gate_up.type_id, down.packed, down.type_id):
        return None
    return gguf_triton.prepared_input(down.packed, down.type_id, down.cols)


def attention_out_input(plan: LayerPlan) -> tuple[torch.Tensor, int, int] | None:
    """(buffer, type id, groups a tile) for the o projection's input, where the one-token step's
    fused attention can write it in the read order of o's one-row GEMV (a packed Q4_K / Q6_K o, no
    bias), which saves o's input kernel; else None."""
    o = plan.o
    if o.packed is None or o.parts or o.bias is not None:
        return None
    groups = gguf_triton.read_order_groups(o.packed, o.type_id, o.cols)
    if groups is None:
        return None
    return gguf_triton.prepared_input(o.packed, o.type_id, o.cols), o.type_id, groups


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, exact: bool) -> torch.Tensor:
    """RMSNorm computed in float32; the weight multiplies after the cast back (as the reference)."""
    if exact and x.dim() == 2 and gguf_cpu.row_ops_take(x):
        return gguf_cpu.rms_norm_rows(x, weight, eps)
    if exact:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed if weight is None else normed * weight


def fused_kernels_fit(projection: Projection, dtype: torch.dtype) -> bool:
    """Whether the one-row fused kernels run `projection`: one float weight the bf16 kernels take,
    or GGUF-packed weights whose types the GGUF kernels decode (one, or a group of differing types:
    q/k/v of a Q4_K_M file)."""
    if projection.weight_t is not None:
        return kernels.fits(projection.weight_t.t())
    if projection.parts:
        return all(p.packed is not None and gguf_triton.covers(p.type_id, dtype) for p in projection.parts)
    return projection.packed is not None and gguf_triton.covers(projection.type_id, dtype)


def norm_project(
    x: torch.Tensor, norm: torch.Tensor, projection: Projection, eps: float, out: torch.Tensor
) -> torch.Tensor:
    """out = RMSNorm(x) @ Wᵀ (+ b) for one row, in one fused kernel (float or packed weight)."""
    if projection.weight_t is not None:
        return kernels.norm_gemv(x, norm, projection.weight_t.t(), projection.bias, eps, out=out)
    if projection.parts:  # differing block types: the normed row once, then a GEMV a part
        first = projection.parts[0]
        assert first.packed is not None
        prepared = None  # the first part's input in its GEMV's read order, from the same kernel
        if gguf_triton.read_order_groups(first.packed, first.type_id, first.cols) is not None:
            normed, prepared = gguf_triton.normed_row_and_input(
                x, norm, eps, first.packed, first.type_id, first.cols
            )
        else:
            normed = gguf_triton.normed_row(x, norm, eps)
        start = 0
        for part in projection.parts:
            assert part.packed is not None
            stop = start + part.rows
            if prepared is not None and part is first:
                gguf_triton.gemv_prepared(prepared, part.packed, part.type_id, part.cols, out[:, start:stop])
            else:
                gguf_triton.gemv(normed, part.packed, part.type_id, part.cols, out[:, start:stop])
            if part.bias is not None:
                out[:, start:stop].add_(part.bias)
            start = stop
        return out
    assert projection.packed is not None
    gguf_triton.norm_gemv(x, norm, projection.packed, projection.type_id, projection.cols, eps, out)
    return out if projection.bias is None else out.add_(projection.bias)


def add_project_(x: torch.Tensor, inp: torch.Tensor, projection: Projection, silu: bool) -> torch.Tensor:
    """x += inp @ Wᵀ (+ b) in place for one row (silu: inp is gate | up, and SiLU(gate) · up goes
    in), in one fused kernel (float or packed weight)."""
    if projection.weight_t is not None:
        return kernels.gemv_add_(x, inp, projection.weight_t.t(), projection.bias, silu=silu)
    assert projection.packed is not None
    gguf_triton.gemv_add_(x, inp, projection.packed, projection.type_id, projection.cols, silu=silu)
    return x if projection.bias is None else x.add_(projection.bias)


def _rotate(
    qk: torch.Tensor,
    qk_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    swap: torch.Tensor,
    eps: float,
    exact: bool,
) -> None:
    """RoPE on query and key heads [..., D] at once, in place, after Qwen3's per-head RMSNorm where
    the layer has one. HF's rotate_half convention with the sign folded into `sin` (see
    DenseModel.allocate_cache): x * cos + swap_halves(x) * sin."""
    src = qk if qk_norm is None else rms_norm(qk, None, eps, exact) * qk_norm
    torch.addcmul(src * cos, torch.index_select(src, -1, swap), sin, out=qk)


def _causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, group: int
) -> torch.Tensor:
    """Causal attention of T queries [T, H * D] at positions start.. over cache rows 0..start+T-1,
    shaped so SDPA can pick a flash kernel: heads as the head dimension (kv heads repeated, a small
    copy next to the matmuls) and the causal mask as a flag (aligned to the last key when a chunk
    follows earlier ones), never as a materialised [T, L] tensor. Returns [T, H * D]."""
    count = q.shape[0]
    end = start + count
    heads = keys.shape[1] * group
    q = q.view(count, heads, -1).transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    keys = keys[:, :, :end].repeat_interleave(group, dim=1)
    values = values[:, :, :end].repeat_interleave(group, dim=1)
    if start == 0:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        mask = later_chunk_mask(count, end, q.device)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out[0].transpose(0, 1).reshape(count, -1)


def _causal_mask(
    start: int, count: int, group: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Bool [G*T, start+T] mask (True = attend) for queries laid out kv-head-major as in attend."""
    query_pos = torch.arange(start, start + count, device=device).unsqueeze(1)
    key_pos = torch.arange(start + count, device=device).unsqueeze(0)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed.repeat(group, 1)
