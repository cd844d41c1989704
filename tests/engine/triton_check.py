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


def hopper_ptxas_report(
    tmp_path: Path,
    kernel: object,
    signature: dict[str, str],
    constants: dict[str, object],
    warps: int,
    stages: int | None = None,
) -> str:
    """A real sm_90 compile of one launch of `kernel`, ahead of time (no GPU needed), then ptxas:
    its report (registers, spills). `signature` names the arguments' types, `constants` the
    constexprs, `stages` the launch's num_stages where it sets one. Skips where Triton is not
    installed."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = signature | dict.fromkeys(constants, "constexpr")
    names = list(signature)
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    options = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ptx_file = tmp_path / "kernel.ptx"
    ptx_file.write_text(compiled.asm["ptx"])
    args = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx_file), "-o", str(tmp_path / "kernel.o")]
    report = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    return report.stderr + report.stdout
