"""Gated DeltaNet, Qwen3.5's linear-attention layer: its parameters and its forward.

A layer projects the normed hidden state into queries, keys and values (one tensor, convolved
together), a gate z, a write strength b and a decay input a. The q/k/v channels go through a
depthwise causal convolution of `conv_kernel` taps and silu; the heads then run the gated delta
rule (delta_rule.py) on a per-head state matrix; the result is RMS-normed per head, gated by
silu(z) and projected back.

What a layer carries from one position to the next (its whole "cache", the same size at any
length): the last conv_kernel - 1 inputs of the convolution, and the recurrent state matrices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.kernels.dense import gemv as dense_gemv
from ds4desk.engine.kernels.qwen3_5 import causal_conv, gated_norm, gates, linear_decode
from ds4desk.engine.models.packed import Projection, linear, projection_of
from ds4desk.engine.models.qwen3_5 import delta_rule
from ds4desk.engine.models.qwen3_5.config import Qwen35Config
from ds4desk.engine.models.qwen3_5.ops import gated_rms_norm


class _Conv(nn.Module):
    """Holds the depthwise convolution's weight [channels, 1, kernel] under the checkpoint's name."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)


class _HeadNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """The parameters, named as the checkpoint names them (`...linear_attn.*`)."""

    def __init__(self, cfg: Qwen35Config, dtype: torch.dtype, prefix: str, packed: Mapping[str, int]) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        value_width = cfg.linear_value_heads * cfg.linear_value_dim
        heads = cfg.linear_value_heads
        self.in_proj_qkv = linear(hidden, cfg.conv_channels, False, dtype, f"{prefix}.in_proj_qkv", packed)
        self.in_proj_z = linear(hidden, value_width, False, dtype, f"{prefix}.in_proj_z", packed)
        self.in_proj_b = linear(hidden, heads, False, dtype, f"{prefix}.in_proj_b", packed)
        self.in_proj_a = linear(hidden, heads, False, dtype, f"{prefix}.in_proj_a", packed)
        self.out_proj = linear(value_width, hidden, False, dtype, f"{prefix}.out_proj", packed)
        self.conv1d = _Conv(cfg.conv_channels, cfg.conv_kernel, dtype)
        self.dt_bias = nn.Parameter(torch.ones(heads, dtype=dtype), requires_grad=False)
        # A GGUF stores the rate -exp(A_log) itself (config.GGUF_LAYOUT_KEY): kept as stored, since
        # taking its log and exponent again would only add rounding.
        if cfg.gguf_layout:
            self.neg_rate = nn.Parameter(torch.full((heads,), -1.0, dtype=dtype), requires_grad=False)
        else:
            self.A_log = nn.Parameter(torch.zeros(heads, dtype=dtype), requires_grad=False)
        self.norm = _HeadNorm(cfg.linear_value_dim, dtype)


@dataclass(slots=True)
class LinearPlan:
    """What one linear-attention layer's forward reads, derived once the weights are in."""

    qkv: Projection
    z: Projection
    b: Projection
    a: Projection
    out: Projection
    conv_weight: torch.Tensor  # [channels, kernel]
    neg_rate: torch.Tensor  # -exp(A_log), float32 [heads]
    dt_bias: torch.Tensor  # float32 [heads]
    norm_weight: torch.Tensor  # [value_dim]
    # The layer's state, views into the model's state blocks (set by allocate_cache):
    conv_state: torch.Tensor | None = None  # the last kernel - 1 conv inputs [channels, kernel - 1]
    recurrent: torch.Tensor | None = None  # float32 [value heads, key_dim, value_dim]
    # While a speculative verify runs (model.verify_checkpoint .. verify_rollback): what each forward
    # fed the state, so a rejection can redo the state for the kept positions alone (roll_back).
    written: list[Written] | None = None


@dataclass(slots=True)
class Written:
    """What one forward fed a linear layer's state: per position, the convolution's input and the
    delta rule's keys, values, log-decays and write strengths (all the state depends on)."""

    conv_inputs: torch.Tensor  # [T, channels], before the convolution
    k: torch.Tensor  # [T, value heads, key_dim] float32, normed and repeated to the value heads
    v: torch.Tensor  # [T, value heads, value_dim] float32
    decay: torch.Tensor  # [T, value heads] float32
    beta: torch.Tensor  # [T, value heads] float32


def plan_of(module: GatedDeltaNet) -> LinearPlan:
    return LinearPlan(
        qkv=projection_of(module.in_proj_qkv),
        z=projection_of(module.in_proj_z),
        b=projection_of(module.in_proj_b),
        a=projection_of(module.in_proj_a),
        out=projection_of(module.out_proj),
        conv_weight=module.conv1d.weight[:, 0, :],
        neg_rate=module.neg_rate.float() if hasattr(module, "neg_rate") else -module.A_log.float().exp(),
        dt_bias=module.dt_bias.float(),
        norm_weight=module.norm.weight,
    )


