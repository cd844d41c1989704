"""Microbenchmark of the CPU GGUF kernels (quant/gguf_cpu.py) on SmolLM2-135M's real weights.

For every projection shape of the embedded SmolLM2 GGUF (read from the file: hidden, ffn, heads, kv
heads, vocab) it times the decode GEMV (T = 1) three ways, best of several repeats:
  packed   gguf_cpu.matmul on the file's blocks (weight hot in cache: one tensor, called in a loop),
  float32  torch.mm on the dequantized float32 weight (what a float model does),
  floor    the packed bytes / the measured memcpy bandwidth (what reading the bytes costs at least;
           the whole-token line also gives it at the read-only bandwidth, which is higher).
Then a whole token: every projection of all layers and the tied head in model order, each its own
tensor (so the ~96 MB of weights stream from memory, as in real decode), packed vs float32.

    .venv/bin/python bench/cpu_gguf_matmul.py [--repeats 7] [--threads N] [--tokens 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGUFReader

from ds4desk.engine.formats import GGUF_TYPES
from ds4desk.engine.kernels.quant import gguf, gguf_cpu
from ds4desk.engine.loading.default_model import default_model_path

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def best_seconds(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """The best over `repeats` of the mean time of `inner` back-to-back calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def memcpy_bandwidth(repeats: int) -> float:
    """Bytes read per second by a large copy (256 MiB: far beyond the caches)."""
    src = torch.ones(1 << 26)
    dst = torch.empty_like(src)
    return src.numel() * 4 / best_seconds(lambda: dst.copy_(src), repeats, 3)


def read_bandwidth(repeats: int) -> float:
    """Bytes per second of a read-only pass over 256 MiB (a sum: what a GEMV's weight stream can get)."""
    src = torch.ones(1 << 25, dtype=torch.int64)
    return src.numel() * 8 / best_seconds(lambda: src.sum(), repeats, 3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=1, help="rows of x (1 = decode)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {gguf_cpu.kernel_isa()}, torch threads: {torch.get_num_threads()}, T = {args.tokens}")

    path = default_model_path()
    reader = GGUFReader(path)
    fields = {k: v.parts[-1][0] for k, v in reader.fields.items() if k.startswith("llama.")}
    print(
        f"{path.name}: hidden {fields['llama.embedding_length']}, ffn {fields['llama.feed_forward_length']}, "
        f"heads {fields['llama.attention.head_count']}, kv heads {fields['llama.attention.head_count_kv']}, "
        f"layers {fields['llama.block_count']}, vocab {fields['llama.vocab_size']}"
    )
    tensors = {t.name: t for t in reader.tensors}

    def packed(name: str) -> tuple[torch.Tensor, int, int]:
        t = tensors[name]
        cols, rows = (int(n) for n in t.shape[:2])
        raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        return torch.from_numpy(raw.copy()), int(t.tensor_type), cols

    layers = int(fields["llama.block_count"])
    order = [f"blk.{i}.{p}.weight" for i in range(layers) for p in PROJECTIONS]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    order.append(head)
    weights = {name: packed(name) for name in order}

    bandwidth = memcpy_bandwidth(args.repeats)
    read_only = read_bandwidth(args.repeats)
    print(f"memcpy bandwidth: {bandwidth / 1e9:.2f} GB/s read; read-only pass {read_only / 1e9:.2f} GB/s")
    header = f"{'tensor':<14}{'type':<6}{'rows x cols':>13}{'KiB':>8}"
    print(f"\n{header}{'packed us':>11}{'float32 us':>12}{'floor us':>10}")
    per_token_packed = per_token_float = per_token_floor = 0.0
    for proj in (*PROJECTIONS, "head"):
        name = head if proj == "head" else f"blk.0.{proj}.weight"
        raw, type_id, cols = weights[name]
        rows = raw.shape[0]
        w_t = gguf.dequantize(raw, type_id, (rows, cols)).t()
        x = torch.randn(args.tokens, cols)
        out = torch.empty(args.tokens, rows)
        inner = max(3, int(2e7 // raw.numel()))
        t_packed = best_seconds(
            lambda: gguf_cpu.matmul(x, raw, type_id, cols, out),  # noqa: B023 (called right here)
            args.repeats,
            inner,
        )
        t_float = best_seconds(lambda: torch.mm(x, w_t, out=out), args.repeats, inner)  # noqa: B023
        t_floor = raw.numel() / bandwidth
        count = 1 if proj == "head" else layers
        per_token_packed += count * t_packed
        per_token_float += count * t_float
        per_token_floor += count * t_floor
        print(
            f"{proj:<14}{GGUF_TYPES[type_id].name:<6}{f'{rows}x{cols}':>13}{raw.numel() / 1024:>8.0f}"
            f"{t_packed * 1e6:>11.1f}{t_float * 1e6:>12.1f}{t_floor * 1e6:>10.1f}"
        )
    total_bytes = sum(raw.numel() for raw, _, _ in weights.values())
    print(
        f"\nsum per token (hot weights): packed {per_token_packed * 1e3:.2f} ms, "
        f"float32 {per_token_float * 1e3:.2f} ms, floor {per_token_floor * 1e3:.2f} ms "
        f"({total_bytes / 1e6:.1f} MB packed)"
    )

    # A whole token in model order, every weight its own tensor: they stream from memory.
    xs = {cols: torch.randn(args.tokens, cols) for _, _, cols in weights.values()}
    outs = {name: torch.empty(args.tokens, raw.shape[0]) for name, (raw, _, _) in weights.items()}

    def token_packed() -> None:
        for name, (raw, type_id, cols) in weights.items():
            gguf_cpu.matmul(xs[cols], raw, type_id, cols, outs[name])

    # The best single token of several: other programs on the cores only ever make a token slower.
    t_token = best_seconds(token_packed, 3 * args.repeats, 1)
    print(
        f"whole token, packed (streamed): {t_token * 1e3:.2f} ms = {1 / t_token:.0f} matmul-tokens/s, "
        f"{total_bytes / t_token / 1e9:.1f} GB/s of packed weights"
    )
    floats = {name: gguf.dequantize(raw, t, (raw.shape[0], c)).t() for name, (raw, t, c) in weights.items()}

    def token_float() -> None:
        for name, (_, _, cols) in weights.items():
            torch.mm(xs[cols], floats[name], out=outs[name])

    t_token_float = best_seconds(token_float, 3 * args.repeats, 1)
    print(f"whole token, float32 torch.mm (streamed): {t_token_float * 1e3:.2f} ms")
    print(
        f"whole token, bytes floor: {total_bytes / bandwidth * 1e3:.2f} ms at the memcpy bandwidth, "
        f"{total_bytes / read_only * 1e3:.2f} ms at the read-only bandwidth"
    )


if __name__ == "__main__":
    main()
