"""Float weights to GGUF blocks, on load: what lets a 16-bit model run as Q8_0 or Q4_K.

`quantize` turns a float [rows, cols] weight into the uint8 [rows, row_bytes] GGML blocks that
models/packed.py holds and kernels/quant/gguf_matmul.py multiplies, the same bytes a GGUF file
would store; quant/gguf.py's `dequantize` is the reference that reads them back. It works in
float32 on the weight's own device, a slice of rows at a time, so a large weight never needs more
than a few slices' worth of scratch memory beside it.

Q8_0 is GGML's own rounding, bit for bit: d = max|x| / 127 per block of 32, codes round(x / d) with
halves away from zero (computed as x * (1 / d), as GGML does). Q4_0, Q4_1, Q5_0 and Q5_1 come along
because GGML's rounding for them is as short; nothing in ds4desk asks for them yet. Where GGML would
store an infinite or NaN scale (values beyond fp16's range times 127, or not finite) we refuse the
weight instead, for every type, so that the loader keeps it in 16-bit.

Q4_K is our own encoder; any encoding `dequantize` decodes is a valid Q4_K, and the values a
super-block of 256 gives are (d * sc_i) * q - dmin * m_i for sub-block i of 32, with codes q in
0..15, 6-bit sc_i, m_i and fp16 d, dmin. We choose them in four steps:

1. Per sub-block, a continuous affine grid: step s = (hi - lo) / 15 and offset o = -lo, where hi
   is the largest value and lo the smallest clamped to <= 0 (the format's minimum dmin * m_i is
   never negative, so a grid can only start at or below zero).
2. A few rounds of least squares: with the codes nearest to the current grid fixed, the (s, o) of
   least squared error has a closed form; refitting and re-rounding never raises the squared
   error. A sub-block keeps the refined grid only where it lowers the squared error and leaves
   no value further than s_minmax / 2 from the grid, the bound of step 1; so the worst error
   per sub-block stays that of the min/max grid.
3. d = max_i s_i / 63 and dmin = max_i o_i / 63 as fp16, nudged up one fp16 step where rounding
   made them smaller, so sc_i = round(s_i / d) and m_i = round(o_i / dmin) fit 6 bits and move
   each step by at most d / 2 and each offset by at most dmin / 2.
   Then each sub-block tries the eight neighbours of its (sc_i, m_i), one up or down in either
   or both, and keeps the one of least squared error among those whose worst error stays within
   the bound below (rounding each on its own is not the best pair: a step rounded down can be
   made up by a minimum rounded the other way).
4. Each value's code is the one nearest to it on the grid the stored numbers decode to.

The bound: with the nearest (sc_i, m_i), a code's value moves by at most 15 * d / 2 + dmin / 2 from
the grid of step 2, and step 4 can only bring it closer, so no value is decoded further than
(hi - lo) / 30 + 7.5 * d + 0.5 * dmin from the original; a neighbour is kept only within that
bound too (the test checks exactly this bound).

Cost: about 15 passes over the values (most in steps 2 and 3); on one CPU core a million values
take about 0.09 s for Q4_K and 0.02 s for Q8_0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4desk.engine.formats import gguf_type

Q8_0 = 8
Q4_K = 12

_SLICE_VALUES = 1 << 20  # float32 values quantized at a time (4 MiB; scratch is a few times that)
_REFINE_ROUNDS = 3
_K_SUBS, _K_SUB_VALUES, _K_LEVELS = 8, 32, 15  # Q4_K: sub-blocks, values in each, top code
_K_SCALE_MAX = 63  # 6-bit sub-block scales and minimums


def quantize(weight: torch.Tensor, type_id: int) -> torch.Tensor:
    """A float [rows, cols] weight (any float dtype, any device) as uint8 [rows, row_bytes] blocks of
    GGML type `type_id` (Q8_0 or Q4_K, which "quantize on load" uses, or Q4_0, Q4_1, Q5_0, Q5_1),
    on the weight's device.

    A ValueError naming the type for any other type, and naming the shape for a weight that is not
    2-D floats or whose rows are not whole blocks (such a weight stays in 16-bit)."""
    kind = gguf_type(type_id)
    encode = _ENCODERS.get(kind.name)
    if encode is None:
        names = ", ".join(_ENCODERS)
        raise ValueError(
            f"quantizing to {kind.name} (type id {type_id}) is not supported; ds4desk quantizes to {names}"
        )
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"only a 2-D float weight can be quantized to {kind.name}, got shape {tuple(weight.shape)} "
            f"of {weight.dtype}"
        )
    rows, cols = weight.shape
    if cols % kind.block_values:
        raise ValueError(
            f"a weight of shape {tuple(weight.shape)} cannot be quantized to {kind.name}: its rows of "
            f"{cols} values are not whole {kind.block_values}-value blocks"
        )
    row_bytes = cols // kind.block_values * kind.block_bytes
    out = torch.empty((rows, row_bytes), dtype=torch.uint8, device=weight.device)
    if out.numel() == 0:
        return out
    step = max(1, _SLICE_VALUES // cols)
    for start in range(0, rows, step):
        part = weight[start : start + step].to(torch.float32).reshape(-1, kind.block_values)
        try:
            out[start : start + step] = encode(part).view(-1, row_bytes)
        except _UnstorableScale as exc:
            raise ValueError(
                f"a weight of shape {tuple(weight.shape)} cannot be quantized to {kind.name}: {exc}"
            ) from None
    return out


class _UnstorableScale(ValueError):
    """A block's scale is not a finite fp16: values too large for the format, or not finite."""


