"""Qwen3.5's linear-attention decode step after its projections, as one op: `linear_decode`.

A Gated DeltaNet layer's decode step, once its input projections are done, is: the depthwise causal
convolution of the q/k/v channels over the kept window (which then shifts by one), silu; unit-length
queries and keys (the queries also scaled by dk^-1/2), repeated from the key heads to the value
heads; the write strength sigmoid(b) and the log-decay -exp(A_log) softplus(a + dt_bias); the gated
delta rule's update of each value head's state matrix and its output; and the per-head RMSNorm of
that output gated by silu(z). Eagerly (models/qwen3_5/linear_attention.py) that is ~35 small ops a
layer, each a launch of a few µs inside a CUDA graph at batch 1.

On NVIDIA GPUs with Triton it is three kernels: the convolution over channel blocks (each program owns
its channels' window, so the in-place shift has no reader elsewhere); the delta rule over (value head,
block of 32 state columns), every column of a head's state being independent, so each state value is
read once and written once by 128 programs at Qwen3.5-9B's shapes with the tile in registers; then the
gated norm over whole heads (gated_norm.py's kernel). The queries and keys of a key head are read by
every value head that shares it, which is why the convolution is its own launch: a shared window
shifted in place by one program while another still reads it would be a race; and the norm needs a
whole head, which the column blocks split. Elsewhere (CPU, ROCm, no Triton) `reference` runs, the
model's eager math op for op.

The launches sit inside one torch custom op (mutating the window and the state), so a CUDA graph
capture and a dispatch-level op counter see one op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds4desk.engine.kernels.launch import Switch, Where, next_power_of_two, nvidia, on_its_device
from ds4desk.engine.kernels.qwen3_5 import gated_norm

# Default: the kernels where they can run (NVIDIA CUDA tensors, Triton importable). Forced on: always
# through the custom op (on the CPU its body is `reference`); off: the model's own eager ops.
SWITCH = Switch(
    "qwen3_5.linear_decode",
    "Qwen3.5's linear-attention decode step (conv window, q/k norms, gated delta rule, gated norm) "
    "as three kernels",
    lambda where: nvidia(where) and _triton_kernel() is not None,
)

# unit_rows' epsilon: the q/k L2 norm's, fixed by the reference.
NORM_EPS = 1e-6
# torch's softplus turns linear above this input (F.softplus's default threshold).
SOFTPLUS_THRESHOLD = 20.0


def enabled(where: Where) -> bool:
    """Whether the model's decode step should call `linear_decode` for tensors on `where`."""
    return SWITCH.on(where)


def linear_decode(
    conv_inputs: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    key_heads: int,
    eps: float,
    tiled: bool,
) -> torch.Tensor:
    """One token's linear-attention mixer after the projections, up to (not including) out_proj.

    conv_inputs [C] (the qkv projection, C = 2 key_heads dk + H dv); window [C, kernel - 1] and
    conv_weight [C, kernel] in the model's dtype; b, a [H] (the beta and alpha projections); neg_rate
    (-exp(A_log)) and dt_bias [H] float32; state [H, dk, dv] float32; z [H dv]; norm_weight [dv].
    `tiled`: value head h reads key head h % key_heads (a GGUF's order), else h // (H / key_heads).
    The window and the state are updated in place. Returns [H dv] in z's dtype (the gated, normed
    output, what out_proj takes). Always the custom op (see `enabled`)."""
    _check(conv_inputs, window, conv_weight, b, a, neg_rate, dt_bias, state, z, norm_weight, key_heads)
    return _fused_op(
        conv_inputs,
        window,
        conv_weight,
        b,
        a,
        neg_rate,
        dt_bias,
        state,
        z,
        norm_weight,
        key_heads,
        eps,
        tiled,
    )


