"""Fixtures shared by the CPU kernel tests of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ds4desk.engine.kernels.quant import gguf_cpu


@pytest.fixture(params=["avx512", "portable"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test runs on the AVX-512 kernels (where the CPU has them) and on the portable ones, with
    prefill's products in float32 (BF16_PREFILL off, also where the environment asks for it):
    test_gguf_cpu.py holds the bfloat16 ones to their own bound."""
    ext = gguf_cpu._ext
    if ext is None:
        pytest.skip("the C extension is not built")
    if request.param == "avx512" and ext.set_isa("best") != "avx512":
        pytest.skip("this CPU has no AVX-512")
    if request.param == "portable":
        ext.set_isa("portable")
    try:
        with gguf_cpu.BF16_PREFILL.force(False):
            yield request.param
    finally:
        ext.set_isa("best")
