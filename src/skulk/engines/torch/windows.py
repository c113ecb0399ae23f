"""The block tables of sliding-window layers: which blocks a request's window still needs, and a hybrid model's second
layer group (Gemma 3's sliding layers beside its global ones, engines/kv_pools.py). Pure functions over tables and
allocators; scheduler.py calls them on every rank in the same order.

The sliding group's table is indexed like the full group's (position p in entry p // block_size), its entries behind
the window NO_BLOCK: a request holds at most window_blocks of them at a decode step, however long it runs. Its blocks
are taken lazily, a step's worth at a time (a prefill chunk's positions, a decode's one), never the whole prompt at
admission as the full group does; blocks that fall behind the window go back at the start of the next step, kept as
cached prefix blocks (their keys are the full group's chain keys).

The prefix rule (rank 0): a prompt may reuse a cached prefix of L positions only if every group can serve it: the full
group holds its blocks from the first (blocks.match), and the sliding group holds the blocks of the window the next
token sees, [L + 1 - window, L) (window_hit). The reused prefix is the longest whole-block prefix both hold; a partial
tail block is copied only if both groups have a block holding those tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from .blocks import NO_BLOCK, BlockAllocator, blocks_for
from .schedule import share_chunk


class _Holder(Protocol):
    prompt: list[int]
    length: int
    local: list[int]


def window_start(length: int, window: int, block_size: int) -> int:
    """The first block a query at position `length` sees through `window` (every block before it lies wholly
    behind: its positions are all < length + 1 - window)."""
    return max(0, (length + 1 - window) // block_size)


def drop_behind(table: list[int], blocks: BlockAllocator, length: int, window: int, block_size: int) -> None:
    """Give back the table's blocks no query of its request sees again (its next position is `length`), kept as
    cached prefix blocks; their entries become NO_BLOCK. Entries before the first held one are NO_BLOCK already, so
    this walks back from the window's start only over blocks it drops."""
    i = min(window_start(length, window, block_size), len(table)) - 1
    while i >= 0 and table[i] != NO_BLOCK:
        blocks.free(table[i], keep=True)
        table[i] = NO_BLOCK
        i -= 1


def window_hit(lookup: Callable[[int], int | None], keys: Sequence[int], n: int, window: int,
               block_size: int) -> tuple[int, list[int]]:
    """Rank 0: the longest m <= n whole blocks of prefix whose window the sliding pool holds (lookup: a chain key's
    cached block there, or None), and the sliding table of those m blocks (NO_BLOCK before the window)."""
    found = [lookup(keys[i]) for i in range(n)]
    run = 0
    runs: list[int] = []  # runs[i]: how many blocks up to i are all held
    for block in found:
        run = run + 1 if block is not None else 0
        runs.append(run)
    for m in range(n, 0, -1):
        start = window_start(m * block_size, window, block_size)
        if runs[m - 1] >= m - start:
            return m, [NO_BLOCK] * start + [b if b is not None else NO_BLOCK for b in found[start:m]]
    return 0, []


def step_ahead(running: Sequence[_Holder], chunk: int) -> list[int]:
    """Positions each running request writes in the next step, in row order: its share of the prefill chunk
    (schedule.share_chunk, as the step computes it) or one (a decode; a row still prefilling decodes too in a MIXED
    step, at its length)."""
    rests = [len(r.prompt) - r.length for r in running if r.length < len(r.prompt)]
    shares = iter(share_chunk(rests, chunk) if rests else [])
    return [max(1, next(shares)) if r.length < len(r.prompt) else 1 for r in running]


def local_growth(running: Iterable[_Holder], chunk: int, block_size: int) -> int:
    """Blocks the running requests' sliding tables take before the next step at most (a request being prefilled:
    a whole chunk's positions; behind-window blocks are already back, drop_behind)."""
    total = 0
    for r in running:
        ahead = min(len(r.prompt) - r.length, chunk) if r.length < len(r.prompt) else 1
        total += max(0, blocks_for(r.length + max(1, ahead), block_size) - len(r.local))
    return total


def pack(shared: Sequence[int], local: Sequence[int], local_copy: int | None) -> tuple[int, ...]:
    """One admission's shared blocks as a step header carries them for a hybrid model: the full group's, then the
    sliding group's (as many entries, NO_BLOCK behind the window), then the sliding copy's source block if any."""
    return (*shared, *local, *(() if local_copy is None else (local_copy,)))


def unpack(flat: Sequence[int], copied: bool) -> tuple[list[int], list[int], int | None]:
    """pack's inverse; ValueError for a length no rank 0 could have sent."""
    body = len(flat) - int(copied)
    if body < 0 or body % 2:
        raise ValueError(f"{len(flat)} shared blocks are not two groups' tables{' and a copy' if copied else ''}")
    n = body // 2
    return list(flat[:n]), list(flat[n:body]), flat[body] if copied else None
