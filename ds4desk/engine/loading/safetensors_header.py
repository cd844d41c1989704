"""Read and check a .safetensors header ourselves, before any library touches the data.

Layout (the safetensors spec): 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON mapping
tensor name -> {"dtype", "shape", "data_offsets": [begin, end]} (plus an optional
"__metadata__" of strings), then the data section the offsets point into. Every number in the
header comes from an untrusted file, so each one is checked against the real file size here and
the loader can trust a TensorEntry without looking again.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.loading.source import TensorEntry

# A real header is a few hundred KB (a few MB for a single file of ~100k tensors). The parsed JSON
# takes about 17x its bytes in Python objects, so the reference implementation's 100 MB limit
# would cost 1.7 GB before a refusal; 16 MiB bounds that at under 300 MB.
MAX_HEADER_BYTES = 16 * 2**20

# Bits per element. Sub-byte types (FP4/FP6) pack several elements into a byte.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}


def _fail(path: Path, problem: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, f"{path.name} is not a valid safetensors file: {problem}")


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes a tensor of this dtype and shape occupies; None when the bit count is not whole bytes."""
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of the file, keyed by name, with offsets already checked against the file size."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(
                    path, f"the file is only {file_size} bytes, shorter than the 8-byte header length"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise _fail(
                    path, f"header length {header_len} bytes is implausible (limit {MAX_HEADER_BYTES})"
                )
            if header_len > file_size - 8:
                raise _fail(
                    path,
                    f"header length {header_len} bytes is larger than the rest of the file "
                    f"({file_size - 8} bytes); the file is truncated or not safetensors",
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) != header_len:  # the file shrank under us
        raise _fail(path, "the header could not be read completely")

    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _fail(path, "the header is not UTF-8 text") from exc
    except (ValueError, RecursionError) as exc:
        raise _fail(path, f"the header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _fail(path, "the header is not a JSON object")

    data_size = file_size - 8 - header_len
    entries: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue  # free-form strings; nothing we read depends on them
        entries[name] = _check_entry(path, name, spec)

    if entries:
        promised = max(e.end for e in entries.values())
        if promised > data_size:
            raise EngineFailure(
                ErrorCode.LOAD_FAILED,
                f"{path.name} is truncated: header promises {promised} bytes of data, file has {data_size}",
            )
        # Overlapping tensors would let one write alias another; sorting makes the check cheap.
        spans = sorted((e.begin, e.end, n) for n, e in entries.items() if e.end > e.begin)
        for (_, prev_end, prev_name), (begin, _, name) in itertools.pairwise(spans):
            if begin < prev_end:
                raise _fail(path, f"tensors '{prev_name}' and '{name}' overlap in the data section")
    return entries


def _check_entry(path: Path, name: str, spec: object) -> TensorEntry:
    if not isinstance(spec, dict):
        raise _fail(path, f"entry '{name}' is not an object")
    dtype = spec.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _fail(path, f"tensor '{name}' has unknown dtype {dtype!r}")
    shape = spec.get("shape")
    # `type(d) is int` because JSON true/false would otherwise pass as 1/0.
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(
            path, f"tensor '{name}' has a bad shape {shape!r} (expected a list of non-negative integers)"
        )
    offsets = spec.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _fail(path, f"tensor '{name}' has bad data_offsets {offsets!r}")
    dims = tuple(shape)
    expected = tensor_nbytes(dtype, dims)
    if expected is None:
        raise _fail(path, f"tensor '{name}' ({dtype} {list(dims)}) does not fill a whole number of bytes")
    begin, end = offsets
    if end - begin != expected:
        raise _fail(
            path,
            f"tensor '{name}' ({dtype} {list(dims)}) needs {expected} bytes "
            f"but its offsets span {end - begin}",
        )
    return TensorEntry(file=path, dtype=dtype, shape=dims, begin=begin, end=end)
