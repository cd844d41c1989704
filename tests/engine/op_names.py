"""Recording the aten ops a call dispatches: what a CUDA graph capture or bench/count_ops.py sees,
so a fused custom op shows up as one name."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
