"""A lean GGUF header reader: the key/value metadata and the tensor directory, nothing else.

`gguf.GGUFReader` builds numpy objects for every metadata value, the vocabulary's strings
included: for a 262K-token vocabulary that is hundreds of MB of short-lived objects at
every server start (peak RSS +600 MB on the embedded model, more than the model itself).
Here arrays of strings are skipped and reported by their length, numeric arrays are kept
only when short, and the file is read through one memory map, so only the header's pages
are ever touched.

Format (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, key count u64;
each key a string (u64 length + bytes), a value type u32 and the value (an array is an
element type u32, a count u64 and the elements); then per tensor its name, n_dims u32,
dims u64 x n_dims, ggml type u32 and data offset u64.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Fixed-size value types: numpy dtype by GGUF value type (scalars and array elements).
_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
MAX_ARRAY = 65536  # longer numeric arrays are reported by their length only


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne[0] first


@dataclass(frozen=True, slots=True)
class Header:
    """Scalars as Python values, strings as str, numeric arrays (up to MAX_ARRAY) as
    lists, longer arrays and every array of strings as their length (an int)."""

    fields: dict[str, object]
    tensors: list[TensorEntry]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self) -> str:
        n = self.u64()
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, pos = self.buf, self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self.string()
        is_array, count = vtype == _ARRAY, 1
        if is_array:
            vtype, count = self.u32(), self.u64()
            if vtype == _STRING:
                self.skip_strings(count)
                return count
        if vtype not in _DTYPE:
            raise ValueError(f"GGUF value of unsupported type {vtype}")
        dt = np.dtype(_DTYPE[vtype])
        out: object = count  # a long array: its length only
        if count <= MAX_ARRAY:
            vals = np.frombuffer(self.buf, dt, count, self.pos).tolist()
            out = vals if is_array else vals[0]
        self.pos += dt.itemsize * count
        return out


def read_header(path: str | Path) -> Header:
    """Raises ValueError for a file that is not GGUF, OSError when it cannot be read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        c = _Cursor(buf)
        c.pos = 4
        version = c.u32()
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = c.u64(), c.u64()
        fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.u32())
        tensors = []
        for _ in range(n_tensors):
            name = c.string()
            shape = tuple(c.u64() for _ in range(c.u32()))
            ggml_type = c.u32()
            c.u64()  # data offset
            tensors.append(TensorEntry(name, ggml_type, shape))
        return Header(fields, tensors)
