"""Running Triton launchers on the right GPU.

Triton launches on the current device, and a layer split puts layers (and their tensors) on other
GPUs than the current one: every launcher goes through `on_its_device`."""

from __future__ import annotations

import functools
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
