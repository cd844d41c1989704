"""One block of host memory for a model's CPU weights, on huge pages where the kernel gives them.

A CPU decode step reads every weight once, so it runs at the memory's speed only if the page walks
keep up: on 4 KiB pages a 178 MB head (Gemma-3-270M's tied Q8_0 embedding) is 43,000 TLB misses a
token. torch allocates each tensor on its own, mostly on 4 KiB pages (Linux's transparent huge pages
are usually `madvise`-only, and torch asks for them only under THP_MEM_ALLOC_ENABLE). Here the
weights share one anonymous mapping advised MADV_HUGEPAGE (docs/BENCHMARKS.md, CPU GGUF,
2026-12-05: Gemma-3-270M's decode 57 -> 66 tok/s on two cores of a Xeon). Where huge pages are off
or the platform has no madvise, it is plain anonymous memory, which is what torch would have used.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable

import torch

# DS4DESK_HOST_HUGEPAGES=0 leaves the block on the kernel's default pages (the benchmark's peer).
_HUGE_PAGES = os.environ.get("DS4DESK_HOST_HUGEPAGES", "1") != "0"
# Each tensor starts on a cache line (the C kernels' streaming and aligned loads want 64 bytes).
ALIGN = 64


def _span(shape: torch.Size, dtype: torch.dtype) -> int:
    return (shape.numel() * dtype.itemsize + ALIGN - 1) // ALIGN * ALIGN


class HostBlock:
    """Uninitialised CPU tensors handed out one after another from a single mapping, sized up front
    for `specs` (shapes and dtypes). The mapping lives as long as any tensor taken from it."""

    def __init__(self, specs: Iterable[tuple[torch.Size, torch.dtype]]) -> None:
        self.size = sum(_span(shape, dtype) for shape, dtype in specs)
        self._used = 0
        self._memory: torch.Tensor | None = None
        if self.size:
            block = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None and _HUGE_PAGES:
                with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
                    block.madvise(advice)
            # frombuffer keeps `block` alive for as long as a view of it exists.
            self._memory = torch.frombuffer(block, dtype=torch.uint8)

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor of this shape and dtype; a RuntimeError past the size the block was made for."""
        shape = torch.Size(shape)
        span = _span(shape, dtype)
        if self._memory is None or self._used + span > self.size:
            raise RuntimeError(f"host block of {self.size} bytes has no room for {list(shape)} {dtype}")
        start = self._used
        self._used += span
        return self._memory[start : start + shape.numel() * dtype.itemsize].view(dtype).view(shape)
