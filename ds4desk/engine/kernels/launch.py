"""What every kernel module shares: its on/off switch, and running Triton launchers on the right GPU.

The convention of a kernel module (one module in kernels/ per kernel or family of kernels):
- `reference` (or `reference_<op>` where a module has several ops): the same math in plain torch.
  It is what runs where the kernel does not (CPU, ROCm, no Triton) and what the tests hold the
  kernel to.
- A torch custom op with a fake (`register_fake`) around the kernel, so a CUDA graph capture and a
  dispatch-level op counter (bench/count_ops.py) see one op, and torch can trace it without running
  it. Its body runs the kernel on CUDA tensors (`Switch.kernel_runs_on`) and the reference
  elsewhere. The GEMV launchers (dense/gemv.py, the one-row FP8 GEMV and the grouped FP4 product)
  and silu_mul are plain launches, called where their switch says they run.
- `SWITCH`, a `Switch` registered here, and `enabled(where)`, the module's one check of it: whether
  a caller takes the kernel path for tensors on `where`. Triton source too long for its module goes
  into `<module>_triton.py`, imported only where Triton is (deepseek_v4/hc_fused_triton.py).
- A test in tests/engine/kernels/ (the mirror of the module's path) that holds the kernel to the
  reference: on CUDA the real kernel, without a GPU Triton's interpreter (TRITON_INTERPRET=1, in a
  subprocess: tests/engine/triton_check.py).

Tests and benchmarks flip switches through `Switch.force` or, several at once, `force`; both
restore the previous values. `switches()` lists every switch of the kernels (bench, docs).

Triton launches on the current device, and a layer split puts layers (and their tensors) on other
GPUs than the current one: every launcher goes through `on_its_device`."""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

_T = TypeVar("_T")

# A tensor, or the device of the tensors a check is made for.
Where = torch.Tensor | torch.device

_SWITCHES: dict[str, Switch] = {}


@dataclass(slots=True, eq=False)
class Switch:
    """A kernel's on/off switch. `forced` None (the default): the kernel where `runs_here(where, ...)`
    says it runs (each module's rule; typically an NVIDIA GPU from Ampere on, with Triton); True:
    always the kernel path, whatever the device (on the CPU a custom op's body is the reference, and
    the launches that have no op run the kernel: Triton's interpreter in the tests); False: never.
    A module's check may add what no forcing can do without: Triton for the quantized kernels
    (quant/fp8.py, quant/fp4.py), a CUDA tensor for programmatic dependent launch (`pdl`).

    `kernel_on_cpu` (tests only): a custom op's body runs the Triton kernel on CPU tensors too,
    which Triton's interpreter does (TRITON_INTERPRET=1)."""

    name: str
    doc: str
    runs_here: Callable[..., bool]
    forced: bool | None = None
    kernel_on_cpu: bool = False

    def __post_init__(self) -> None:
        _SWITCHES[self.name] = self

    def on(self, where: Where, *more: object) -> bool:
        """Whether the kernel path is taken for `where` (more: what else the module's rule needs)."""
        if self.forced is not None:
            return self.forced
        return self.runs_here(where, *more)

    def kernel_runs_on(self, tensor: torch.Tensor) -> bool:
        """Inside a custom op: whether its body runs the Triton kernel for `tensor` (CUDA tensors; CPU
        ones too with kernel_on_cpu) rather than the reference."""
        return tensor.is_cuda or self.kernel_on_cpu

    @contextmanager
    def force(self, value: bool | None) -> Iterator[None]:
        """Within the block, `forced` is `value`; the previous value comes back after it."""
        before = self.forced
        self.forced = value
        try:
            yield
        finally:
            self.forced = before


@contextmanager
def force(settings: Mapping[Switch | str, bool | None]) -> Iterator[None]:
    """Several switches forced at once (each given as itself or by name), restored after the block."""
    with ExitStack() as stack:
        for key, value in settings.items():
            switch = key if isinstance(key, Switch) else _named(key)
            stack.enter_context(switch.force(value))
        yield


def switches() -> list[Switch]:
    """Every switch of the kernels, by name: imports every kernel module, as each declares its own
    (not the `*_triton` modules of bare Triton source, which import Triton)."""
    package = importlib.import_module(__package__ or "ds4desk.engine.kernels")
    for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        if not module.name.endswith("_triton"):
            importlib.import_module(module.name)
    return sorted(_SWITCHES.values(), key=lambda switch: switch.name)


def _named(name: str) -> Switch:
    if name not in _SWITCHES:
        switches()
    if name not in _SWITCHES:
        raise KeyError(f"no kernel switch {name!r}; there are {[switch.name for switch in switches()]}")
    return _SWITCHES[name]


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


def nvidia(where: Where) -> bool:
    """Whether the fused Triton kernels run there: an NVIDIA GPU from Ampere on (bf16 tiles; they
    were written and checked for sm_80+ and an H200, never on ROCm, whose tensors are "cuda" too)."""
    device = where.device if isinstance(where, torch.Tensor) else where
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 8


def _pdl_runs_here(t: torch.Tensor) -> bool:
    if torch.version.hip is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(t.device.index or 0) >= 9


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it finishes, and waits for that kernel's results in `griddepcontrol.wait`; the decode
# kernels stream weights that no earlier kernel writes before that wait, which hides the gap between
# two small kernels.
PDL = Switch(
    "launch.pdl",
    "programmatic dependent launch of the decode kernels (CUDA capability 9+, not Triton's interpreter)",
    _pdl_runs_here,
)


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels for `t` launch with programmatic dependent launch (see PDL): never for a CPU
    tensor, even forced on."""
    return t.is_cuda and PDL.on(t)


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