def reference(
    conv_inputs: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    key_heads: int,
    eps: float,
    tiled: bool,
) -> torch.Tensor:
    """The eager form: models/qwen3_5/linear_attention.forward's one-token path (its _convolve,
    delta_rule.unit_rows / step and ops.gated_rms_norm) op for op."""
    heads, dk, dv = state.shape
    extended = torch.cat((window, conv_inputs[:, None]), dim=1)  # [C, kernel]
    convolved = (extended * conv_weight).sum(dim=1)
    window.copy_(extended[:, 1:])
    mixed = F.silu(convolved)
    key_width = key_heads * dk
    q, k, v = mixed.split([key_width, key_width, heads * dv])
    q = unit_rows(q.view(key_heads, dk)) * dk**-0.5
    k = unit_rows(k.view(key_heads, dk))
    repeat = heads // key_heads
    if repeat > 1 and tiled:
        q, k = q.repeat(repeat, 1), k.repeat(repeat, 1)
    elif repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=0), k.repeat_interleave(repeat, dim=0)
    v = v.view(heads, dv).float()
    beta = torch.sigmoid(b).float()
    g = neg_rate * F.softplus(a.float() + dt_bias)
    decayed = state * g.exp()[:, None, None]
    predicted = torch.einsum("hkv,hk->hv", decayed, k)
    write = (v - predicted) * beta[:, None]
    new_state = decayed + k[:, :, None] * write[:, None, :]
    state.copy_(new_state)
    core = torch.einsum("hkv,hk->hv", new_state, q).to(z.dtype)
    normed = F.rms_norm(core.float(), (dv,), None, eps).to(z.dtype) * norm_weight
    gated = normed.float() * F.silu(z.view(heads, dv).float())
    return gated.to(z.dtype).reshape(heads * dv)


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dimension, in float32: the q/k scaling of every path."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + NORM_EPS)


def _check(
    conv_inputs: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    key_heads: int,
) -> None:
    if state.dim() != 3 or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [heads, dk, dv], got {state.dtype} {tuple(state.shape)}")
    heads, dk, dv = state.shape
    if key_heads <= 0 or heads % key_heads:
        raise ValueError(f"{heads} value heads are not a multiple of {key_heads} key heads")
    channels = 2 * key_heads * dk + heads * dv
    if conv_inputs.shape != (channels,):
        raise ValueError(f"conv_inputs must be [{channels}], got {tuple(conv_inputs.shape)}")
    kernel = conv_weight.shape[-1]
    if conv_weight.shape != (channels, kernel) or kernel < 2 or window.shape != (channels, kernel - 1):
        raise ValueError(
            f"conv_weight [{channels}, kernel >= 2] and window [{channels}, kernel - 1] expected, got "
            f"{tuple(conv_weight.shape)} and {tuple(window.shape)}"
        )
    for name, t in (("b", b), ("a", a), ("neg_rate", neg_rate), ("dt_bias", dt_bias)):
        if t.shape != (heads,):
            raise ValueError(f"{name} must be [{heads}], got {tuple(t.shape)}")
    if neg_rate.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        raise ValueError("neg_rate and dt_bias are float32")
    if z.shape != (heads * dv,) or norm_weight.shape != (dv,):
        raise ValueError(f"z must be [{heads * dv}] and norm_weight [{dv}]")


@torch.library.custom_op("ds4desk::qwen35_linear_decode", mutates_args=("window", "state"))
def _fused_op(
    conv_inputs: torch.Tensor,
    window: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    neg_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    key_heads: int,
    eps: float,
    tiled: bool,
) -> torch.Tensor:
    kernel = _triton_kernel() if SWITCH.kernel_runs_on(state) else None
    run = reference if kernel is None else kernel
    return run(
        conv_inputs,
        window,
        conv_weight,
        b,
        a,
        neg_rate,
        dt_bias,
        state,
        z,
        norm_weight,
        key_heads,
        eps,
        tiled,
    )


@_fused_op.register_fake
def _(
    conv_inputs, window, conv_weight, b, a, neg_rate, dt_bias, state, z, norm_weight, key_heads, eps, tiled
):
    return z.new_empty(z.shape)


