"""Weights that stay in a GGUF block type on the device, and the projection a layer calls.

A family builds `nn.Linear` / `nn.Embedding` for every weight; the loader hands `build` the GGUF
type of each weight the file stores quantized (`packed`: parameter name -> GGML type id), and the
family builds `PackedLinear` / `PackedEmbedding` for those names instead. Their `weight` is the
file's bytes, uint8 [rows, row_bytes], so the loader copies blocks and nothing is dequantized.

`Projection` is what a layer's forward calls for "x @ Wᵀ (+ b)": float weights go through
torch.mm / addmm, packed ones through kernels/quant/gguf_matmul. Layers never test which it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds4desk.engine.formats import ROW_LAYOUTS, gguf_packed_bytes
from ds4desk.engine.host_memory import HostBlock
from ds4desk.engine.kernels.quant import gguf, gguf_triton
from ds4desk.engine.kernels.quant.gguf_matmul import dequantize_rows, gguf_matmul
from ds4desk.engine.models.row_buckets import FEW_ROWS, bucketed, prefill_rows


def _bytes_param(rows: int, cols: int, type_id: int) -> nn.Parameter:
    row_bytes = gguf_packed_bytes(type_id, (cols,))
    return nn.Parameter(torch.empty((rows, row_bytes), dtype=torch.uint8), requires_grad=False)


class PackedLinear(nn.Module):
    """nn.Linear's interface with the weight kept as GGUF blocks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        type_id: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.type_id = in_features, out_features, type_id
        self.weight = _bytes_param(out_features, in_features, type_id)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )


class PackedEmbedding(nn.Module):
    """nn.Embedding's interface with the table kept as GGUF blocks (a lookup dequantizes its rows);
    a tied head multiplies by the same blocks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, type_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.type_id = num_embeddings, embedding_dim, type_id
        self.dtype = dtype
        self.weight = _bytes_param(num_embeddings, embedding_dim, type_id)


def parameter_count(model: nn.Module) -> int:
    """The model's weights as values (a packed weight counts its rows x cols, not its bytes)."""
    packed = {
        id(m.weight): m.weight.shape[0] * (m.in_features if isinstance(m, PackedLinear) else m.embedding_dim)
        for m in model.modules()
        if isinstance(m, (PackedLinear, PackedEmbedding))
    }
    unique = {id(p): p for p in model.parameters()}
    return sum(packed.get(key, p.numel()) for key, p in unique.items())


_REARRANGED_BYTES = 32 << 20  # hold_device_rows' scratch: rows rearranged at a time
# False: every packed weight keeps the file's blocks on a GPU too (the benchmarks' comparison).
DEVICE_ROWS = True


def hold_device_rows(model: nn.Module) -> None:
    """Rearrange, in place, every packed weight that the GPU kernels multiply and that has a row layout
    (formats.ROW_LAYOUTS: Q8_0; the same bytes, each row's codes apart from its blocks' heads), which
    its one-row GEMV streams in 16-byte loads. Rows of 256-value multiples only (16-byte aligned
    rows); call before building the projections, which take each module's type. Other devices keep
    the file's blocks. 32 MB of rows at a time: a model that fills the GPU still loads."""
    if not DEVICE_ROWS:
        return
    converted: set[int] = set()
    for module in model.modules():
        if not isinstance(module, (PackedLinear, PackedEmbedding)) or module.type_id not in ROW_LAYOUTS:
            continue
        cols = module.in_features if isinstance(module, PackedLinear) else module.embedding_dim
        weight = module.weight.data
        if cols % 256 or not gguf_triton.enabled(weight):
            continue
        if weight.data_ptr() not in converted:  # a weight two modules share is rearranged once
            step = max(1, _REARRANGED_BYTES // weight.shape[1])
            for start in range(0, weight.shape[0], step):
                rows = weight[start : start + step]
                rows.copy_(gguf.device_rows(rows, module.type_id, cols))
            converted.add(weight.data_ptr())
        module.type_id = ROW_LAYOUTS[module.type_id][0].type_id


def linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    name: str,
    packed: Mapping[str, int] | None,
) -> nn.Linear | PackedLinear:
    """The module for the linear weight the model names `name`.weight."""
    type_id = (packed or {}).get(f"{name}.weight")
    if type_id is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return PackedLinear(in_features, out_features, type_id, bias, dtype)


def embedding(
    num: int, dim: int, dtype: torch.dtype, name: str, packed: Mapping[str, int] | None
) -> nn.Embedding | PackedEmbedding:
    type_id = (packed or {}).get(f"{name}.weight")
    if type_id is None:
        return nn.Embedding(num, dim, dtype=dtype)
    return PackedEmbedding(num, dim, type_id, dtype)