def _checked_fp16(scales: torch.Tensor) -> torch.Tensor:
    """fp16 block scales, refused rather than stored as infinity or NaN (which would decode whole
    blocks to NaN: the weight is better kept in 16-bit)."""
    if not bool(torch.isfinite(scales).all()):
        raise _UnstorableScale("some values are too large for an fp16 block scale, or not finite")
    return scales


# --- shared helpers --------------------------------------------------------------------------------


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> their fp16 (round to nearest even) as little-endian bytes, uint8 [n, 2]."""
    return _checked_fp16(values.to(torch.float16)).view(torch.uint8)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, halves away from zero. Written as floor(a) + floor(2 * frac(a)), which
    is exact in float32, unlike floor(a + 0.5) (0.49999997 + 0.5 rounds up to 1.0)."""
    a = x.abs()
    whole = a.floor()
    return torch.sign(x) * (whole + (2 * (a - whole)).floor())


def _divided_or_zero(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (a flat sub-block has no step)."""
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator > 0, numerator / safe, torch.zeros_like(numerator))


# --- Q8_0 ------------------------------------------------------------------------------------------


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> [n, 34]: d (fp16) | 32 int8 codes, GGML's arithmetic step for step."""
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = _round_half_away(blocks * inverse).to(torch.int8)
    return torch.cat((_fp16_bytes(d), codes.view(torch.uint8)), dim=1)


# --- Q4_0, Q4_1, Q5_0, Q5_1 -------------------------------------------------------------------------
# GGML's rounding for these, bit for bit: codes are truncated after adding a half (and the zero
# code's offset), then clipped. Value j < 16 is the low nibble of code byte j, value j >= 16 the high
# nibble of byte j - 16; the 5-bit types keep each code's fifth bit as bit j of a little-endian uint32.


def _nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, 32] (float, 0..31) -> [n, 16] bytes of their low nibbles, in value order."""
    codes = q.to(torch.uint8)
    return (codes[:, :16] & 0x0F) | (codes[:, 16:] << 4)


def _fifth_bit_bytes(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, 32] (float, 0..31) -> [n, 4] bytes: bit j % 8 of byte j // 8 is code j's bit 4."""
    bits = (q.to(torch.uint8) >> 4).view(-1, 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=q.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def _symmetric(blocks: torch.Tensor, half_range: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [n, 1], codes [n, 32]) of Q4_0 (half_range 8) or Q5_0 (16): d is the value of largest
    magnitude over -half_range, so that value gets code 0 and the grid's far end is unused."""
    largest = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
    d = largest / -half_range
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = (blocks * inverse + (half_range + 0.5)).trunc().clamp(0, 2 * half_range - 1)
    return d, q


def _affine(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, m [n, 1], codes [n, 32]) of Q4_1 (levels 15) or Q5_1 (31): the grid spans min..max."""
    low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    d = (high - low) / levels
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = ((blocks - low) * inverse + 0.5).trunc().clamp(0, levels)
    return d, low, q


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(blocks, 8)
    return torch.cat((_fp16_bytes(d), _nibble_bytes(q)), dim=1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, q = _affine(blocks, 15)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(m), _nibble_bytes(q)), dim=1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric(blocks, 16)
    return torch.cat((_fp16_bytes(d), _fifth_bit_bytes(q), _nibble_bytes(q)), dim=1)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, q = _affine(blocks, 31)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(m), _fifth_bit_bytes(q), _nibble_bytes(q)), dim=1)


# --- Q4_K ------------------------------------------------------------------------------------------


def _inverse(step: torch.Tensor) -> torch.Tensor:
    """1 / step, 0 where the step is 0 (a flat sub-block: every code 0). Taken once per sub-block so
    the 32 values are multiplied, not divided."""
    return torch.where(step > 0, 1.0 / step, torch.zeros_like(step))


def _nearest_codes(x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The code in 0..15 whose grid value step * q - offset is nearest each x; [n, 8, 32] float32."""
    q = x + offset.unsqueeze(-1)
    return q.mul_(_inverse(step).unsqueeze(-1)).round_().clamp_(0, _K_LEVELS)


def _grid_errors(
    x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared error, largest absolute error) of each sub-block on its nearest grid codes."""
    error = _nearest_codes(x, step, offset).mul_(step.unsqueeze(-1)).sub_(offset.unsqueeze(-1)).sub_(x)
    return torch.linalg.vecdot(error, error), error.abs_().amax(-1)


def _least_squares_grid(
    x: torch.Tensor, step: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternating refinement: codes nearest the grid, then the (step, offset >= 0) that fits those
    codes best in the least-squares sense; rounds where a fit is degenerate keep the old grid."""
    n = float(x.shape[-1])
    sum_x = x.sum(-1)
    for _ in range(_REFINE_ROUNDS):
        q = _nearest_codes(x, step, offset)
        sum_q, sum_qq, sum_qx = q.sum(-1), torch.linalg.vecdot(q, q), torch.linalg.vecdot(q, x)
        det = n * sum_qq - sum_q * sum_q
        fit_step = _divided_or_zero(n * sum_qx - sum_q * sum_x, det)
        fit_offset = (fit_step * sum_q - sum_x) / n
        # An offset below zero is not storable: refit the step alone with the grid starting at zero.
        through_zero = fit_offset < 0
        fit_step = torch.where(through_zero, _divided_or_zero(sum_qx, sum_qq), fit_step)
        fit_offset = torch.where(through_zero, torch.zeros_like(fit_offset), fit_offset)
        usable = (det > 0) & (fit_step > 0)
        step = torch.where(usable, fit_step, step)
        offset = torch.where(usable, fit_offset, offset)
    return step, offset


def _six_bit_scales(
    x: torch.Tensor,
    step: torch.Tensor,
    offset: torch.Tensor,
    d: torch.Tensor,
    dmin: torch.Tensor,
    allowed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's 6-bit (scale, minimum), as floats: the nearest to step / d and offset / dmin,
    or the one of its eight neighbours (each one up or down) that lowers the squared error without
    letting any value's error pass `allowed`."""
    scales = _divided_or_zero(step, d).round().clamp(0, _K_SCALE_MAX)
    mins = _divided_or_zero(offset, dmin).round().clamp(0, _K_SCALE_MAX)
    best_sse, _ = _grid_errors(x, d * scales, dmin * mins)
    chosen_scales, chosen_mins = scales, mins
    for scale_move in (-1, 0, 1):
        for min_move in (-1, 0, 1):
            if scale_move == min_move == 0:
                continue
            trial_scales = (scales + scale_move).clamp(0, _K_SCALE_MAX)
            trial_mins = (mins + min_move).clamp(0, _K_SCALE_MAX)
            sse, worst = _grid_errors(x, d * trial_scales, dmin * trial_mins)
            better = (sse < best_sse) & (worst <= allowed)
            chosen_scales = torch.where(better, trial_scales, chosen_scales)
            chosen_mins = torch.where(better, trial_mins, chosen_mins)
            best_sse = torch.where(better, sse, best_sse)
    return chosen_scales, chosen_mins


def _fp16_at_least(values: torch.Tensor) -> torch.Tensor:
    """The fp16 nearest each non-negative float32, one fp16 step up where that is below it."""
    half = values.to(torch.float16)
    below = half.float() < values
    return torch.where(below, (half.view(torch.int16) + 1).view(torch.float16), half)


def _pack_k_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and minimums, uint8 [n, 8] each -> the 12 bytes Q4_K stores: bytes 0-3
    and 4-7 hold sub-blocks 0-3's scales and minimums in their low 6 bits and, in their top 2 bits,
    bits 4-5 of sub-blocks 4-7's; bytes 8-11 hold sub-blocks 4-7's low 4 bits (scale low nibble,
    minimum high nibble)."""
    first = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    second = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    third = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return torch.cat((first, second, third), dim=1)


def _pack_k_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, 256] -> [n, 128]: each 32 bytes hold sub-blocks 2j (low nibbles) and 2j + 1."""
    pairs = q.view(-1, 4, 2, _K_SUB_VALUES)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).flatten(1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> [n, 144]: d | dmin | 12 scale bytes | 128 code bytes."""
    x = blocks.view(-1, _K_SUBS, _K_SUB_VALUES)
    low = x.amin(-1).clamp(max=0)
    minmax_step = (x.amax(-1) - low) / _K_LEVELS
    minmax_offset = -low
    step, offset = _least_squares_grid(x, minmax_step, minmax_offset)
    minmax_sse, _ = _grid_errors(x, minmax_step, minmax_offset)
    refined_sse, refined_worst = _grid_errors(x, step, offset)
    better = (refined_sse < minmax_sse) & (refined_worst <= minmax_step / 2)
    step = torch.where(better, step, minmax_step)
    offset = torch.where(better, offset, minmax_offset)

    d = _checked_fp16(_fp16_at_least(step.amax(-1, keepdim=True) / _K_SCALE_MAX))
    dmin = _checked_fp16(_fp16_at_least(offset.amax(-1, keepdim=True) / _K_SCALE_MAX))
    # What step 4 promises each sub-block (see the module's docstring).
    allowed = minmax_step / 2 + 7.5 * d.float() + 0.5 * dmin.float()
    sub_scales, sub_mins = _six_bit_scales(x, step, offset, d.float(), dmin.float(), allowed)
    # The grid exactly as the decoder rebuilds it (float32: d * sc, dmin * m), for the final codes.
    q = _nearest_codes(x, d.float() * sub_scales, dmin.float() * sub_mins).to(torch.uint8)
    return torch.cat(
        (
            d.view(torch.uint8),
            dmin.view(torch.uint8),
            _pack_k_scales(sub_scales.to(torch.uint8), sub_mins.to(torch.uint8)),
            _pack_k_codes(q.flatten(1)),
        ),
        dim=1,
    )


_ENCODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
}
