"""Read a safetensors file's tensors into memory the model owns, with plain reads, never through a mapping.

safetensors' own reader (safe_open) maps the whole file and hands out views of that mapping. Kept as weights,
those views hold every page the load touched resident as the file's pages: stacking q/k/v reads them and then
copies them, so a runner held the stacked copy and the mapped originals both (4.16 GB resident for 2.47 GB of
bf16 weights, issue 41); and mapped weights are page cache the kernel may evict under a memory limit, then read
back every step. Here each tensor is read with pread straight into its final buffer (a stacked projection's rows
of one shared buffer: loader.py), so what a runner holds after loading is its shard once, in memory it owns; a
tensor read in another dtype, or a block of columns, passes through one temporary of that tensor's size.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import safetensors_header

Index = tuple[int | slice, ...]

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class TensorFile:
    """One safetensors file, its header checked against its size (formats/checkpoint.py) and kept open for
    reads; get_slice gives what safe_open's does (a shape, indexing that reads), plus read(index, out)."""

    def __init__(self, path: Path) -> None:
        header = safetensors_header(path)
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {k: v for k, v in header.items() if k != "__metadata__"}
        self._fd = os.open(path, os.O_RDONLY)
        self.data_start = 8 + int.from_bytes(os.pread(self._fd, 8, 0), "little")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, name: str) -> TensorSlice:
        if name not in self.entries:
            raise InvalidModelFile(f"{self.path.name}: no tensor {name}")
        entry = self.entries[name]
        if entry["dtype"] not in _DTYPES:
            raise InvalidModelFile(f"{self.path.name}: tensor {name} is {entry['dtype']}, which torch cannot hold")
        start = self.data_start + int(entry["data_offsets"][0])
        return TensorSlice(self, start, _DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"]))

    def read_bytes(self, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor out with the file's bytes from offset."""
        view = out.view(-1).view(torch.uint8).numpy().data
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise InvalidModelFile(f"{self.path.name}: the file ended {len(view) - done} bytes short")
            done += got


class TensorSlice:
    """A tensor of the file, read only when indexed: whole, one leading index (an expert of a stacked tensor),
    and a block of rows or columns, as loader._shard asks."""

    def __init__(self, file: TensorFile, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.file, self.offset, self.dtype, self.shape = file, offset, dtype, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.read(index)

    def read(self, index: Index, out: torch.Tensor | None = None) -> torch.Tensor:
        """The indexed block, into out when given (converted to its dtype and device), else into a new tensor.

        A block that is one run of the file's bytes (leading indices, then a range of the next dimension, then
        whole dimensions) is read straight into its destination; any other passes through one temporary."""
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        offset, shape, rest = self._run(index)
        direct = out is None or (out.dtype == self.dtype and out.device.type == "cpu" and out.is_contiguous())
        if direct and _all_whole(rest, shape):
            target = torch.empty(shape, dtype=self.dtype) if out is None else _checked(out, shape)
            self.file.read_bytes(offset, target)
            return target
        whole = torch.empty(shape, dtype=self.dtype)
        self.file.read_bytes(offset, whole)
        block = whole[rest]
        if out is None:
            return whole if block.numel() == whole.numel() else block.clone()  # not a view pinning all of whole
        return _checked(out, tuple(block.shape)).copy_(block)

    def _run(self, index: Index) -> tuple[int, tuple[int, ...], Index]:
        """(byte offset, shape, what is left to index of that shape) of the smallest run of bytes holding the
        block: leading integer indices and a first range narrow the run; the rest is indexed afterwards."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        offset, dims = self.offset, list(self.shape)
        position = 0
        while position < len(index) and isinstance(index[position], int):
            at = _position(index[position], dims[0])  # type: ignore[arg-type]
            offset += at * math.prod(dims[1:]) * itemsize
            dims.pop(0)
            position += 1
        rest = index[position:]
        if rest and isinstance(rest[0], slice):
            start, stop, step = rest[0].indices(dims[0])
            if step == 1:
                offset += start * math.prod(dims[1:]) * itemsize
                dims[0] = max(0, stop - start)
                rest = (slice(None), *rest[1:])
        return offset, tuple(dims), rest



def _checked(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"shape {tuple(shape)}, expected {tuple(out.shape)}")
    return out


def _position(at: int, size: int) -> int:
    if not -size <= at < size:
        raise IndexError(f"index {at} is out of range for a dimension of {size}")
    return at % size


def _all_whole(rest: Index, shape: tuple[int, ...]) -> bool:
    """Whether indexing with rest leaves the block whole (every remaining index a full range)."""
    for item, size in zip(rest, shape, strict=False):
        if not isinstance(item, slice) or item.indices(size) != (0, size, 1):
            return False
    return True
