"""The packed GEMV for every token count a verify step uses (T = 1..16, gguf_cpu.GEMV_MAX_T), for
every type the kernels cover, on the AVX-512 and the portable kernels: equal to dequantize + float32
matmul (gguf_matmul.reference_matmul) to accumulation-order error, and each row of the result bit
for bit the one-token product of that row of x alone, whatever T is and however the kernel splits
the T rows into passes (up to eight rows a pass; fewer where the rows of x would not stay in L1).
That second property is what makes a speculative verify step's logits exactly a decode step's."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.formats import GgufType
from ds4desk.engine.kernels.quant import gguf_cpu
from tests.engine.kernels.quant.test_gguf_cpu import (
    COVERED,
    assert_close_to_reference,
    needs_extension,
    packed_weight,
)

TOKENS = range(1, gguf_cpu.GEMV_MAX_T + 1)


@pytest.mark.parametrize("wide", [False, True], ids=["512-cols", "2048-cols"])
@pytest.mark.parametrize("kind", COVERED, ids=lambda t: t.name)
@needs_extension
def test_every_verify_size_is_the_reference_and_each_row_its_own_decode(
    kind: GgufType, wide: bool, isa: str
) -> None:
    # 512 columns: eight rows of x a pass; 2048 (8 KiB a row of x): the kernel's smaller passes.
    # 37 rows: thread chunks that do not split evenly.
    rows, cols = 37, 2048 if wide else 512
    raw = packed_weight(kind, rows, cols, seed=kind.type_id + (100 if wide else 0))
    x = torch.randn(gguf_cpu.GEMV_MAX_T, cols, generator=torch.Generator().manual_seed(kind.type_id))
    alone = torch.empty(gguf_cpu.GEMV_MAX_T, rows)
    for t in range(gguf_cpu.GEMV_MAX_T):
        gguf_cpu.matmul(x[t : t + 1], raw, kind.type_id, cols, alone[t : t + 1])
    assert_close_to_reference(x, raw, kind, cols, alone)
    for tokens in TOKENS:
        out = torch.full((tokens, rows), float("nan"))
        gguf_cpu.matmul(x[:tokens], raw, kind.type_id, cols, out)
        assert_close_to_reference(x[:tokens], raw, kind, cols, out)
        same = out.view(torch.int32) == alone[:tokens].view(torch.int32)
        differing = (~same.all(1)).nonzero()[:, 0].tolist()
        assert not differing, f"{kind.name} T={tokens}: rows of x {differing} differ from their decode"


@needs_extension
def test_verify_sizes_take_the_gemv_not_the_prefill_paths(monkeypatch) -> None:
    """Up to GEMV_MAX_T rows of x take the GEMV (a verify step's head would otherwise decode 49152 x
    576 floats a step); more rows the prefill GEMM (AVX-512) or the dequantized tiles."""
    kind = COVERED[0]
    raw = packed_weight(kind, 8, 512, seed=1)
    calls: list[str] = []
    ext = gguf_cpu._ext

    def counting(name: str):
        real = getattr(ext, name)

        def call(*args: object) -> object:
            calls.append(name)
            return real(*args)

        return call

    for name in ("gemv", "gemm", "dequantize"):
        monkeypatch.setattr(ext, name, counting(name))
    gguf_cpu.matmul(torch.randn(16, 512), raw, kind.type_id, 512, torch.empty(16, 8))
    assert calls == ["gemv"]
    calls.clear()
    gguf_cpu.matmul(torch.randn(17, 512), raw, kind.type_id, 512, torch.empty(17, 8))
    assert calls == (["gemm"] if gguf_cpu.kernel_isa() == "avx512" else ["gemm", "dequantize"])
