"""Running Triton launchers on the right GPU.

Triton launches on the current device, and a layer split puts layers (and their tensors) on other
GPUs than the current one: every launcher goes through `on_its_device`."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

_T = TypeVar("_T")


def on_its_device(launch: Callable[..., _T]) -> Callable[..., _T]:
    """Run `launch` with its first argument's GPU as the current device (CPU tensors: as is)."""

    @functools.wraps(launch)
    def run(first: torch.Tensor, *args: object, **kwargs: object) -> _T:
        if not first.is_cuda:
            return launch(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return launch(first, *args, **kwargs)

    return run


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block sizes."""
    return 1 << max(0, n - 1).bit_length()


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def nvidia(where: torch.Tensor | torch.device) -> bool:
    """Whether the fused Triton kernels run there: an NVIDIA GPU from Ampere on (bf16 tiles; they
    were written and checked for sm_80+ and an H200, never on ROCm, whose tensors are "cuda" too)."""
    device = where.device if isinstance(where, torch.Tensor) else where
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 8


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it finishes, and waits for that kernel's results in `griddepcontrol.wait`; the decode
# kernels stream weights that no earlier kernel writes before that wait, which hides the gap between
# two small kernels. None: on where it exists (CUDA capability 9+, not Triton's interpreter).
PDL: bool | None = None


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels for `t` launch with programmatic dependent launch (see PDL)."""
    if PDL is not None:
        return PDL and t.is_cuda
    if not t.is_cuda or torch.version.hip is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(t.device.index or 0) >= 9


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
