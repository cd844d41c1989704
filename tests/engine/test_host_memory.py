"""host_memory.py: a model's CPU weights in one block of host memory advised to huge pages."""

from __future__ import annotations

import gc
import itertools
import sys
from pathlib import Path

import pytest
import torch

from ds4desk.engine.host_memory import ALIGN, HostBlock
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from tests.real_models import smollm2_gguf


def test_tensors_are_aligned_disjoint_views_that_keep_their_block_alive() -> None:
    specs = [
        (torch.Size([3, 5]), torch.float32),
        (torch.Size([7]), torch.uint8),
        (torch.Size([2, 9]), torch.bfloat16),
    ]
    block = HostBlock(specs)
    tensors = [block.take(shape, dtype) for shape, dtype in specs]
    assert [(t.shape, t.dtype) for t in tensors] == specs
    assert all(t.data_ptr() % ALIGN == 0 and t.is_contiguous() for t in tensors)
    base = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)  # one block
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    with pytest.raises(RuntimeError, match="no room"):
        block.take((1,), torch.uint8)
    for value, t in enumerate(tensors):
        t.fill_(value + 1)
    survivor = tensors[2]
    del tensors, block
    gc.collect()
    assert torch.equal(survivor, torch.full((2, 9), 3.0, dtype=torch.bfloat16))


def test_an_empty_block() -> None:
    block = HostBlock([])
    assert block.size == 0
    with pytest.raises(RuntimeError, match="no room"):
        block.take((1,), torch.float32)


def _thp_advisable() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform == "linux" and setting.is_file() and "[never]" not in setting.read_text()


@pytest.mark.skipif(not _thp_advisable(), reason="no transparent huge pages on this kernel")
def test_a_loaded_models_cpu_weights_share_one_block_the_kernel_may_back_with_huge_pages() -> None:
    loaded = load_model(read_source(str(smollm2_gguf())), torch.device("cpu"), torch.float32)
    params = list(loaded.model.parameters())
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params)
    size = params[0].untyped_storage().nbytes()
    # The mapping that holds them, as the kernel lists it: eligible for transparent huge pages.
    mapping = None
    for block in _smaps_blocks():
        start, end = (int(v, 16) for v in block[0].split()[0].split("-"))
        if start <= base < end:
            mapping = block
    assert mapping is not None and int(mapping[0].split()[0].split("-")[1], 16) - base >= size
    eligible = [line.split()[1] for line in mapping if line.startswith("THPeligible:")]
    if not eligible:
        pytest.skip("this kernel's smaps does not say which mappings may take huge pages")
    assert eligible == ["1"], "\n".join(mapping)


def _smaps_blocks() -> list[list[str]]:
    """/proc/self/smaps as one list of lines per mapping (a header line, then its fields)."""
    blocks: list[list[str]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line and not line.split()[0].endswith(":"):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    return blocks
