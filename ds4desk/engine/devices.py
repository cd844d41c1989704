"""Turning the user's device and dtype words into torch objects, and checking that a model fits."""

from __future__ import annotations

import os

import torch

from ds4desk.engine.api import DeviceChoice, EngineFailure, ErrorCode

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(name: str | None) -> torch.device:
    """'auto' or None picks the first GPU when there is one; a ROCm torch answers to 'cuda' too."""
    word = (name or "auto").strip().lower()
    if word == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(word)
    except RuntimeError as exc:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED, f"unknown device '{name}': use cpu, cuda or cuda:N"
        ) from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"unsupported device '{name}': use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"device '{name}' asked for, but this torch sees no GPU")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise EngineFailure(
            ErrorCode.LOAD_FAILED,
            f"device '{name}' does not exist: {torch.cuda.device_count()} GPU(s) visible",
        )
    return torch.device("cuda", index)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on the CPU (exact and, at batch 1, no slower there); bfloat16 on GPUs."""
    if not name or name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise EngineFailure(
            ErrorCode.LOAD_FAILED, f"unknown dtype '{name}': use one of {', '.join(DTYPES)}"
        ) from None


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    # Available physical memory; page cache the kernel can drop counts as available.
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(needed_bytes: int, device: torch.device, what: str, reclaimable: int = 0) -> None:
    """OUT_OF_MEMORY when `needed_bytes` exceed the free memory plus what unloading would give back."""
    free = free_memory_bytes(device) + reclaimable
    if needed_bytes > free:
        raise EngineFailure(
            ErrorCode.OUT_OF_MEMORY,
            f"{what} needs {needed_bytes / 2**30:.1f} GiB on {device}, only {free / 2**30:.1f} GiB is free",
        )


def visible_devices() -> list[DeviceChoice]:
    """What Settings > Device offers: 'auto', the CPU, and every GPU this torch sees (none on a
    CPU-only build). A ROCm torch lists its GPUs as cuda:N too."""
    gpus: list[DeviceChoice] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            label = f"cuda:{index} · {props.name}, {props.total_memory / 2**30:.0f} GiB"
            gpus.append(DeviceChoice(f"cuda:{index}", label))
    first = gpus[0].name if gpus else "cpu"
    return [DeviceChoice("auto", f"auto (here: {first})"), DeviceChoice("cpu", "cpu"), *gpus]