# Channels a convolution program owns: a few warps' worth, so the C = 8192 of Qwen3.5-9B's layers
# spread over 32 programs.
CONV_BLOCK = 256


def conv_constants(channels: int, kernel: int) -> dict[str, Any]:
    return {
        "KERNEL": kernel,
        "TAPS": next_power_of_two(kernel),
        "BLOCK": min(CONV_BLOCK, next_power_of_two(channels)),
    }


# State columns a delta-rule program owns: each value column of a head's state runs independently, so
# a head splits over column blocks; 32 columns of 128 rows keep the tile in registers (no spills) and
# spread Qwen3.5-9B's 32 heads over 128 programs.
DELTA_COLUMNS = 32


def delta_constants(key_heads: int, heads: int, dk: int, dv: int, tiled: bool) -> dict[str, Any]:
    return {
        "DK": dk,
        "DV": dv,
        "BLOCK_K": next_power_of_two(dk),
        "BLOCK_V": min(DELTA_COLUMNS, next_power_of_two(dv)),
        "REPEAT": heads // key_heads,
        "KEY_HEADS": key_heads,
        "TILED": tiled,
    }


def delta_warps(dk: int, dv: int) -> int:
    # The state tile [dk, BLOCK_V] lives in registers: 32 float32 values a lane at 128 x 32, 4 warps.
    block_v = min(DELTA_COLUMNS, next_power_of_two(dv))
    return max(1, min(4, next_power_of_two(dk) * block_v // 1024))


@functools.cache
def _jit_kernels() -> tuple[Any, Any] | None:
    """The convolution and delta-rule kernels (triton.jit functions); None without Triton."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton (CPU builds, some platforms): the eager form runs
        return None

    @triton.jit
    def conv_kernel(
        x,  # [C] the step's convolution inputs
        window,  # [C, KERNEL - 1], shifted in place
        weight,  # [C, KERNEL]
        mixed,  # [C] out: silu of the convolution, x's dtype
        channels,
        window_stride,
        weight_stride,
        KERNEL: tl.constexpr,
        TAPS: tl.constexpr,  # KERNEL rounded up to a power of two
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, TAPS)
        inside = c < channels
        dtype = x.dtype.element_ty
        # The window and the step's input as one [BLOCK, TAPS] tile (tap KERNEL - 1 is the input), and
        # the same shifted by one: both read before anything is written, since lanes may hold copies
        # of the same channels and one must not shift a window another has yet to read.
        newest = tl.load(x + c, mask=inside, other=0.0)[:, None]
        rows = window + c[:, None] * window_stride
        kept = inside[:, None] & (j[None, :] < KERNEL - 1)
        taps = tl.where(j[None, :] == KERNEL - 1, newest, tl.load(rows + j[None, :], mask=kept, other=0.0))
        after = inside[:, None] & (j[None, :] < KERNEL - 2)
        shifted = tl.where(
            j[None, :] == KERNEL - 2, newest, tl.load(rows + j[None, :] + 1, mask=after, other=0.0)
        )
        taps_in = inside[:, None] & (j[None, :] < KERNEL)
        w = tl.load(weight + c[:, None] * weight_stride + j[None, :], mask=taps_in, other=0.0)
        # The products are rounded to the model's dtype before the sum, as the eager multiply-add's are
        # (the arithmetic itself in float32: Triton's interpreter has no bf16 arithmetic).
        products = (taps.to(tl.float32) * w.to(tl.float32)).to(dtype).to(tl.float32)
        out = tl.sum(products, axis=1).to(dtype).to(tl.float32)
        tl.debug_barrier()
        tl.store(rows + j[None, :], shifted, mask=kept)
        silu = out / (1.0 + tl.exp(-out))
        tl.store(mixed + c, silu.to(mixed.dtype.element_ty), mask=inside)

    @triton.jit
    def delta_kernel(
        mixed,  # [C]: q of every key head, k of every key head, v of every value head
        b,  # [H]
        a,  # [H]
        neg_rate,  # [H] float32
        dt_bias,  # [H] float32
        state,  # [H, DK, DV] float32, updated in place
        core,  # [H * DV] out, float32: the heads' outputs before the gated norm
        q_scale,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,  # the state columns a program owns
        REPEAT: tl.constexpr,
        KEY_HEADS: tl.constexpr,
        TILED: tl.constexpr,
    ):
        h = tl.program_id(0)
        kh = h % KEY_HEADS if TILED else h // REPEAT  # the key head value head h reads
        ik = tl.arange(0, BLOCK_K)
        iv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        has_k = ik < DK
        has_v = iv < DV
        # Every arithmetic step in float32 (Triton's interpreter has no bf16 arithmetic).
        q = tl.load(mixed + kh * DK + ik, mask=has_k, other=0.0).to(tl.float32)
        k = tl.load(mixed + KEY_HEADS * DK + kh * DK + ik, mask=has_k, other=0.0).to(tl.float32)
        v = tl.load(mixed + 2 * KEY_HEADS * DK + h * DV + iv, mask=has_v, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        # beta: the sigmoid rounded to the model's dtype, as the eager path rounds it.
        b_h = tl.load(b + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b_h))).to(b.dtype.element_ty).to(tl.float32)
        x = tl.load(a + h).to(tl.float32) + tl.load(dt_bias + h)
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
        decay = tl.exp(tl.load(neg_rate + h) * softplus)

        tile = state + h * DK * DV + ik[:, None] * DV + iv[None, :]
        both = has_k[:, None] & has_v[None, :]
        s = tl.load(tile, mask=both, other=0.0) * decay
        predicted = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]
        write = (v - predicted) * beta
        s = s + k[:, None] * write[None, :]
        tl.store(tile, s, mask=both)
        tl.store(core + h * DV + iv, tl.sum(s * q[:, None], axis=0), mask=has_v)

    return conv_kernel, delta_kernel


@functools.cache
def _triton_kernel() -> Callable[..., torch.Tensor] | None:
    """The launcher of the three kernels, or None where Triton is not importable."""
    kernels = _jit_kernels()
    if kernels is None:
        return None
    conv_kernel, delta_kernel = kernels

    def launch(
        conv_inputs: torch.Tensor,
        window: torch.Tensor,
        conv_weight: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        neg_rate: torch.Tensor,
        dt_bias: torch.Tensor,
        state: torch.Tensor,
        z: torch.Tensor,
        norm_weight: torch.Tensor,
        key_heads: int,
        eps: float,
        tiled: bool,
    ) -> torch.Tensor:
        heads, dk, dv = state.shape
        channels, kernel = conv_weight.shape
        assert window.stride(1) == 1 and conv_weight.stride(1) == 1 and state.is_contiguous()
        conv_inputs, b, a, z = (t.contiguous() for t in (conv_inputs, b, a, z))
        mixed = torch.empty_like(conv_inputs)
        constants = conv_constants(channels, kernel)
        conv_kernel[(triton_cdiv(channels, constants["BLOCK"]),)](
            conv_inputs,
            window,
            conv_weight,
            mixed,
            channels,
            window.stride(0),
            conv_weight.stride(0),
            **constants,
            num_warps=4,
        )
        core = torch.empty((heads * dv,), device=state.device, dtype=torch.float32)
        constants = delta_constants(key_heads, heads, dk, dv, tiled)
        delta_kernel[(heads, triton_cdiv(dv, constants["BLOCK_V"]))](
            mixed,
            b,
            a,
            neg_rate,
            dt_bias,
            state,
            core,
            dk**-0.5,
            **constants,
            num_warps=delta_warps(dk, dv),
        )
        # The per-head norm needs the whole head, which the column blocks split: its own kernel.
        return gated_norm.norm_kernel()(core.view(heads, dv), z.view(heads, dv), norm_weight, eps).view(-1)

    return on_its_device(launch)


def triton_cdiv(n: int, block: int) -> int:
    return -(-n // block)
