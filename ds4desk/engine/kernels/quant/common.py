"""What the FP8 (quant/fp8.py) and FP4 (quant/fp4.py) kernels share: where they run by default and
how many programs fill the GPU."""

from __future__ import annotations

import functools

import torch

from ds4desk.engine.kernels.launch import Where

# Streaming multiprocessors assumed where the device cannot be asked (Triton's CPU interpreter): an H200.
DEFAULT_SMS = 132


def nvidia_cuda(where: Where) -> bool:
    """Whether the quantized kernels run there by default: NVIDIA CUDA tensors. The kernels were
    written for Hopper (H100/H200) and never tried on ROCm, where tensors are "cuda" too."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return device.type == "cuda" and torch.version.hip is None


def device_sms(t: torch.Tensor) -> int:
    """The streaming multiprocessors of t's GPU (DEFAULT_SMS for a CPU tensor)."""
    return _sm_count(t.device.index or 0) if t.is_cuda else DEFAULT_SMS


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
