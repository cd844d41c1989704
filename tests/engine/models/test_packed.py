"""models/packed.py: hold_device_rows rearranges a model's Q8_0 weights into Q8_0_ROWS where the GPU
kernels take them (here forced on for CPU tensors): in slices of rows, a shared weight once, rows
that are not 256-value multiples and other types left as the file stores them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds4desk.engine.formats import GGUF_TYPES, Q8_0_ROWS
from ds4desk.engine.kernels.quant import gguf, gguf_launch, gguf_triton
from ds4desk.engine.models import packed
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear
from tests.engine.kernels.quant.test_gguf import random_blocks

Q8_0, Q4_K = 8, 12


def _filled(module: PackedLinear | PackedEmbedding, seed: int) -> torch.Tensor:
    rows, row_bytes = module.weight.shape
    cols = row_bytes // GGUF_TYPES[module.type_id].block_bytes * GGUF_TYPES[module.type_id].block_values
    blocks = torch.from_numpy(random_blocks(GGUF_TYPES[module.type_id], (rows, cols), seed).copy())
    module.weight.data.copy_(blocks)
    return blocks


def test_q8_0_weights_are_rearranged_in_slices_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    if gguf_launch.kernels() is None:
        pytest.skip("Triton is not installed: the GPU kernels never take a weight")
    model = nn.Module()
    model.embed = PackedEmbedding(40, 512, Q8_0, torch.float32)
    model.q = PackedLinear(256, 24, Q8_0)
    model.narrow = PackedLinear(96, 8, Q8_0)  # rows of 96 values: not 16-byte aligned rows
    model.k_quant = PackedLinear(256, 8, Q4_K)
    files = {name: _filled(module, seed) for seed, (name, module) in enumerate(model.named_children())}
    model.head = PackedEmbedding(40, 512, Q8_0, torch.float32)  # a tied head: the embedding's weight
    model.head.weight = model.embed.weight
    monkeypatch.setattr(packed, "_REARRANGED_BYTES", 3 * 544)  # three embedding rows a slice

    with gguf_triton.SWITCH.force(True):
        packed.hold_device_rows(model)

    assert model.embed.type_id == model.head.type_id == model.q.type_id == Q8_0_ROWS.type_id
    assert (model.narrow.type_id, model.k_quant.type_id) == (Q8_0, Q4_K)
    assert torch.equal(model.embed.weight, gguf.device_rows(files["embed"], Q8_0, 512))  # not twice
    assert torch.equal(model.q.weight, gguf.device_rows(files["q"], Q8_0, 256))
    assert torch.equal(model.narrow.weight, files["narrow"]) and torch.equal(
        model.k_quant.weight, files["k_quant"]
    )
    want = gguf.dequantize(files["embed"], Q8_0, (40, 512))
    assert torch.equal(gguf.dequantize(model.embed.weight, Q8_0_ROWS.type_id, (40, 512)), want)


def test_without_the_gpu_kernels_the_files_blocks_stay() -> None:
    model = nn.Module()
    model.q = PackedLinear(256, 8, Q8_0)
    blocks = _filled(model.q, 0)
    with gguf_triton.SWITCH.force(False):
        packed.hold_device_rows(model)
    assert model.q.type_id == Q8_0 and torch.equal(model.q.weight, blocks)
