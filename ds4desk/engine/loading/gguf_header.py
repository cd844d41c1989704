"""A strict reader for the header of a GGUF file (metadata + tensor table), written for untrusted input.

GGUF layout (v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count, the
key/value metadata, the tensor infos (name, n_dims, u64 dims in ggml "ne" order, u32 ggml type,
u64 offset relative to the aligned data section), padding to `general.alignment`, then the data.

We parse it ourselves instead of using gguf.GGUFReader because every count in the header comes from
the file: GGUFReader walks an array element by element even when its claimed length is far past the
end of the file, so a corrupt length can spin for hours. Here every count is checked against the
bytes that are actually left before it is used, and every tensor's data range against the file size.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ds4desk.engine.api import EngineFailure, ErrorCode

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts and predates every model worth loading
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8  # ggml itself has 4; anything far beyond that is a corrupt header
MAX_ARRAY_NESTING = 2
# Metadata is parsed into Python objects, which take about ten times the bytes they came from, so
# its size is bounded before anything is parsed: the largest real vocabularies (262k tokens with
# their scores, types and merges) stay far below both limits.
MAX_ARRAY_ELEMENTS = 2**22
MAX_METADATA_BYTES = 256 * 2**20
# `<arch>.block_count` sizes everything built per layer: refused above this before anything is.
MAX_LAYERS = 1024

# GGUF value type id -> (struct format, size) for scalars.
_U64 = struct.Struct("<Q")
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),  # UINT8
    1: ("<b", 1),  # INT8
    2: ("<H", 2),  # UINT16
    3: ("<h", 2),  # INT16
    4: ("<I", 4),  # UINT32
    5: ("<i", 4),  # INT32
    6: ("<f", 4),  # FLOAT32
    7: ("<?", 1),  # BOOL
    10: ("<Q", 8),  # UINT64
    11: ("<q", 8),  # INT64
    12: ("<d", 8),  # FLOAT64
}
_NUMPY_SCALARS: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING = 8
_ARRAY = 9


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy / PyTorch order (ggml's "ne" reversed): rows first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file, already checked to lie inside it
    nbytes: int


@dataclass(slots=True)
class GGUFHeader:
    path: Path
    version: int
    file_size: int
    data_start: int
    metadata: dict[str, object] = field(default_factory=dict)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)


class _BadGGUF(Exception):
    """Internal: a problem found while walking the header; becomes a LOAD_FAILED with the file name."""


class _Cursor:
    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _BadGGUF(f"truncated: {what} needs {n} bytes at offset {self.pos}, file has {self.size}")

    def scalar(self, vtype: int, what: str) -> int | float | bool:
        fmt, size = _SCALARS[vtype]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(10, what))

    def raw_string(self, what: str) -> bytes:
        n = self.u64(f"{what} length")
        self.need(n, what)
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def key(self, what: str) -> str:
        try:
            return self.raw_string(what).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadGGUF(f"{what} is not UTF-8") from exc

    def text(self, what: str) -> str:
        # Values are data (token strings, templates); a stray invalid byte should not reject the file.
        text = self.raw_string(what).decode("utf-8", errors="replace")
        if self.pos > MAX_METADATA_BYTES:  # checked as it goes: an array of strings is parsed one by one
            raise _BadGGUF(f"its metadata is larger than {MAX_METADATA_BYTES // 2**20} MiB")
        return text

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings as `text` reads them, in one loop: a tokenizer's vocabulary and merges are
        100k-500k strings, and the method calls per string were most of a header's read time."""
        buf, size, pos = self.buf, self.size, self.pos
        length_at = _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what} length")
            (n,) = length_at(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, what)
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
            if pos > MAX_METADATA_BYTES:
                raise _BadGGUF(f"its metadata is larger than {MAX_METADATA_BYTES // 2**20} MiB")
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.text(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise _BadGGUF(f"{what}: arrays nested too deeply")
            etype = self.u32(f"{what} element type")
            count = self.u64(f"{what} element count")
            return self.array(etype, count, what, depth)
        raise _BadGGUF(f"{what} has unknown value type {vtype}")

    def array(self, etype: int, count: int, what: str, depth: int) -> list[object]:
        if count > MAX_ARRAY_ELEMENTS:
            raise _BadGGUF(
                f"{what} claims {count} elements; metadata arrays are limited to {MAX_ARRAY_ELEMENTS}"
            )
        if etype in _NUMPY_SCALARS:
            size = _SCALARS[etype][1]
            self.need(count * size, what)
            data = self.buf[self.pos : self.pos + count * size]
            self.pos += count * size
            return np.frombuffer(data, dtype=_NUMPY_SCALARS[etype], count=count).tolist()
        if etype == _STRING:
            # Each string takes at least its 8-byte length, which bounds a lying count up front.
            self.need(count * 8, what)
            return self.strings(count, what)
        if etype == _ARRAY:
            self.need(count * 12, what)
            return [self.value(_ARRAY, what, depth + 1) for _ in range(count)]
        raise _BadGGUF(f"{what} has unknown element type {etype}")


def _bad(path: Path, problem: str) -> EngineFailure:
    return EngineFailure(ErrorCode.LOAD_FAILED, f"{path.name} is not a valid GGUF file ({problem})")


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and check the header; raises EngineFailure(LOAD_FAILED) naming the file on any problem."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size < 24:
            raise _bad(path, f"the file is only {size} bytes")
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, _Cursor(buf, size))
    except EngineFailure:
        raise
    except _BadGGUF as exc:
        raise _bad(path, str(exc)) from None
    except OSError as exc:
        raise EngineFailure(ErrorCode.LOAD_FAILED, f"cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, OverflowError, MemoryError, struct.error) as exc:
        raise _bad(path, f"{type(exc).__name__}: {exc}") from None


def _parse(path: Path, cur: _Cursor) -> GGUFHeader:
    cur.need(4, "magic")
    if cur.buf[0:4] != GGUF_MAGIC:
        raise _BadGGUF("it does not start with the GGUF magic bytes")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in (2, 3):
            raise _BadGGUF("it is a big-endian GGUF, which ds4desk does not read")
        raise _BadGGUF(f"unsupported GGUF version {version}; ds4desk reads versions 2 and 3")
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata count")
    left = cur.size - cur.pos
    # Smallest possible entries: a key/value is 8+4+1 bytes, a tensor info 8+4+4+8.
    if kv_count * 13 > left or tensor_count * 24 > left:
        raise _BadGGUF(f"header claims {kv_count} metadata entries and {tensor_count} tensors, more than fit")

    header = GGUFHeader(path=path, version=version, file_size=cur.size, data_start=0)
    for _ in range(kv_count):
        key = cur.key("metadata key")
        vtype = cur.u32(f"type of '{key}'")
        if key in header.metadata:
            raise _BadGGUF(f"metadata key '{key}' appears twice")
        header.metadata[key] = cur.value(vtype, f"'{key}'")
        if cur.pos > MAX_METADATA_BYTES:
            raise _BadGGUF(f"its metadata is larger than {MAX_METADATA_BYTES // 2**20} MiB")
        if key.endswith(".block_count"):
            layers = header.metadata[key]
            if type(layers) is not int or not 0 < layers <= MAX_LAYERS:
                raise _BadGGUF(f"'{key}' is {layers!r}; ds4desk loads models of 1..{MAX_LAYERS} layers")

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cur.key("tensor name")
        n_dims = cur.u32(f"rank of tensor '{name}'")
        if n_dims > MAX_DIMS:
            raise _BadGGUF(f"tensor '{name}' claims {n_dims} dimensions")
        ne = tuple(cur.u64(f"shape of tensor '{name}'") for _ in range(n_dims))
        raw_type = cur.u32(f"type of tensor '{name}'")
        offset = cur.u64(f"offset of tensor '{name}'")
        infos.append((name, ne, raw_type, offset))

    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise _BadGGUF(f"general.alignment {alignment!r} is not a positive power of two")
    header.data_start = -(-cur.pos // alignment) * alignment

    for name, ne, raw_type, offset in infos:
        if name in header.tensors:
            raise _BadGGUF(f"tensor '{name}' appears twice")
        header.tensors[name] = _check_tensor(header, name, ne, raw_type, offset, alignment)
    return header


def _check_tensor(
    header: GGUFHeader, name: str, ne: tuple[int, ...], raw_type: int, offset: int, alignment: int
) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise _BadGGUF(f"tensor '{name}' has unknown ggml type {raw_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if not ne:
        ne = (1,)
    n_elements = math.prod(ne)
    # A row (ne[0]) is stored as whole quantization blocks.
    if ne[0] % block_size:
        raise _BadGGUF(f"tensor '{name}' row length {ne[0]} is not a multiple of the {qtype.name} block size")
    nbytes = n_elements // block_size * type_size
    if offset % alignment:
        raise _BadGGUF(f"tensor '{name}' data offset {offset} is not aligned to {alignment}")
    begin = header.data_start + offset
    end = begin + nbytes
    if end > header.file_size:
        raise _BadGGUF(
            f"truncated: tensor '{name}' needs bytes {begin}..{end} but the file has only {header.file_size}"
        )
    return GGUFTensor(name=name, shape=tuple(reversed(ne)), qtype=qtype, offset=begin, nbytes=nbytes)
