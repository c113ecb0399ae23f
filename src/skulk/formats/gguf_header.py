"""A GGUF header walked with bounds before the gguf package or transformers read it.

Both of those trust the header: a count of 2^63 or a string length of 2^62 ends in an IndexError deep inside, and
a 50 MB metadata string becomes a Python list of 50 M numpy scalars in transformers (2 GB, minutes, the GIL held).
Here every count and length is checked against what is left of the file and against a cap before the next field
is read, from a read-only memory map (nothing is copied but keys and names), as llama.cpp's own reader does.

The caps are far above any real model (Gemma 3's 262,144-token vocabulary is ~0.8 M array elements and ~6 MB of
strings; the longest chat templates are tens of KB) and far below what would hurt a node:
- MAX_STRING: one metadata string, 1 MiB; MAX_STRING_TOTAL: every metadata string together, 32 MiB;
- MAX_ELEMENTS: array elements across the whole metadata, 2 Mi; MAX_DEPTH: arrays of arrays, two levels;
- MAX_KV: 4,096 metadata entries; MAX_TENSORS: 65,536 tensors of at most 4 dimensions; MAX_NAME: 1 KiB keys
  and tensor names.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from skulk.formats import InvalidModelFile

MAX_STRING = 1 << 20
MAX_STRING_TOTAL = 32 << 20
MAX_ELEMENTS = 1 << 21
MAX_DEPTH = 2
MAX_KV = 1 << 12
MAX_TENSORS = 1 << 16
MAX_NAME = 1 << 10
MAX_DIMS = 4
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF's scalar value types (uint8 .. float64, bool) and their sizes; 8 is a string, 9 an array."""
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
"""The fewest bytes a metadata entry (key length, type, a one-byte value) and a tensor description take."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the walk established: the counts, the alignment and where the tensor data starts."""

    version: int
    tensor_count: int
    kv_count: int
    alignment: int
    data_offset: int


