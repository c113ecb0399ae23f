"""Each decoder layer's weights moved, once after loading, into one buffer of their own whose memory Linux backs
with 2 MiB pages (transparent huge pages, asked for with madvise).

A decode step streams every weight it uses from DRAM once: on 4 KiB pages that is a page walk every 4 KiB, which
the hardware prefetcher does not cross, and one core then streams about a fifth slower than it can. A MoE's
experts are the worst case: a picked expert's matrices are a few hundred KiB each, separate allocations scattered
over the heap, read once per step for one or two rows. Measured on the 2-core EPYC (one thread, int4 g64 experts
of bench/moe.py's shape, 26 of 64 per layer, 4 layers: about 69 MB a step): 8.1-9.0 GB/s on 4 KiB pages, 10.8-11.1
GB/s on 2 MiB ones; a plain AVX2 read of 160 MB 8.4-8.8 against 10.4-10.7. Weights that stay in the cache (a small
dense model's at 8 rows) run as fast either way.

A layer's tensors keep their shapes, dtypes and views of one another (fused projections' parts view the fused
weight): each storage is copied to its place in the buffer and every tensor viewing it is pointed there (set_),
the matrices in the modules' order (an expert's gate/up then its down, next to each other). Only the whole 2 MiB pages
inside the buffer are advised, so a layer wastes nothing past its bytes. Storages a layer shares with anything
outside it (a tied weight) stay where they are. Where madvise or transparent huge pages are missing (not Linux,
THP off) nothing is moved.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64
"""Storages whose size is a multiple of a cache line (the matrices) come first, in the modules' order, each on a
line; the rest (norms, biases) after them, largest elements first, so nothing is padded: a layer holds the bytes
it held before (placement and pace count them: pace.module_bytes)."""
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """True where madvise can ask for transparent huge pages: Linux with THP set to "always" or "madvise"."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text(encoding="utf-8")
    except OSError:
        return False
    return "[never]" not in setting


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes, untouched, whose whole 2 MiB pages are advised as huge (its own anonymous mapping,
    so the pages are fresh: advice on memory already faulted in would wait for khugepaged). The mapping lives as
    long as the tensor's storage does."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # shared anonymous memory is shmem: no THP
    start = -_address(region) % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole:
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start)


def _address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers in host memory."""
    return [t for t in (*module.parameters(), *module.buffers()) if t.device.type == "cpu"]


def pack_layers(units: Sequence[nn.Module], model: nn.Module) -> int:
    """Move each unit's (a decoder layer's, the head's) CPU weights into a huge-page buffer of its own (see the
    module docstring); returns the bytes moved (0 where huge pages are not available). Call once after loading,
    before anything has taken the weights' addresses (the C kernels' descriptions are built on first use)."""
    if not huge_pages_available():
        return 0
    owners: dict[int, set[int]] = {}
    for index, unit in enumerate(units):
        for tensor in _tensors(unit):
            owners.setdefault(tensor.untyped_storage().data_ptr(), set()).add(index)
    seen = {id(t) for unit in units for t in _tensors(unit)}
    for tensor in _tensors(model):
        if id(tensor) not in seen:
            owners.setdefault(tensor.untyped_storage().data_ptr(), set()).add(-1)
    shared = {ptr for ptr, holders in owners.items() if len(holders) > 1}
    return sum(_pack(unit, shared) for unit in units)


def _pack(layer: nn.Module, shared: set[int]) -> int:
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in _tensors(layer):
        if (ptr := tensor.untyped_storage().data_ptr()) not in shared:
            groups.setdefault(ptr, []).append(tensor)
    whole = [tensors for tensors in groups.values() if tensors[0].untyped_storage().nbytes() % ALIGN == 0]
    rest = [tensors for tensors in groups.values() if tensors[0].untyped_storage().nbytes() % ALIGN]
    rest.sort(key=lambda tensors: -max(t.element_size() for t in tensors))
    places: list[tuple[int, list[torch.Tensor]]] = []
    total = 0
    for tensors in whole + rest:  # no padding: each storage starts at a multiple of its elements' size
        places.append((total, tensors))
        total += tensors[0].untyped_storage().nbytes()
    if not total:
        return 0
    buffer = huge_buffer(total)
    storage = buffer.untyped_storage()
    with torch.no_grad():
        for at, tensors in places:
            old = tensors[0].untyped_storage()
            buffer[at : at + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for tensor in tensors:
                size = tensor.element_size()
                tensor.set_(storage, at // size + tensor.storage_offset(), tensor.shape, tensor.stride())
    return total
