"""Row buckets for prefill products on a GPU.

cuBLAS picks its GEMM kernel by row count, in fine steps, and its first call at a row count it has
not met costs 4-5 ms a matrix shape on an H200 (docs/BENCHMARKS.md, bench/cublas_first_calls.py):
a prompt of a new length paid that in every layer. So prefill products of more than FEW_ROWS rows
run at their row count's bucket (the next power of two up to PREFILL_ROW_STEP, then a multiple of
it), and the load's warm-up runs a prompt of each bucket once (CausalLM.prefill_row_buckets): no
prompt length meets a first call. The dense family pads whole chunks (models/llama); DeepSeek-V4,
whose compressors and ring would take padding rows in, pads each product's rows (`bucketed`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

FEW_ROWS = 16  # a verify step's or a prompt piece's tokens, and packed weights' few-row kernels
PREFILL_ROW_STEP = 256


def prefill_rows(count: int) -> int:
    """The bucket of `count` > FEW_ROWS rows (see PREFILL_ROW_STEP)."""
    if count >= PREFILL_ROW_STEP:
        return -(-count // PREFILL_ROW_STEP) * PREFILL_ROW_STEP
    return 1 << (count - 1).bit_length()


def buckets(count: int, limit: int) -> list[int]:
    """The buckets of FEW_ROWS + 1 .. count rows that are at most `limit` (a warm-up's prompts: a
    chunk's bucket may pass the chunk, 3,000 rows run as 3,072, never the context)."""
    found = {prefill_rows(rows) for rows in range(FEW_ROWS + 1, count + 1)}
    return sorted(rows for rows in found if rows <= limit)


def bucketed(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """product(x) for x [..., K], whose rows are independent of each other, run on x's rows padded
    with zeros to their bucket and cut back: the result is x's rows' own."""
    rows = x.numel() // x.shape[-1]
    bucket = prefill_rows(rows) if rows > FEW_ROWS else rows
    if bucket == rows:
        return product(x)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, bucket - rows))
    out = product(flat)
    return out[:rows].view(*x.shape[:-1], out.shape[-1])
