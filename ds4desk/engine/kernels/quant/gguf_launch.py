"""The launchers of the GGUF Triton kernels (sources: gguf_blocks_triton.py, gguf_gemv1_triton.py,
gguf_experts_triton.py), with the settings of gguf_tiles.py. `kernels()` is None where Triton does
not import. The callers (gguf_triton.py, gguf_experts.py) check shapes and types first; each
launcher runs on its tensors' GPU (launch.on_its_device)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds4desk.engine.formats import gguf_type
from ds4desk.engine.kernels.launch import next_power_of_two, on_its_device, pdl
from ds4desk.engine.kernels.quant.common import device_sms
from ds4desk.engine.kernels.quant.gguf_tiles import (
    CODEBOOK_WORDS,
    DEQUANT_BLOCK_N,
    INPUT_COPY,
    INPUT_NORM,
    INPUT_SILU,
    ONE_ROW_GROUPS,
    READ_ORDER_TYPES,
    ROWS_OWN_INPUT_MAX_ROWS,
    TILES,
    experts_config,
    gemv_config,
    one_row_fits,
    one_row_plan,
    rows_config,
)


def _aligned(weight: torch.Tensor) -> torch.Tensor:
    """The weight at a 16-byte aligned address: the kernels read code bytes as int32 / int16 units
    (a copy only for a view that starts mid-allocation at an odd place, which the loader never
    makes: its rows start at multiples of the row bytes)."""
    return weight if weight.data_ptr() % 16 == 0 else weight.clone()


def _decoder_words(name: str, cols: int) -> tuple[int, int, int, int]:
    """gguf_blocks_triton.decode's c0..c3: a table type's codebook; for Q8_0_ROWS, where its scales
    start in a row."""
    if name == "Q8_0_ROWS":
        return cols, 0, 0, 0  # the scales after the int8 codes
    return CODEBOOK_WORDS.get(name, (0, 0, 0, 0))


@dataclass(slots=True)
class Kernels:
    gemv: Callable[..., None]
    dequantize: Callable[..., None]
    prepare: Callable[..., None]
    experts_gemv: Callable[..., None]
    experts_one_row: Callable[..., None]
    experts_swiglu: Callable[..., None]
    stacked_rows: Callable[..., None]


@functools.cache
def kernels() -> Kernels | None:
    try:
        from ds4desk.engine.kernels.quant import gguf_blocks_triton as source
        from ds4desk.engine.kernels.quant import gguf_experts_triton as experts_source
        from ds4desk.engine.kernels.quant import gguf_gemv1_triton as one_row_source
        from ds4desk.engine.kernels.quant import gguf_rows_triton as rows_source
    except Exception:  # no Triton: gguf_matmul's reference path runs
        return None

    def launch_gemv(
        x: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        cols: int,
        out: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        silu: bool,
        with_norm: bool,
        residual: bool,
        prepared: torch.Tensor | None = None,
        pair: tuple[torch.Tensor, int, int] | None = None,
    ) -> None:
        rows, t = weight.shape[0], x.shape[0]
        if rows == 0 or t == 0:
            return
        weight = _aligned(weight)
        name = gguf_type(type_id).name
        if prepared is not None and not (t == 1 and one_row_fits(name, rows)):
            raise ValueError(f"only the one-row GEMV reads a prepared input, not a {rows}-row {name}")
        x = x if x.stride(1) == 1 else x.contiguous()
        target = out if out.stride(1) == 1 else out.contiguous()  # a residual is read, too
        if t == 1 and name == "Q8_0_ROWS":
            if (silu or with_norm) and rows > ROWS_OWN_INPUT_MAX_ROWS:  # one input kernel for all
                x = input_row(x, norm, eps, cols, INPUT_SILU if silu else INPUT_NORM)
                silu = with_norm = False
            launch_rows(x, weight, cols, target, norm, eps, silu, with_norm, residual)
        elif t == 1 and one_row_fits(name, rows):
            mode = INPUT_SILU if silu else INPUT_NORM if with_norm else INPUT_COPY
            config, n_groups, size = one_row_plan(name, rows, cols)
            # The input row, prepared once for every program: in the order the GEMV reads it, or
            # (Q8_0, and a plain row) as it is. A given `prepared` was written by the kernel before.
            if prepared is not None:
                x = prepared
            elif name in READ_ORDER_TYPES:
                x_order = torch.empty(size, device=x.device, dtype=torch.float32)
                launch_input(x, norm, eps, cols, x_order, mode, (type_id, config[1], n_groups))
                x = x_order
            elif mode != INPUT_COPY:
                x = input_row(x, norm, eps, cols, mode)
            launch_one_row(x, weight, type_id, config, n_groups, target, residual, pair)
        else:
            launch_blocks(x, weight, type_id, cols, target, norm, eps, silu, with_norm, residual, pdl(x))
        if target is not out:
            out.copy_(target)

    def input_row(
        x: torch.Tensor, norm: torch.Tensor | None, eps: float, cols: int, mode: int
    ) -> torch.Tensor:
        """The normed (INPUT_NORM) or activated (INPUT_SILU) input row in row order and x's dtype, by
        one input kernel: what every program of a GEMV after it reads as it is."""
        row = torch.empty((1, cols), device=x.device, dtype=x.dtype)
        launch_input(x, norm, eps, cols, row, mode)
        return row

    def launch_blocks(
        x: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        cols: int,
        out: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        silu: bool,
        with_norm: bool,
        residual: bool,
        use_pdl: bool,
        ids: torch.Tensor | None = None,
    ) -> None:
        """gemv_kernel on weight [rows, row_bytes], every row of x; with `ids`, on stacked matrices
        [experts, rows, row_bytes], one input row (or x's only one) and output row a slot of ids."""
        rows = weight.shape[-2]
        name = gguf_type(type_id).name
        sub, unit = TILES[name]
        sms = device_sms(x)
        tiles = gemv_config(rows, cols, sms) if ids is None else experts_config(name, rows, cols, sms)
        block_n, values, warps = tiles
        values = max(values, sub)
        t, grid, experts = x.shape[0], (-(-rows // block_n),), {}
        if ids is not None:
            t, grid = 1, (*grid, ids.shape[0])
            x_step = x.stride(0) if x.shape[0] > 1 else 0
            experts = {"ids": ids, "expert_bytes": weight.stride(0), "x_step": x_step}
            experts |= {"out_step": out.stride(0), "EXPERTS": True}
        source.gemv_kernel[grid](
            x,
            weight,
            out,
            norm if norm is not None else x,
            rows,
            weight.stride(-2),
            x.stride(0),
            out.stride(0),
            eps,
            *_decoder_words(name, cols),
            KIND=type_id,
            L=sub,
            V=unit,
            S=values // sub,
            N_SUB=cols // sub,
            COLS=cols,
            T=t,
            T_PAD=next_power_of_two(t),
            BLOCK_N=block_n,
            SILU=silu,
            NORM=with_norm,
            RESIDUAL=residual,
            PDL=use_pdl,
            num_warps=warps,
            launch_pdl=use_pdl,
            **experts,
        )

    def launch_rows(
        x: torch.Tensor,
        weight: torch.Tensor,
        cols: int,
        out: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        silu: bool,
        with_norm: bool,
        residual: bool,
        matrices: int = 1,
    ) -> None:
        """rows_gemv_kernel: out [1, rows] (+)= input @ Wᵀ on a Q8_0_ROWS weight; with `matrices`,
        weight stacks that many [rows / matrices, ...] matrices, and out [m, :] = x [m, :] @ W_mᵀ."""
        rows = weight.shape[0] // matrices
        block_n, block_k, warps = rows_config(rows, cols)
        use_pdl = pdl(x)
        steps = {}
        if matrices > 1:
            steps = {"x_step": x.stride(0), "w_step": rows * weight.stride(0), "out_step": out.stride(0)}
        rows_source.rows_gemv_kernel[(-(-rows // block_n), matrices)](
            x,
            weight,
            out,
            norm if norm is not None else x,
            eps,
            rows,
            weight.stride(0),
            K=cols,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            NORM=with_norm,
            SILU=silu,
            RESIDUAL=residual,
            PDL=use_pdl,
            num_warps=warps,
            launch_pdl=use_pdl,
            **steps,
        )

    def launch_stacked_rows(x: torch.Tensor, weight: torch.Tensor, cols: int, out: torch.Tensor) -> None:
        launch_rows(x, weight, cols, out, None, 0.0, False, False, False, matrices=x.shape[0])

    def launch_one_row(
        x: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        config: tuple[int, int, int],
        n_groups: int,
        out: torch.Tensor,
        residual: bool,
        pair: tuple[torch.Tensor, int, int] | None,
    ) -> None:
        """pair: (the down projection's prepared input, its type id, its rows): weight is gate | up,
        and the programs also write SiLU(gate) · up there (gemv1_kernel's PAIRED)."""
        rows = weight.shape[0]
        block_n, groups, warps = config
        use_pdl = pdl(x)
        act, act_kind, act_groups, programs = out, 0, 1, -(-rows // block_n)
        if pair is not None:
            act, act_kind, act_rows = pair
            act_groups = one_row_plan(gguf_type(act_kind).name, act_rows, rows // 2)[0][1]
            programs = -(-(rows // 2) // block_n)
            block_n *= 2  # block_n units: their gate rows and their up rows
        one_row_source.gemv1_kernel[(programs,)](
            x,
            weight,
            out,
            rows,
            weight.stride(0),
            KIND=type_id,
            G=groups,
            N_GROUPS=n_groups,
            BLOCK_N=block_n,
            RESIDUAL=residual,
            PDL=use_pdl,
            ASM=x.is_cuda,  # PTX where it compiles for a GPU; Triton's interpreter runs CPU tensors
            act=act,
            half_rows=rows // 2,
            PAIRED=pair is not None,
            ACT_KIND=act_kind,
            ACT_G=act_groups,
            num_warps=warps,
            launch_pdl=use_pdl,
        )

    def launch_input(
        x: torch.Tensor,
        norm: torch.Tensor | None,
        eps: float,
        cols: int,
        out: torch.Tensor,
        mode: int,
        order: tuple[int, int, int] | None = None,
        row_out: torch.Tensor | None = None,
    ) -> None:
        """order: (type id, groups a tile, groups a row) of the one-row GEMV that reads `out` (float32,
        in its read order), and row_out the row in row order too (optional); None: `out` in row order
        and x's dtype."""
        use_pdl = pdl(x)
        block = next_power_of_two(cols)
        kind, groups, n_groups = order if order is not None else (0, 1, 0)
        group_values = ONE_ROW_GROUPS[gguf_type(kind).name] if order is not None else 1
        one_row_source.input_kernel[(1,)](
            x,
            norm if norm is not None else x,
            out,
            eps,
            COLS=cols,
            BLOCK=block,
            MODE=mode,
            PDL=use_pdl,
            KIND=kind,
            G=groups,
            V=group_values,
            N_GROUPS=n_groups,
            OUT_BLOCK=out.numel() if order is not None else 0,
            row_out=row_out,
            num_warps=min(16, max(4, max(block, out.numel()) // 512)),  # out: the row, or more in read order
            launch_pdl=use_pdl,
        )

    def launch_dequantize(weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor) -> None:
        rows = weight.shape[0]
        if rows == 0:
            return
        weight = _aligned(weight)
        name = gguf_type(type_id).name
        sub, unit = TILES[name]
        per_program = 256 // sub  # sub-blocks: 256 values of each of DEQUANT_BLOCK_N rows
        n_sub = cols // sub
        grid = (-(-rows // DEQUANT_BLOCK_N), -(-n_sub // per_program))
        source.dequantize_kernel[grid](
            weight,
            out,
            rows,
            weight.stride(0),
            out.stride(0),
            *_decoder_words(name, cols),
            KIND=type_id,
            L=sub,
            V=unit,
            S=per_program,
            N_SUB=n_sub,
            BLOCK_N=DEQUANT_BLOCK_N,
            num_warps=4,
            # Without contraction a * b - c stays two roundings, as in the torch reference.
            enable_fp_fusion=False,
        )

    def launch_experts(
        x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, type_id: int, cols: int, out: torch.Tensor
    ) -> None:
        launch_blocks(x, _aligned(weight), type_id, cols, out, None, 0.0, False, False, False, False, ids)

    def launch_experts_one_row(
        x_read: torch.Tensor,
        ids: torch.Tensor,
        weight: torch.Tensor,
        type_id: int,
        cols: int,
        out: torch.Tensor,
        config: tuple[int, int, int],
    ) -> None:
        block_n, groups, warps = config
        rows = weight.shape[1]
        experts_source.experts_kernel[(-(-rows // block_n), ids.shape[0])](
            x_read,
            ids,
            _aligned(weight),
            out,
            rows,
            weight.stride(1),
            weight.stride(0),
            x_read.stride(0) if x_read.shape[0] > 1 else 0,
            out.stride(0),
            KIND=type_id,
            G=groups,
            N_GROUPS=cols // 64,
            BLOCK_N=block_n,
            ASM=x_read.is_cuda,  # PTX where it compiles for a GPU; Triton's interpreter runs CPU tensors
            num_warps=warps,
        )

    def launch_experts_swiglu(
        x_read: torch.Tensor,
        ids: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        type_id: int,
        cols: int,
        limit: float,
        out: torch.Tensor,
        positions: torch.Tensor,
        config: tuple[int, int, int],
    ) -> None:
        block_n, groups, warps = config
        rows = gate.shape[1]
        experts_source.experts_swiglu_kernel[(-(-rows // block_n), ids.shape[0])](
            x_read,
            ids,
            _aligned(gate),
            _aligned(up),
            out,
            positions,
            rows,
            gate.stride(1),
            gate.stride(0),
            x_read.stride(0) if x_read.shape[0] > 1 else 0,
            out.stride(0),
            limit,
            KIND=type_id,
            G=groups,
            N_GROUPS=cols // 64,
            BLOCK_N=block_n,
            ASM=x_read.is_cuda,
            num_warps=warps,
        )

    return Kernels(
        on_its_device(launch_gemv),
        on_its_device(launch_dequantize),
        on_its_device(launch_input),
        on_its_device(launch_experts),
        on_its_device(launch_experts_one_row),
        on_its_device(launch_experts_swiglu),
        on_its_device(launch_stacked_rows),
    )
