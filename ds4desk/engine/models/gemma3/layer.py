"""One Gemma 3 decoder layer's forward, written once, and the three ways of running its attention.

A layer (`LayerSteps.layer`), in the reference's order:

1. RMSNorm (input_layernorm), the q/k/v projection;
2. per-head RMSNorm of the queries and keys (q_norm / k_norm), then RoPE with the layer's own
   tables (local layers and global layers rotate at different speeds);
3. keys and values into the cache, attention over it (a local layer sees only the last
   `sliding_window` positions, the current one included), scaled by query_pre_attn_scalar**-0.5;
4. the output projection, RMSNorm (post_attention_layernorm), added into the residual;
5. RMSNorm (pre_feedforward_layernorm), gate/up, GELU(tanh)(gate) · up, down projection, RMSNorm
   (post_feedforward_layernorm), added into the residual.

Every RMSNorm runs in float32 and scales by (1 + weight) before the cast back, as the reference
does; `scale` tensors hold that (1 + weight) in float32, made once by the model.

Local layers keep only their window: their cache is a ring of min(sliding_window, context) rows,
position p in row p % ring, which is what cuts Gemma 3's cache by about the share of its local
layers (five in six). Global layers keep every position.

What differs between paths is only where keys go and how attention reads them (one subclass each):
`PrefillSteps` (T tokens at host positions, a mask per window), `EagerDecodeSteps` (one token at a
host position: exactly the rows it may read, no mask), `GraphDecodeSteps` (one token at a
device position, fixed shapes: masked, so a CUDA graph can replay it) and `VerifySteps` (a
speculative verify's few tokens the same way).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.engine.models import cpu_decode
from ds4desk.engine.models.base import later_chunk_mask
from ds4desk.engine.models.gemma3.config import Gemma3Config
from ds4desk.engine.models.packed import Projection


@dataclass(slots=True)
class LayerPlan:
    """What one layer's forward touches, gathered once so the hot loop does no lookups."""

    input_norm: torch.Tensor  # float32 (1 + weight) [hidden]
    qkv: Projection  # -> [T, (H + 2 KV) * D]
    qk_norm: torch.Tensor  # float32 (1 + weight) [H + KV, D]: q_norm per query head, k_norm per key head
    o: Projection
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up: Projection  # -> [T, 2 F]
    down: Projection
    post_feedforward_norm: torch.Tensor
    window: int | None  # None: a global layer
    # [2, KV, rows, D], keys then values: rows = context for a global layer, its ring for a local one.
    kv_cache: torch.Tensor | None = None
    keys: torch.Tensor | None = None  # [1, KV, rows, D] views of kv_cache, shaped for SDPA
    values: torch.Tensor | None = None
    cpu_layer: object | None = None  # cpu_decode.cached_layer's slot: the fused one-token CPU layer

    @property
    def rows(self) -> int:
        assert self.kv_cache is not None
        return self.kv_cache.shape[2]


@dataclass(slots=True)
class RopeTables:
    cos: torch.Tensor  # [context, D], in the model dtype as the reference casts them
    sin: torch.Tensor