def embed(module: nn.Embedding | PackedEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of `ids`, in the model's dtype."""
    if isinstance(module, PackedEmbedding):
        return dequantize_rows(module.weight, ids, module.type_id, module.embedding_dim).to(module.dtype)
    return F.embedding(ids, module.weight)


@dataclass(slots=True)
class Projection:
    """x @ Wᵀ (+ b) for one weight, or for several laid side by side in the output (q/k/v or
    gate/up whose packed types differ). Float weights are held transposed (a view): mm then reads
    them without a copy and addmm folds the residual add in."""

    weight_t: torch.Tensor | None = None  # float [cols, rows]
    packed: torch.Tensor | None = None  # uint8 [rows, row_bytes]
    type_id: int = -1
    cols: int = 0
    bias: torch.Tensor | None = None
    parts: tuple[Projection, ...] = ()
    # A family whose prefill chunks cannot be padded sets this on a GPU: more than FEW_ROWS rows run
    # padded to their bucket (models/row_buckets.py), so a new prompt length meets no first call.
    pad_rows: bool = False

    @property
    def rows(self) -> int:
        if self.parts:
            return sum(p.rows for p in self.parts)
        if self.packed is not None:
            return self.packed.shape[0]
        assert self.weight_t is not None
        return self.weight_t.shape[1]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ Wᵀ (+ b): [T, rows], into `out` when given."""
        if self.pad_rows and out is None and x.shape[0] > FEW_ROWS:
            return bucketed(x, self._product)
        return self._product(x, out)

    def _product(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight_t is not None:
            if self.bias is None:
                return torch.mm(x, self.weight_t, out=out) if out is not None else torch.mm(x, self.weight_t)
            if out is not None:
                return torch.addmm(self.bias, x, self.weight_t, out=out)
            return torch.addmm(self.bias, x, self.weight_t)
        if out is None:
            out = torch.empty((x.shape[0], self.rows), device=x.device, dtype=x.dtype)
        if self.parts:
            start = 0
            for part in self.parts:
                stop = start + part.rows
                out[:, start:stop] = part(x)
                start = stop
            return out
        assert self.packed is not None
        gguf_matmul(x, self.packed, self.type_id, self.cols, out=out)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ Wᵀ (+ b), a fresh tensor (the float path folds the add into addmm, except
        where the rows would be padded to their bucket: there the padded product, then the add)."""
        if self.weight_t is not None and not (self.pad_rows and _padded(x.shape[0])):
            result = torch.addmm(residual, x, self.weight_t)
            return result if self.bias is None else result.add_(self.bias)
        return self(x).add_(residual)


def _padded(rows: int) -> bool:
    """Whether a bucketed product pads `rows` rows (models/row_buckets.py)."""
    return rows > FEW_ROWS and prefill_rows(rows) != rows


def projection_of(module: nn.Linear | PackedLinear | nn.Embedding | PackedEmbedding) -> Projection:
    """The Projection of one module's weight (an embedding as a tied head)."""
    bias = getattr(module, "bias", None)
    if isinstance(module, (PackedLinear, PackedEmbedding)):
        cols = module.in_features if isinstance(module, PackedLinear) else module.embedding_dim
        return Projection(packed=module.weight, type_id=module.type_id, cols=cols, bias=bias)
    return Projection(weight_t=module.weight.t(), bias=bias)


Fused = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias) a group's parameters are views of


def fuse_group(
    parts: Sequence[nn.Linear | PackedLinear],
    device: torch.device,
    empty: bool = True,
    block: HostBlock | None = None,
) -> Fused | None:
    """Point the parts' weights (and biases) at consecutive row ranges of one tensor each, so a
    q/k/v or gate/up group runs as one matmul with no second copy of any weight. Packed weights fuse
    too (rows of GGUF blocks are independent) when the parts share one block type; a group whose
    types differ (Q4_K_M's q/k in Q4_K, v in Q6_K) stays separate: None.

    `empty`: allocate fresh storage (the loader fills it; on the CPU from `block`, the model's host
    memory, where there is one); otherwise keep the current values. The caller keeps the result off
    the state dict."""
    if len({getattr(part, "type_id", None) for part in parts}) != 1:
        return None
    fused: list[torch.Tensor | None] = []
    for attr in ("weight", "bias"):
        current = [getattr(part, attr) for part in parts]
        if current[0] is None:
            fused.append(None)
            continue
        if empty:
            rows = sum(c.shape[0] for c in current)
            shape = (rows, *current[0].shape[1:])
            if block is not None and device.type == "cpu":
                storage = block.take(shape, current[0].dtype)
            else:
                storage = torch.empty(shape, device=device, dtype=current[0].dtype)
        else:
            storage = torch.cat([c.detach() for c in current])
        start = 0
        for part, c in zip(parts, current, strict=True):
            stop = start + c.shape[0]
            setattr(part, attr, nn.Parameter(storage[start:stop], requires_grad=False))
            start = stop
        fused.append(storage)
    weight, bias = fused
    assert weight is not None
    return weight, bias


def group_projection(parts: Sequence[nn.Linear | PackedLinear], fused: Fused | None) -> Projection:
    """The projection of a group laid side by side in the output: one over its fused tensor, or one
    per part (differing block types, or a model filled without fusing)."""
    if fused is None:
        return Projection(parts=tuple(projection_of(part) for part in parts))
    weight, bias = fused
    first = parts[0]
    if isinstance(first, PackedLinear):
        return Projection(packed=weight, type_id=first.type_id, cols=first.in_features, bias=bias)
    return Projection(weight_t=weight.t(), bias=bias)