def forward(
    cfg: Qwen35Config,
    plan: LinearPlan,
    x: torch.Tensor,
    residual: torch.Tensor,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's mixer over normed hidden states x [T, hidden] that continue the state in `plan`
    (updated in place), added to `residual` [T, hidden] by the output projection. One token takes the
    recurrent step, more the chunked form; both leave the same state. Returns [T, hidden]. `real`
    (int64 [1] on the device): only the first `real` rows enter the state; the others are padding
    whose outputs are garbage."""
    assert plan.conv_state is not None and plan.recurrent is not None
    count = x.shape[0]
    if count == 1 and real is None and plan.written is None and linear_decode.enabled(x):
        return plan.out.add_into(residual, _fused_step(cfg, plan, x)[None])
    conv_inputs = plan.qkv(x)
    heads = cfg.linear_value_heads
    if count > 1 and causal_conv.enabled(x):
        # One kernel from the projection's rows to the heads (kernels/qwen3_5/causal_conv.py), q and
        # k per key head (the delta rule's kernels find each value head's); the window moves after
        # it, since the kernel reads the old one. Padding rows (past `real`) get heads too, which
        # their zero gates keep out of the state.
        q, k, v = causal_conv.conv_heads(
            conv_inputs,
            plan.conv_state,
            plan.conv_weight,
            cfg.linear_key_heads,
            cfg.linear_key_dim,
            heads,
            cfg.linear_value_dim,
        )
        _keep_window(plan.conv_state, conv_inputs, real)
    else:
        q, k, v = _heads(cfg, _convolve(plan, conv_inputs, real))
    # Write strengths and log-decays [T, heads]; padding writes nothing (zero strength) and decays
    # nothing (log-decay 0), as in chunked's own.
    make_gates = gates.gates if count > 1 and gates.enabled(x) else gates.reference
    beta, decay = make_gates(plan.b(x), plan.a(x), plan.neg_rate, plan.dt_bias, real)
    interleaved = not cfg.gguf_layout
    if plan.written is not None:
        plan.written.append(
            Written(conv_inputs, delta_rule.to_value_heads(k, heads, interleaved), v, decay, beta)
        )
    if count == 1:
        core = delta_rule.step(q[0], k[0], v[0], decay[0], beta[0], plan.recurrent)[None]
    else:
        core = delta_rule.chunked(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            decay.t(),
            beta.t(),
            plan.recurrent,
            x.dtype,
            interleaved,
        ).transpose(0, 1)
    z = plan.z(x).view(count, heads, cfg.linear_value_dim)
    if gated_norm.enabled(x):  # one kernel for the prefill's rows (the float32 core rounded inside)
        normed = gated_norm.gated_rms_norm(core, z, plan.norm_weight, cfg.rms_norm_eps)
    else:
        normed = gated_rms_norm(core.to(x.dtype), z, plan.norm_weight, cfg.rms_norm_eps)
    return plan.out.add_into(residual, normed.reshape(count, -1))


def _fused_step(cfg: Qwen35Config, plan: LinearPlan, x: torch.Tensor) -> torch.Tensor:
    """The one-token forward up to the output projection with everything between the projections in
    one op (three Triton kernels on a GPU: kernels/qwen3_5/linear_decode.py), the same math as the
    eager path: the output projection's input [value width]. Not while a speculative verify records
    what it feeds the state (plan.written): that needs the keys, values and gates the op keeps to
    itself."""
    assert plan.conv_state is not None and plan.recurrent is not None
    return linear_decode.linear_decode(
        plan.qkv(x)[0],
        plan.conv_state,
        plan.conv_weight,
        plan.b(x)[0],
        plan.a(x)[0],
        plan.neg_rate,
        plan.dt_bias,
        plan.recurrent,
        plan.z(x)[0],
        plan.norm_weight,
        cfg.linear_key_heads,
        cfg.rms_norm_eps,
        cfg.gguf_layout,
    )


def _heads(cfg: Qwen35Config, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved channels [T, C] as the delta rule reads them (causal_conv.per_key_head), q and k
    repeated to the value heads: value head h reads key head h // repeat in Hugging Face's order,
    h % key heads in a GGUF's (config.GGUF_LAYOUT_KEY)."""
    heads = cfg.linear_value_heads
    q, k, v = causal_conv.per_key_head(
        mixed, cfg.linear_key_heads, cfg.linear_key_dim, heads, cfg.linear_value_dim
    )
    interleaved = not cfg.gguf_layout
    return (
        delta_rule.to_value_heads(q, heads, interleaved),
        delta_rule.to_value_heads(k, heads, interleaved),
        v,
    )


def _keep_window(window: torch.Tensor, inputs: torch.Tensor, real: torch.Tensor | None = None) -> None:
    """The convolution's window [C, kept] after the rows inputs [T, C]: their last `kept` inputs (of
    the first `real` rows, found on the device)."""
    count, kept = inputs.shape[0], window.shape[1]
    if real is None and count >= kept:
        window.copy_(inputs[count - kept :].t())
    else:
        _keep_from(window, torch.cat((window, inputs.t()), dim=1), real)


def _keep_from(window: torch.Tensor, extended: torch.Tensor, real: torch.Tensor | None) -> None:
    """The window [C, kept] set to the `kept` columns of extended [C, kept + T] (the window, then the
    inputs) that end at its last column, or at the last real input."""
    kept = window.shape[1]
    if real is None:
        window.copy_(extended[:, -kept:])
    else:
        window.copy_(extended.index_select(1, real + torch.arange(kept, device=real.device)))


def _convolve(plan: LinearPlan, mixed: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise causal convolution and silu over [T, channels], continuing from the kept window
    (zeros at position 0), which then holds the last kernel - 1 inputs (of the first `real` rows)."""
    assert plan.conv_state is not None
    extended = torch.cat((plan.conv_state, mixed.t()), dim=1)  # [channels, kept + T]
    if mixed.shape[0] == 1:
        # One token: a multiply-add over the taps, no conv launch (and shapes a graph can keep).
        out = (extended * plan.conv_weight).sum(dim=1, keepdim=True)
    else:
        out = F.conv1d(extended[None], plan.conv_weight[:, None, :], groups=extended.shape[0])[0]
    _keep_from(plan.conv_state, extended, real)
    # Contiguous rows, as causal_conv.reference makes them: the q/k norms after it then sum in the
    # same order on both paths.
    return F.silu(out).t().contiguous()


def roll_back(plan: LinearPlan, window: torch.Tensor, recurrent: torch.Tensor, kept: int) -> None:
    """A speculative verify's rejected tail undone: the state as it was before the verify (`window`,
    `recurrent`, copies taken then), advanced over the first `kept` positions fed since (plan.written)
    and no further. The convolution window is the last kernel - 1 of its inputs; the recurrent
    matrix runs the delta rule over the kept positions' keys, values and gates, as the forward did."""
    assert plan.conv_state is not None and plan.recurrent is not None
    plan.conv_state.copy_(window)
    plan.recurrent.copy_(recurrent)
    written = plan.written or []
    if kept == 0:
        return
    inputs, k, v, decay, beta = (
        torch.cat([getattr(w, name) for w in written])[:kept]
        for name in ("conv_inputs", "k", "v", "decay", "beta")
    )
    if k.shape[0] != kept:
        raise ValueError(f"cannot keep {kept} positions of a verify that fed {k.shape[0]}")
    kept_columns = plan.conv_state.shape[1]
    plan.conv_state.copy_(torch.cat((plan.conv_state, inputs.t()), dim=1)[:, -kept_columns:])
    if kept == 1:  # the outputs (queries) are not needed: the keys stand in for them
        delta_rule.step(k[0], k[0], v[0], decay[0], beta[0], plan.recurrent)
    else:
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        delta_rule.chunked(k, k, v, decay.t(), beta.t(), plan.recurrent, plan.conv_weight.dtype)


def fits_one_row_kernels(plan: LinearPlan) -> bool:
    """Whether every projection of the layer is a float weight the one-row GEMV kernels take."""
    projections = (plan.qkv, plan.z, plan.b, plan.a, plan.out)
    return all(p.weight_t is not None and dense_gemv.fits(p.weight_t.t()) for p in projections)


def decode_on_kernels(
    cfg: Qwen35Config, plan: LinearPlan, x: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """The graphable decode step's mixer on the GPU kernels, residual included: x [1, hidden] (the
    layer's input, updated in place) += out_proj(mixer(RMSNorm(x) * scale)). Each input projection
    folds the norm in (kernels/dense/gemv.norm_gemv), the state update is the fused op, and the
    output projection adds into x (gemv_add_): seven launches where the eager step has ~20."""
    assert plan.conv_state is not None and plan.recurrent is not None

    def project(projection: Projection) -> torch.Tensor:
        assert projection.weight_t is not None
        out = x.new_empty((1, projection.rows))
        return dense_gemv.norm_gemv(x, scale, projection.weight_t.t(), None, eps, out)[0]

    core = linear_decode.linear_decode(
        project(plan.qkv),
        plan.conv_state,
        plan.conv_weight,
        project(plan.b),
        project(plan.a),
        plan.neg_rate,
        plan.dt_bias,
        plan.recurrent,
        project(plan.z),
        plan.norm_weight,
        cfg.linear_key_heads,
        cfg.rms_norm_eps,
        cfg.gguf_layout,
    )
    assert plan.out.weight_t is not None
    return dense_gemv.gemv_add_(x, core[None], plan.out.weight_t.t(), None, silu=False)
