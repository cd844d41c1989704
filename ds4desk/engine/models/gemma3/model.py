"""Gemma 3 text (transformers' Gemma3ForCausalLM, config model_type `gemma3_text`): the modules,
loading, placement and cache (global layers keep every position, local layers a ring of their
window, see layer.py). The layer's forward is in layer.py.

Parameter names equal transformers' state-dict names, so a checkpoint loads by name. Every linear
and the embedding are built through models/packed.py, so a GGUF file's quantized weights stay in
their block types; layers only ever call `Projection`s. Where q/k/v (and gate/up) are all float,
`materialize` lays them out as row ranges of one tensor, so a step runs one matmul for them, never
a copy of a weight (the loader copies into the parameters, never `Module.to()`).

Shapes inside `forward` drop the batch dimension (batch is always 1): activations are [T, hidden].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds4desk.engine.models import base  # base.hand_over looked up per call: one place to spy on
from ds4desk.engine.models.base import CausalLM, CenteredNorm, LogitsMode, load_failure
from ds4desk.engine.models.gemma3.config import Gemma3Config
from ds4desk.engine.models.gemma3.layer import (
    EagerDecodeSteps,
    GraphDecodeSteps,
    LayerPlan,
    LayerSteps,
    PrefillSteps,
    RopeTables,
    Shard,
    VerifySteps,
    rms_norm,
)
from ds4desk.engine.models.packed import (
    Fused,
    Projection,
    embed,
    embedding,
    fuse_group,
    group_projection,
    linear,
    projection_of,
)
from ds4desk.engine.split import host_block, materialize_parameters


class Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        q, kv, hidden, bias = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.hidden_size,
            cfg.attention_bias,
        )
        self.q_proj = linear(hidden, q, bias, dtype, f"{prefix}.q_proj", packed)
        self.k_proj = linear(hidden, kv, bias, dtype, f"{prefix}.k_proj", packed)
        self.v_proj = linear(hidden, kv, bias, dtype, f"{prefix}.v_proj", packed)
        self.o_proj = linear(q, hidden, bias, dtype, f"{prefix}.o_proj", packed)
        self.q_norm = CenteredNorm(cfg.head_dim, dtype)
        self.k_norm = CenteredNorm(cfg.head_dim, dtype)


class MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(h, f, False, dtype, f"{prefix}.gate_proj", packed)
        self.up_proj = linear(h, f, False, dtype, f"{prefix}.up_proj", packed)
        self.down_proj = linear(f, h, False, dtype, f"{prefix}.down_proj", packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype, f"{prefix}.self_attn", packed)
        self.mlp = MLP(cfg, dtype, f"{prefix}.mlp", packed)
        self.input_layernorm = CenteredNorm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = CenteredNorm(cfg.hidden_size, dtype)
        self.pre_feedforward_layernorm = CenteredNorm(cfg.hidden_size, dtype)
        self.post_feedforward_layernorm = CenteredNorm(cfg.hidden_size, dtype)
        # Set by materialize: "qkv" / "gate_up" -> the fused (weight, bias) the float parts view.
        self.fused: dict[str, Fused] = {}


class Backbone(nn.Module):
    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype, packed: Mapping[str, int]) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, dtype, "model.embed_tokens", packed)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, f"model.layers.{i}", packed) for i in range(cfg.num_layers)
        )
        self.norm = CenteredNorm(cfg.hidden_size, dtype)


class Gemma3Model(CausalLM):
    """The CausalLM of Gemma 3 text, with a preallocated KV cache (base.py has the call order)."""

    config: Gemma3Config

    # Prefill attention shaped for fused GPU kernels (layer.PrefillSteps: kv heads repeated, the
    # causal flag); set per device by finish_loading. The CPU keeps the grouped layout (no copies).
    fused_attention = False

    def __init__(
        self,
        config: Gemma3Config,
        dtype: torch.dtype = torch.float32,
        packed: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(config, dtype)
        packed = packed or {}
        self.model = Backbone(config, dtype, packed)
        if not config.tie_word_embeddings:  # else None (base): the embedding is the head
            self.lm_head = linear(config.hidden_size, config.vocab_size, False, dtype, "lm_head", packed)
        # The reference scales embeddings by sqrt(hidden) rounded to the model dtype (55.4256 is 55.5
        # in bfloat16); a Python float of that rounded value multiplies exactly as its tensor does.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, device="cpu").to(dtype))
        self._plans: list[LayerPlan] = []
        self._shards: list[Shard] = []
        self._head: Projection | None = None
        self._final_norm: torch.Tensor | None = None
        self._inv_freq: dict[str, torch.Tensor] = {}

    # --- loading -----------------------------------------------------------------------------

    def materialize(self, device: torch.device) -> None:
        """Real (uninitialised) storage on `device` (or where the split puts each layer), with float
        q/k/v and gate/up laid out as row ranges of one tensor each."""
        split = self._split
        layer_devices = [device] * self.config.num_layers
        if split is not None:
            layer_devices = [torch.device(d) for d in split.layer_devices()]
        block = host_block(self, device, split)
        for layer, where in zip(self.model.layers, layer_devices, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            for key, parts in (
                ("qkv", (attn.q_proj, attn.k_proj, attn.v_proj)),
                ("gate_up", (mlp.gate_proj, mlp.up_proj)),
            ):
                if all(type(part) is nn.Linear for part in parts):  # float groups only
                    layer.fused[key] = fuse_group(parts, where, block=block)
        materialize_parameters(self, device, split, block)

    def finish_loading(self) -> None:
        """After the weights are in: the per-layer plans, rope frequencies, norm scales and head."""
        cfg = self.config
        self._plans = [self._plan(index, layer) for index, layer in enumerate(self.model.layers)]
        bounds = self._split.bounds() if self._split is not None else [(0, cfg.num_layers)]
        self._shards = [
            Shard(self._plans[start].input_norm.device, self._plans[start:stop], index == 0)
            for index, (start, stop) in enumerate(bounds)
        ]
        self._final_norm = _scale(self.model.norm)
        self.fused_attention = self.device.type == "cuda"
        self.copy_tied_head()
        self._head = self.head_projection()
        self._inv_freq = {
            "local": cfg.local_rope.inverse_frequencies(cfg.head_dim, self.device),
            "global": cfg.global_rope.inverse_frequencies(cfg.head_dim, self.device),
        }
        if self._context:
            self.allocate_cache(self._context)

    def _plan(self, index: int, layer: DecoderLayer) -> LayerPlan:
        cfg = self.config
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = _scale(attn.q_norm), _scale(attn.k_norm)
        return LayerPlan(
            input_norm=_scale(layer.input_layernorm),
            qkv=group_projection((attn.q_proj, attn.k_proj, attn.v_proj), layer.fused.get("qkv")),
            # One [H + KV, D] scale lets a single multiply normalise query and key heads together.
            qk_norm=torch.cat([q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)]),
            o=projection_of(attn.o_proj),
            post_attention_norm=_scale(layer.post_attention_layernorm),
            pre_feedforward_norm=_scale(layer.pre_feedforward_layernorm),
            gate_up=group_projection((mlp.gate_proj, mlp.up_proj), layer.fused.get("gate_up")),
            down=projection_of(mlp.down_proj),
            post_feedforward_norm=_scale(layer.post_feedforward_layernorm),
            window=cfg.sliding_windows[index],
        )

    # --- cache -------------------------------------------------------------------------------

    def allocate_cache(self, context: int) -> None:
        """Allocate the KV cache and both rope tables for `context` positions (replacing any old one)."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        if not self._inv_freq:
            raise RuntimeError("allocate_cache before finish_loading")
        self.free_cache()
        device = self.device
        for shard in self._shards:
            # One zeroed block per kind and shard: few allocations, and no stale NaN meets a mask.
            local = [plan for plan in shard.plans if plan.window is not None]
            glob = [plan for plan in shard.plans if plan.window is None]
            if glob:
                shard.global_cache = self._cache_block(len(glob), context, shard.device)
            if local:
                ring = self.ring_rows(context)
                shard.local_cache = self._cache_block(len(local), ring, shard.device)
            for plans, block in ((glob, shard.global_cache), (local, shard.local_cache)):
                for i, plan in enumerate(plans):
                    assert block is not None
                    plan.kv_cache = block[i]
                    plan.keys = block[i, 0].unsqueeze(0)
                    plan.values = block[i, 1].unsqueeze(0)
        positions = torch.arange(context, device=device, dtype=torch.float32)
        tables = {kind: _rope_tables(positions, inv, self.dtype) for kind, inv in self._inv_freq.items()}
        key_positions = torch.arange(context, device=device)
        # Other devices get copies of the first device's tables: every shard rotates by identical angles.
        for shard in self._shards:
            moved = {k: RopeTables(t.cos.to(shard.device), t.sin.to(shard.device)) for k, t in tables.items()}
            shard.local, shard.global_ = moved["local"], moved["global"]
            shard.key_positions = key_positions.to(shard.device)
        self._context = context

    def _cache_block(self, layers: int, rows: int, device: torch.device) -> torch.Tensor:
        cfg = self.config
        shape = (layers, 2, cfg.num_kv_heads, rows, cfg.head_dim)
        return torch.zeros(shape, device=device, dtype=self.dtype)

    def ring_rows(self, context: int) -> int:
        """The rows of a local layer's ring: its window, or the context when that is shorter."""
        windows = {w for w in self.config.sliding_windows if w is not None}
        assert len(windows) <= 1  # config.json has one sliding_window
        return min(context, *windows) if windows else 0

    def free_cache(self) -> None:
        for plan in self._plans:
            plan.kv_cache = plan.keys = plan.values = None
        for shard in self._shards:
            shard.global_cache = shard.local_cache = None
            shard.local = shard.global_ = shard.key_positions = None
        self._context = 0

    def cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for s in self._shards for c in s.caches())

    def layer_cache_bytes_for(self, context: int) -> list[int]:
        """Every layer's keys and values: `context` rows for a global layer, its ring for a local one."""
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_row = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
        ring = self.ring_rows(context)
        return [per_row * (context if w is None else ring) for w in cfg.sliding_windows]

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """What positions 0..length-1 left, `length` being the current length (a ring keeps only the
        last window, so an earlier prefix is gone): every global layer's rows 0..length-1 and every
        local layer's ring rows as they lie (position p in row p % ring), on the host, in layer order."""
        if not self._context:
            raise RuntimeError("export_state before allocate_cache")
        state: dict[str, torch.Tensor] = {}
        for key, rows in (("global", length), ("local", min(length, self.ring_rows(self._context)))):
            parts = [b[:, :, :, :rows].to("cpu", copy=True) for b in self._blocks(key)]
            if parts:
                state[f"kv_{key}"] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return state

    def import_state(self, state: dict[str, torch.Tensor], length: int) -> None:
        """The inverse of export_state; attention never reads past `length`, so nothing else to reset.
        Ring rows keep their meaning across contexts: a state that fits the context fits the ring."""
        if not self._context:
            raise RuntimeError("import_state before allocate_cache")
        for key, rows in (("global", length), ("local", min(length, self.ring_rows(self._context)))):
            blocks = self._blocks(key)
            if not blocks:
                continue
            kv = state.get(f"kv_{key}")
            layers = sum(b.shape[0] for b in blocks)
            if kv is None or kv.shape[0] != layers or kv.shape[3] != rows:
                shape = None if kv is None else list(kv.shape)
                raise ValueError(f"a {key} state of shape {shape} is not {length} positions of this model")
            start = 0
            for block in blocks:
                stop = start + block.shape[0]
                block[:, :, :, :rows].copy_(kv[start:stop])  # onto the shard's device
                start = stop

    def _blocks(self, key: str) -> list[torch.Tensor]:
        """Every shard's cache block of one kind ("global" / "local"), in layer order."""
        found = (s.global_cache if key == "global" else s.local_cache for s in self._shards)
        return [b for b in found if b is not None]

    # --- speculative decoding (speculative/rollback.py) ---------------------------------------

    # Global layers keep a row per position (nothing to undo); a local layer's ring row p % ring
    # held position p - ring before a verify wrote p, and a later step inside the window reads it.
    supports_speculation = True

    def max_verify_tokens(self) -> int | None:
        """A verify never wraps the ring, so every position it writes has a row of its own to put back."""
        ring = self.ring_rows(self._context)
        return ring or None

    def verify_checkpoint(self, start_pos: int, count: int) -> list[torch.Tensor]:
        """The ring rows positions start_pos.. will overwrite, one copy per shard's local block."""
        ring = self.ring_rows(self._context)
        if not ring:
            return []
        if count > ring:
            raise ValueError(f"a verify of {count} positions would wrap the ring of {ring} rows")
        saved = []
        for block in self._blocks("local"):
            rows = torch.arange(start_pos, start_pos + count, device=block.device) % ring
            saved.append(block.index_select(3, rows))
        return saved

    def verify_rollback(self, saved: list[torch.Tensor], start_pos: int, kept: int) -> None:
        """Put back the rows of the dead positions start_pos+kept.. from the checkpoint."""
        ring = self.ring_rows(self._context)
        for block, rows_saved in zip(self._blocks("local"), saved, strict=True):
            count = rows_saved.shape[3]
            if kept >= count:
                continue
            rows = torch.arange(start_pos + kept, start_pos + count, device=block.device) % ring
            block.index_copy_(3, rows, rows_saved[:, :, :, kept:])

    # --- running -----------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, logits: LogitsMode = "last"
    ) -> torch.Tensor | None:
        """Run tokens at positions start_pos.. through the model, writing their keys/values into the
        cache. Returns float32 logits: [V] for "last", [T, V] for "all", None for "none"."""
        if not self._context:
            raise RuntimeError("forward before allocate_cache")
        count = input_ids.shape[0]
        self.check_positions(start_pos, count)
        x = self._embed(input_ids.to(self.device))
        for shard in self._shards:
            if not shard.first:
                x = base.hand_over(x, shard.device)
            steps: LayerSteps
            if count == 1:
                steps = EagerDecodeSteps(self.config, shard, start_pos)
            else:
                steps = PrefillSteps(self.config, shard, start_pos, count, self.fused_attention)
            for plan in shard.plans:
                x = steps.layer(x, plan)
        if logits == "none":
            return None
        out = self._logits(x[-1:] if logits == "last" else x)
        if out.device != input_ids.device:
            out = out.to(input_ids.device)
        return out[0] if logits == "last" else out

    def decode_devices(self) -> list[torch.device]:
        return [shard.device for shard in self._shards]

    def verify_graphable(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor | None:
        """See CausalLM.verify_graphable: one shard only (a split verifies eagerly)."""
        if len(self._shards) != 1:
            return None
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        shard = self._shards[0]
        x = self._embed(tokens)
        steps = VerifySteps(self.config, shard, pos, span, tokens.shape[0])
        for plan in shard.plans:
            x = steps.layer(x, plan)
        return self._logits(x)

    def decode_shard(
        self, index: int, inputs: tuple[torch.Tensor, ...], span: int
    ) -> tuple[torch.Tensor, ...]:
        """Shard `index`'s part of decode_graphable: the first shard takes (token, pos), every later
        one the previous one's (hidden, pos); the last returns (logits,), the others (hidden, pos)."""
        if not 0 < span <= self._context:
            raise ValueError(f"span must be in 1..{self._context}, got {span}")
        shard = self._shards[index]
        if index == 0:
            token, here = inputs
            x = self._embed(token)
        else:
            x, here = inputs
        steps = GraphDecodeSteps(self.config, shard, here, span)
        for plan in shard.plans:
            x = steps.layer(x, plan)
        if index + 1 < len(self._shards):
            return x, here
        return (self._logits(x)[0],)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embed(self.model.embed_tokens, ids) * self.embed_scale

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head over hidden states [T, hidden]: float32 [T, V], soft-capped when the
        config says so."""
        assert self._head is not None and self._final_norm is not None
        out = self._head(rms_norm(x, self._final_norm, self.config.rms_norm_eps)).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out


def _scale(norm: CenteredNorm) -> torch.Tensor:
    """Gemma's norm factor: 1 + weight, in float32 (the reference adds in float32)."""
    return 1.0 + norm.weight.float()


def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> RopeTables:
    """cos / sin [context, D] as the reference makes them: float32 angles, cast to the model dtype."""
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return RopeTables(angles.cos().to(dtype), angles.sin().to(dtype))


def build(
    config: dict[str, Any],
    family: str,
    dtype: torch.dtype,
    quantized: bool = False,
    packed: Mapping[str, int] | None = None,
) -> Gemma3Model:
    """The registry's entry point: Gemma 3 text for a config.json dict, with the `packed` weights
    kept in their GGUF block types (models/packed.py)."""
    if quantized:
        raise load_failure(f"the {family} family does not keep FP8 / FP4 weights packed")
    return Gemma3Model(Gemma3Config.from_hf(config), dtype, packed)
