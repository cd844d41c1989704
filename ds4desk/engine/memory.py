"""Device memory readings for the park row and the memory chart; called on the engine thread only.

CUDA (and HIP, which torch also calls "cuda") reports its caching allocator and the driver's free and
total bytes. The CPU has no allocator of its own to ask, so the process's resident set stands for
"allocated" and "reserved", and /proc/meminfo gives free (MemAvailable) and total; without /proc
(macOS, Windows) those read 0 rather than pulling in psutil.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path
from typing import Any

from ds4desk.engine.api import MemoryStats


def read_memory(device: Any | None, idle_park_in_s: float | None = None) -> MemoryStats:
    """`device`: a torch.device, or None before any model was loaded (the CPU is read then)."""
    if device is not None and device.type == "cuda":
        return _cuda(device, idle_park_in_s)
    return _cpu(idle_park_in_s)


def _cuda(device: Any, idle_park_in_s: float | None) -> MemoryStats:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    return MemoryStats(
        device=f"cuda:{index}",
        name=torch.cuda.get_device_name(index),
        allocated=int(torch.cuda.memory_allocated(index)),
        reserved=int(torch.cuda.memory_reserved(index)),
        free=int(free),
        total=int(total),
        idle_park_in_s=idle_park_in_s,
    )


def _cpu(idle_park_in_s: float | None) -> MemoryStats:
    rss = process_rss()
    meminfo = _meminfo()
    return MemoryStats(
        device="cpu",
        name=_cpu_name(),
        allocated=rss,
        reserved=rss,
        free=meminfo.get("MemAvailable", 0),
        total=meminfo.get("MemTotal", 0),
        idle_park_in_s=idle_park_in_s,
    )


def process_rss() -> int:
    """Resident bytes of this process (0 where /proc/self/statm does not exist)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (its values are kB)."""
    values: dict[str, int] = {}
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


@cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"
