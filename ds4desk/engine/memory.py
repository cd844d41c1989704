"""Device memory readings for the park row and the memory chart; called on the engine thread only.

One figure means "memory": what the engine holds for the loaded model. The engine passes it in as
`held` (`bytes_held`), it lands in MemoryStats.allocated, and a park frees exactly its drop, so the
readout and Park's "freed ..." are the same quantity. On CUDA (and HIP, which torch also calls "cuda")
it is the caching allocator's allocated bytes on the model's devices, the truth about weights, cache,
graph pools and workspaces; on the CPU there is no allocator to ask, so it is the engine's own count
of weights + cache, 0 with no model.

`reserved` is what the process holds beyond that: the allocator's reserved pool on CUDA, the process's
resident set on the CPU (Python, Qt, torch included). /proc/meminfo gives the CPU's free
(MemAvailable) and total; without /proc (macOS, Windows) those read 0 rather than pulling in psutil.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from ds4desk.engine.api import MemoryStats


def bytes_held(devices: Sequence[Any], counted: int) -> int:
    """What a model on `devices` (torch.device, a layer split has several) holds: the allocator's
    count where every device has one (CUDA), else `counted`, the engine's weights + cache (0: none)."""
    if devices and all(d.type == "cuda" for d in devices):
        import torch

        return sum(int(torch.cuda.memory_allocated(d)) for d in devices)
    return counted


def read_memory(device: Any | None, idle_park_in_s: float | None = None, *, held: int = 0) -> MemoryStats:
    """`device`: a torch.device, or None before any model was loaded (the CPU is read then);
    `held`: bytes_held for the loaded model (0 with none), reported as `allocated`."""
    if device is not None and device.type == "cuda":
        return _cuda(device, held, idle_park_in_s)
    return _cpu(held, idle_park_in_s)


def _cuda(device: Any, held: int, idle_park_in_s: float | None) -> MemoryStats:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    return MemoryStats(
        device=f"cuda:{index}",
        name=torch.cuda.get_device_name(index),
        allocated=held,
        reserved=int(torch.cuda.memory_reserved(index)),
        free=int(free),
        total=int(total),
        idle_park_in_s=idle_park_in_s,
    )


def _cpu(held: int, idle_park_in_s: float | None) -> MemoryStats:
    meminfo = _meminfo()
    return MemoryStats(
        device="cpu",
        name=_cpu_name(),
        allocated=held,
        reserved=process_rss(),
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
