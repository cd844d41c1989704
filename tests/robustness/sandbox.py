"""Where a hostile case may write, and how to tell that it wrote nowhere else.

A process under test gets a data directory (`--data-dir`), and everything else a process could
write to by default points into the sandbox too: its working directory, HOME, the XDG folders and
TMPDIR. Afterwards every one of those must be as it was (empty): whatever ds4desk writes belongs
in the data directory. Its peak memory comes from /proc: VmHWM, reset per case through clear_refs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Sandbox:
    data: Path  # the --data-dir: the one place ds4desk may write
    cwd: Path
    home: Path
    tmp: Path

    @classmethod
    def make(cls, root: Path) -> Sandbox:
        box = cls(data=root / "data", cwd=root / "cwd", home=root / "home", tmp=root / "tmp")
        for folder in (box.data, box.cwd, box.home, box.tmp):
            folder.mkdir(parents=True, exist_ok=True)
        return box

    @property
    def env(self) -> dict[str, str]:
        home = str(self.home)
        return {
            **os.environ,
            "HOME": home,
            "XDG_CONFIG_HOME": f"{home}/.config",
            "XDG_DATA_HOME": f"{home}/.local/share",
            "XDG_CACHE_HOME": f"{home}/.cache",
            "XDG_STATE_HOME": f"{home}/.local/state",
            "TMPDIR": str(self.tmp),
        }

    def written_outside_data(self) -> list[str]:
        """Every file or folder that appeared where ds4desk has no business writing."""
        found = {p for root in (self.cwd, self.home, self.tmp) for p in root.rglob("*")}
        return sorted(str(p) for p in found)


def peak_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM) since it started or since `reset_peak`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for process {pid}")


def reset_peak(pid: int) -> None:
    """From now on VmHWM counts from the current resident size (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
