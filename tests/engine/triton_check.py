"""Running a Triton kernel check script: on CUDA the real kernels; without a GPU, Triton's
interpreter (TRITON_INTERPRET=1: the same kernel source, run by numpy), in a subprocess because
the interpreter is chosen when Triton is imported. Skips where Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run_triton_check(script: str) -> str:
    """Run `script` with the repository importable; returns its stdout (it must exit 0)."""
    pytest.importorskip("triton")
    env = {**os.environ}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
