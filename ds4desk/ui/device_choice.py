"""Which device a load may use, judged against the devices the engine side says this torch sees.

A saved device that this machine does not have (cuda on a CPU-only build, cuda:1 with one GPU)
must not break every later start: the load goes to the first GPU, else the CPU, and the window
says why. The saved setting is left as it is (the GPU may be back next time); the notice says
where to change it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from ds4desk.engine.api import DeviceChoice

# Asks the engine side for the devices; None in the window means "not known" (nothing is checked).
DeviceLister = Callable[[], Awaitable[list[DeviceChoice]]]


@dataclass(slots=True, frozen=True)
class DeviceFallback:
    wanted: str
    instead: str
    why: str


def canonical(name: str) -> str:
    """'CUDA' and 'cuda' name the first GPU, as torch reads them."""
    word = name.strip().lower()
    return "cuda:0" if word == "cuda" else word


def fallback_for(wanted: str, choices: Sequence[DeviceChoice]) -> DeviceFallback | None:
    """Where to load instead of `wanted`, and why; None when `wanted` is a device this machine has."""
    word = canonical(wanted or "auto")
    if word in ("auto", "cpu") or word in {canonical(c.name) for c in choices}:
        return None
    gpus = [c.name for c in choices if c.name.startswith("cuda")]
    instead = gpus[0] if gpus else "cpu"
    have = ", ".join(c.name for c in choices if c.name != "auto") or "cpu"
    why = (
        f"The device {wanted} is not on this machine (it has {have}), so the model loads on {instead} "
        "instead. Choose another device in Settings > Device."
    )
    return DeviceFallback(wanted, instead, why)


def choices_with(saved: str, choices: Sequence[DeviceChoice] | None) -> list[DeviceChoice]:
    """What Settings > Device lists: the engine's devices (only auto and the CPU while they are not
    known), plus the saved one marked as missing when this machine does not have it, so the dialog
    shows the truth instead of silently changing it."""
    listed = list(choices) if choices else [DeviceChoice("auto", "auto"), DeviceChoice("cpu", "cpu")]
    word = canonical(saved or "auto")
    if all(canonical(c.name) != word for c in listed):
        note = "not on this machine" if choices else "not checked yet"
        listed.append(DeviceChoice(saved, f"{saved} ({note})"))
    return listed