@dataclass(slots=True)
class Shard:
    """Consecutive layers on one device and what their loop reads there (ds4desk.engine.split);
    unsplit, the one shard holds every layer."""

    device: torch.device
    plans: list[LayerPlan]
    first: bool  # reads the embedding's output; a later shard gets the activation handed over
    global_cache: torch.Tensor | None = None  # [its global layers, 2, KV, context, D]
    local_cache: torch.Tensor | None = None  # [its local layers, 2, KV, ring, D]
    local: RopeTables | None = None
    global_: RopeTables | None = None
    key_positions: torch.Tensor | None = None  # [context]: 0..context-1, for the graphed step's masks

    def caches(self) -> list[torch.Tensor]:
        return [c for c in (self.global_cache, self.local_cache) if c is not None]


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: in float32, times the float32 (1 + weight) `scale`, then cast back."""
    if x.dim() == 2 and gguf_cpu.row_ops_take(x):
        return gguf_cpu.rms_norm_rows(x, scale, eps)
    if scale.dim() == 1:
        return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * scale).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention (the reference's): x·cos + [-x2, x1]·sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LayerSteps(ABC):
    """One layer's forward (module docstring); subclasses say where keys go and how attention reads
    them. x is the residual stream [T, hidden]."""

    def __init__(self, cfg: Gemma3Config, shard: Shard) -> None:
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale
        self.approximate = cfg.gelu_approximate
        assert shard.local is not None and shard.global_ is not None
        self.local, self.global_ = shard.local, shard.global_
        self.cfg = cfg

    def _fused_shard(self, shard: Shard, pos: int, count: int) -> cpu_decode.FusedShard | None:
        """On the CPU, the layers whose projections are all GGUF-packed as one C call for these
        `count` tokens (models/cpu_decode.py); None where that path is off."""
        if not (cpu_decode.enabled and shard.device.type == "cpu" and count <= gguf_cpu.MAX_TOKENS):
            return None
        return cpu_decode.FusedShard(shard.plans, self._fused, pos)

    def _fused(self, plan: LayerPlan) -> gguf_cpu.FusedLayer | None:
        tables = self.local if plan.window is not None else self.global_
        return cpu_decode.cached_layer(plan, tables.cos, tables.sin, lambda: self._spec(plan, tables))

    def _spec(self, plan: LayerPlan, tables: RopeTables) -> gguf_cpu.LayerSpec | None:
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
            attention_scale=self.scale,
            activation="gelu_tanh" if self.approximate == "tanh" else "gelu",
            sin_folded=False,  # rotate_half's plain sin: the kernel negates the first half itself
            window=plan.window,
            input_norm=plan.input_norm,
            pre_ffn_norm=plan.pre_feedforward_norm,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            kv_cache=plan.kv_cache,
            cos=tables.cos,
            sin=tables.sin,
            qk_norm=plan.qk_norm,
            post_attention_norm=plan.post_attention_norm,
            post_ffn_norm=plan.post_feedforward_norm,
        )

    def layer(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        count = x.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim
        qkv = plan.qkv(rms_norm(x, plan.input_norm, self.eps))
        qk = qkv[:, : (heads + kv_heads) * dim].view(count, heads + kv_heads, dim)
        cos, sin = self.rope(self.local if plan.window is not None else self.global_)
        if count > 1 and gguf_cpu.row_ops_take(qkv):  # a prompt on the CPU: one C pass, in place
            gguf_cpu.rope_(qk, cos.squeeze(1), sin.squeeze(1), False, plan.qk_norm, self.eps)
        else:
            qk = rotate(rms_norm(qk, plan.qk_norm, self.eps), cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * dim :].view(count, kv_heads, dim)
        attn = plan.o(self.attend(q, k, v, plan))
        x = x + rms_norm(attn, plan.post_attention_norm, self.eps)
        gate_up = plan.gate_up(rms_norm(x, plan.pre_feedforward_norm, self.eps))
        if gguf_cpu.row_ops_take(gate_up):
            act = gguf_cpu.gated_rows(gate_up, "gelu_tanh" if self.approximate == "tanh" else "gelu")
        else:
            width = gate_up.shape[1] // 2
            act = F.gelu(gate_up[:, :width], approximate=self.approximate) * gate_up[:, width:]
        return x + rms_norm(plan.down(act), plan.post_feedforward_norm, self.eps)

    @abstractmethod
    def rope(self, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of this call's positions, shaped [T, 1, D] to broadcast over heads."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        """Write this call's keys and values [T, KV, D] into the layer's cache and attend with the
        queries [T, H, D]: [T, H * D]. One step, because a chunk's keys may overwrite ring rows
        that its own earlier queries still read."""


class PrefillSteps(LayerSteps):
    """T tokens at host positions start..start+T-1: SDPA under a mask per window. `flash`
    (Gemma3Model.fused_attention, on GPUs): kv heads repeated (a small copy next to the matmuls)
    so SDPA can pick a fused kernel, and a global layer's mask given as the causal flag, never as a
    [T, context] tensor."""

    def __init__(self, cfg: Gemma3Config, shard: Shard, start: int, count: int, flash: bool = False) -> None:
        super().__init__(cfg, shard)
        self.start, self.count, self.end = start, count, start + count
        self.flash = flash
        self.masks: dict[int | None, torch.Tensor] = {}  # per window, made by its first layer
        # A few tokens (a verify step of speculative decoding) take the one-call CPU layer too.
        self.fused = None if flash else self._fused_shard(shard, start, count)

    def layer(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        if self.fused is None:
            return super().layer(x, plan)
        return self.fused.layer(x, plan, lambda: super(PrefillSteps, self).layer(x, plan))

    def rope(self, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.cos[self.start : self.end].unsqueeze(1), tables.sin[self.start : self.end].unsqueeze(1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.kv_cache is not None and plan.keys is not None and plan.values is not None
        new = torch.stack((k, v)).transpose(1, 2)  # [2, KV, T, D]
        if plan.window is None:
            plan.kv_cache[:, :, self.start : self.end].copy_(new)
            keys = plan.keys.narrow(2, 0, self.end)
            values = plan.values.narrow(2, 0, self.end)
        else:
            # The window's older keys (positions low..start-1) come out of the ring before this
            # chunk's keys overwrite any of them; the ring then keeps the chunk's last `rows`.
            ring = plan.rows
            older = torch.arange(self._low(plan.window), self.start, device=q.device) % ring
            both = torch.cat((plan.kv_cache.index_select(2, older), new), dim=2)
            kept = min(self.count, ring)
            rows = torch.arange(self.end - kept, self.end, device=q.device) % ring
            plan.kv_cache.index_copy_(2, rows, new[:, :, self.count - kept :])
            keys, values = both[0].unsqueeze(0), both[1].unsqueeze(0)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        if not self.flash and self.start == 0 and (plan.window is None or plan.window >= self.count):
            # The first chunk within the window: the mask is plain causal, and as a flag SDPA skips
            # the blocks above the diagonal instead of computing and masking them (same values).
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        elif not self.flash:
            mask = self._mask(plan.window, q.device)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        else:
            group = self.heads // self.kv_heads
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            if plan.window is None:
                # Aligned to the last key when a chunk follows earlier ones.
                causal = later_chunk_mask(self.count, self.end, q.device) if self.start else None
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=causal, is_causal=causal is None, scale=self.scale
                )
            else:
                mask = self._mask(plan.window, q.device)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out[0].transpose(0, 1).reshape(self.count, -1)

    def _low(self, window: int | None) -> int:
        """The first position a query of this call may read."""
        return 0 if window is None else max(0, self.start + 1 - window)

    def _mask(self, window: int | None, device: torch.device) -> torch.Tensor:
        """Bool [T, end - low] (True = attend) over key positions low..end-1 for `window`."""
        mask = self.masks.get(window)
        if mask is None:
            query_pos = torch.arange(self.start, self.end, device=device).unsqueeze(1)
            key_pos = torch.arange(self._low(window), self.end, device=device).unsqueeze(0)
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= key_pos > query_pos - window
            mask = self.masks[window] = allowed
        return mask


class EagerDecodeSteps(LayerSteps):
    """One token at host position `pos`: attention reads exactly the rows it may, so no mask (a
    full ring holds exactly the window; their order does not matter to attention). On the CPU, a
    float32 layer whose projections are all GGUF-packed runs as one C call (models/cpu_decode.py)."""

    def __init__(self, cfg: Gemma3Config, shard: Shard, pos: int) -> None:
        super().__init__(cfg, shard)
        self.pos = pos
        self.fused = self._fused_shard(shard, pos, 1)

    def layer(self, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        if self.fused is None:
            return super().layer(x, plan)
        return self.fused.layer(x, plan, lambda: super(EagerDecodeSteps, self).layer(x, plan))

    def rope(self, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.cos[self.pos], tables.sin[self.pos]  # [D], broadcast over the heads

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.kv_cache is not None and plan.keys is not None and plan.values is not None
        row = self.pos if plan.window is None else self.pos % plan.rows
        plan.kv_cache[0, :, row].copy_(k[0])
        plan.kv_cache[1, :, row].copy_(v[0])
        rows = min(self.pos + 1, plan.rows)
        # Two small batched matmuls, the graphed step's math: as fast as SDPA at one token on the
        # CPU, and the G query heads of a kv head need no expanded keys.
        grouped = q.view(self.kv_heads, self.heads // self.kv_heads, self.dim)  # head h reads kv h // G
        scores = torch.bmm(grouped, plan.keys[0, :, :rows].transpose(1, 2)).mul_(self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, plan.values[0, :, :rows]).reshape(1, -1)


class GraphDecodeSteps(LayerSteps):
    """One token at device position `here` ([1] int64) with shapes that never depend on it, so a
    CUDA graph can replay the step: a global layer attends over the first `span` cache rows, a local
    one over its whole ring, both under a mask by position; two batched matmuls."""

    def __init__(self, cfg: Gemma3Config, shard: Shard, here: torch.Tensor, span: int) -> None:
        super().__init__(cfg, shard)
        assert shard.key_positions is not None
        self.here, self.span = here, span
        dtype = self.local.cos.dtype
        # Rows a layer may read get 0, the others -inf: a global layer's rows up to `here`; a ring's
        # row r holds position r until the ring is full, after which every row is in the window.
        self.biases: dict[int | None, torch.Tensor] = {}
        self.ring_row: torch.Tensor | None = None  # [1]: the row `here` takes in a local layer's ring
        for plan in shard.plans:
            if plan.window in self.biases:
                continue
            rows = span if plan.window is None else plan.rows
            allowed = shard.key_positions[:rows] <= here
            bias = torch.zeros(rows, dtype=dtype, device=here.device).masked_fill_(~allowed, -torch.inf)
            self.biases[plan.window] = bias.expand(self.kv_heads, self.heads // self.kv_heads, rows)
            if plan.window is not None:
                self.ring_row = torch.remainder(here, plan.rows)

    def rope(self, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.cos.index_select(0, self.here), tables.sin.index_select(0, self.here)  # [1, D]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.kv_cache is not None and plan.keys is not None and plan.values is not None
        local = plan.window is not None
        row = self.ring_row if local else self.here
        assert row is not None
        plan.kv_cache.index_copy_(2, row, torch.stack((k, v)).transpose(1, 2))  # [2, KV, 1, D]
        rows = plan.rows if local else self.span
        kv_heads = self.kv_heads
        grouped = q.view(kv_heads, self.heads // kv_heads, self.dim)  # query head h reads kv head h // G
        scores = torch.baddbmm(
            self.biases[plan.window], grouped, plan.keys[0, :, :rows].transpose(1, 2), alpha=self.scale
        )  # [KV, G, rows]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, plan.values[0, :, :rows]).reshape(1, -1)


class VerifySteps(LayerSteps):
    """T tokens at device positions here..here+T-1 (`here`: int64 [1]) with shapes that depend on T
    and `span` only, so a CUDA graph can replay a speculative verify step. A global layer writes
    its rows and attends over the first `span` under a mask by position. A local layer attends over
    its ring as it stood before the step followed by the step's own keys (a key written into the
    ring would replace one an earlier query of the step still reads), then writes them into the
    ring: T is at most the ring (Gemma3Model.max_verify_tokens), so each takes a row of its own."""

    def __init__(self, cfg: Gemma3Config, shard: Shard, here: torch.Tensor, span: int, count: int) -> None:
        super().__init__(cfg, shard)
        assert shard.key_positions is not None
        self.span, self.count = span, count
        self.positions = here + torch.arange(count, device=here.device)  # [T]
        group = self.heads // self.kv_heads
        dtype = self.local.cos.dtype
        # Per window, 0 where query t may read key j and -inf elsewhere, [G * T, keys] (rows g * T + t
        # as attend lays the queries out); a local layer's keys are its ring rows, then the step's.
        self.biases: dict[int | None, torch.Tensor] = {}
        self.ring_rows: torch.Tensor | None = None  # [T]: the ring rows the step's positions take
        for plan in shard.plans:
            if plan.window in self.biases:
                continue
            if plan.window is None:
                keys_at = shard.key_positions[:span]
            else:
                ring = torch.arange(plan.rows, device=here.device)
                # Row r holds the latest position before `here` with residue r (negative: none yet).
                held = here - 1 - torch.remainder(here - 1 - ring, plan.rows)
                keys_at = torch.cat((held, self.positions))
                self.ring_rows = torch.remainder(self.positions, plan.rows)
            query_at = self.positions[:, None]
            allowed = (keys_at[None, :] <= query_at) & (keys_at[None, :] >= 0)
            if plan.window is not None:
                allowed &= keys_at[None, :] > query_at - plan.window
            bias = torch.zeros(allowed.shape, dtype=dtype, device=here.device)
            self.biases[plan.window] = bias.masked_fill_(~allowed, -torch.inf).repeat(group, 1)

    def rope(self, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        cos = tables.cos.index_select(0, self.positions).unsqueeze(1)  # [T, 1, D]
        return cos, tables.sin.index_select(0, self.positions).unsqueeze(1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
        assert plan.kv_cache is not None
        count, kv_heads, dim = self.count, self.kv_heads, self.dim
        group = self.heads // kv_heads
        new = torch.stack((k, v)).transpose(1, 2)  # [2, KV, T, D]
        if plan.window is None:
            plan.kv_cache.index_copy_(2, self.positions, new)
            both = plan.kv_cache[:, :, : self.span]
        else:
            assert self.ring_rows is not None
            both = torch.cat((plan.kv_cache, new), dim=2)
            plan.kv_cache.index_copy_(2, self.ring_rows, new)
        grouped = q.view(count, kv_heads, group, dim).permute(1, 2, 0, 3)  # row g * T + t, as the bias
        grouped = grouped.reshape(kv_heads, group * count, dim)
        bias = self.biases[plan.window]
        scores = torch.baddbmm(
            bias.expand(kv_heads, *bias.shape), grouped, both[0].transpose(1, 2), alpha=self.scale
        )  # [KV, G * T, keys]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs, both[1])  # [KV, G * T, D]
        return out.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, -1)