def check_gguf(path: Path) -> GGUFHeader:
    """Walk the file's header; InvalidModelFile naming the first field that is out of bounds."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise InvalidModelFile(f"{path.name}: {size} bytes is too short for a GGUF header (24)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return _Walk(view, size, path.name).header()
    except OSError as exc:
        raise InvalidModelFile(f"{path.name}: cannot read the file: {exc.strerror or exc}") from exc


class _Walk:
    """A cursor over the mapped file that refuses to step past its end or past a cap."""

    def __init__(self, view: mmap.mmap, size: int, name: str) -> None:
        self.view, self.size, self.name, self.pos = view, size, name, 0
        self.strings = self.elements = 0

    def fail(self, what: str) -> InvalidModelFile:
        return InvalidModelFile(f"{self.name}: {what} (at byte {self.pos} of {self.size}); not a usable GGUF file")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} remain")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return int(struct.unpack_from("<I", self.view, self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack_from("<Q", self.view, self.take(8, what))[0])

    def text(self, what: str, cap: int) -> str:
        length = self.u64(f"the length of {what}")
        if length > cap:
            raise self.fail(f"{what} is {length} bytes long, more than the {cap} allowed")
        start = self.take(length, what)
        try:
            return self.view[start:start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 ({exc.reason})") from None

    def count(self, value: int, cap: int, min_each: int, what: str) -> int:
        """A stated count, refused above the cap or when the rest of the file could not hold that many."""
        if value > cap:
            raise self.fail(f"{what} is {value}, more than the {cap} allowed")
        if value * min_each > self.size - self.pos:
            raise self.fail(f"{what} is {value}, more than the {self.size - self.pos} bytes left could hold")
        return value

    def header(self) -> GGUFHeader:
        if self.view[0:4] != b"GGUF":
            raise self.fail(f"the magic is {bytes(self.view[0:4])!r}, not b'GGUF'")
        self.pos = 4
        version = self.u32("the version")
        if version not in VERSIONS:
            raise self.fail(f"GGUF version {version} is not one this node reads ({', '.join(map(str, VERSIONS))})")
        tensors = self.u64("the tensor count")
        kvs = self.count(self.u64("the metadata count"), MAX_KV, _MIN_KV, "the metadata count")
        self.count(tensors, MAX_TENSORS, _MIN_TENSOR, "the tensor count")
        alignment = self.metadata(kvs)
        seen: set[str] = set()
        ends = [self.tensor_info(alignment, seen) for _ in range(tensors)]
        data_offset = self.pos + (-self.pos % alignment)
        for name, offset, nbytes in ends:
            if data_offset + offset + nbytes > self.size:
                raise self.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}) ends past the file")
        return GGUFHeader(version, tensors, kvs, alignment, data_offset)

    def metadata(self, count: int) -> int:
        """Every key and value; the file's alignment (general.alignment, else 32)."""
        keys: set[str] = set()
        alignment = DEFAULT_ALIGNMENT
        for _ in range(count):
            key = self.text("a metadata key", MAX_NAME)
            if key in keys:
                raise self.fail(f"metadata key {key!r} appears twice")
            keys.add(key)
            kind = self.u32(f"the type of {key!r}")
            start = self.pos
            self.value(kind, key, 0)
            if key == "general.alignment":
                alignment = self.alignment(kind, start)
        return alignment

    def alignment(self, kind: int, start: int) -> int:
        value = int(struct.unpack_from("<I", self.view, start)[0]) if kind == 4 else 0
        if value <= 0 or value & (value - 1) or value > 1 << 20:
            raise self.fail("general.alignment must be a uint32 power of two up to 1 MiB")
        return value

    def value(self, kind: int, key: str, depth: int) -> None:
        if kind in SCALAR_SIZES:
            self.take(SCALAR_SIZES[kind], f"the value of {key!r}")
        elif kind == STRING:
            self.string_value(key)
        elif kind == ARRAY:
            self.array(key, depth)
        else:
            raise self.fail(f"{key!r} has value type {kind}, which GGUF does not define")

    def string_value(self, key: str) -> None:
        length = self.u64(f"the length of a string in {key!r}")
        if length > MAX_STRING:
            raise self.fail(f"a string in {key!r} is {length} bytes long, more than the {MAX_STRING} allowed")
        self.strings += length
        if self.strings > MAX_STRING_TOTAL:
            raise self.fail(f"the metadata strings pass {MAX_STRING_TOTAL} bytes in all (at {key!r})")
        start = self.take(length, f"a string in {key!r}")
        try:
            self.view[start:start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string in {key!r} is not UTF-8 ({exc.reason})") from None

    def array(self, key: str, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise self.fail(f"{key!r} nests arrays deeper than {MAX_DEPTH} levels")
        kind = self.u32(f"the element type of {key!r}")
        min_each = SCALAR_SIZES.get(kind, 8 if kind == STRING else 12)
        length = self.count(self.u64(f"the length of {key!r}"), MAX_ELEMENTS - self.elements, min_each,
                            f"the length of array {key!r}")
        self.elements += length
        if kind in SCALAR_SIZES:
            self.take(length * SCALAR_SIZES[kind], f"the elements of {key!r}")
            return
        for _ in range(length):
            self.value(kind, key, depth + 1)

    def tensor_info(self, alignment: int, seen: set[str]) -> tuple[str, int, int]:
        """One tensor's description: (name, offset in the data, bytes), checked but for the file's end."""
        name = self.text("a tensor name", MAX_NAME)
        if name in seen:
            raise self.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        dims = self.u32(f"the dimension count of {name!r}")
        if not 1 <= dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {dims} dimensions (1 to {MAX_DIMS})")
        shape = [self.u64(f"a dimension of {name!r}") for _ in range(dims)]
        kind = self.u32(f"the type of {name!r}")
        offset = self.u64(f"the offset of {name!r}")
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise self.fail(f"tensor {name!r} has type {kind}, which this node does not know") from None
        if min(shape) < 1 or shape[0] % block:
            raise self.fail(f"tensor {name!r} has shape {shape}, not whole blocks of {block}")
        if offset % alignment:
            raise self.fail(f"tensor {name!r} starts at {offset}, not a multiple of the alignment {alignment}")
        elements = 1
        for dim in shape:
            elements *= dim
            if elements > self.size * block:  # stop multiplying once no file could hold it
                raise self.fail(f"tensor {name!r} of shape {shape} is larger than the file")
        return name, offset, elements // block * block_bytes
