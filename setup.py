"""Builds ds4desk's one C extension: the CPU kernels for GGUF-packed weights.

Everything else about the package lives in pyproject.toml. The extension is optional: where no C
compiler (or no OpenMP) is available the install still succeeds, and
ds4desk/engine/kernels/quant/gguf_cpu.py then reports the kernels as missing and the engine falls
back to its torch reference.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup

# -ffp-contract=off: the kernels reproduce the reference's float32 operations one by one, so the
# compiler must not fuse a multiply and an add on its own (the C code asks for FMAs explicitly).
compile_args = ["-O3", "-std=gnu11", "-ffp-contract=off"]
link_args: list[str] = []
if sys.platform.startswith("linux"):
    # libgomp.so.1: at run time this is the copy torch already loaded (same soname), one thread pool.
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")

setup(
    ext_modules=[
        Extension(
            "ds4desk.engine.kernels.quant._gguf_cpu",
            sources=["ds4desk/engine/kernels/quant/gguf_cpu.c"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        )
    ]
)
