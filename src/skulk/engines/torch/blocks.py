"""The paged KV cache's block allocator: which fixed-size blocks of the pool each request holds (vLLM's
PagedAttention bookkeeping, with its prefix cache).

A pure object: no tensors, no I/O. Every rank of an instance holds one and applies the same calls in the same
order (the step header names every decision that needs knowledge only rank 0 has: which cached blocks a new
request shares, which request is preempted), so block tables are identical on every rank without sending them.

A block is in exactly one of three states:
- free: holds nothing anyone may want (`_empty`, taken first, lowest id first);
- held: refcount > 0, in one or more requests' block tables (a shared prefix is held by several);
- cached: refcount 0 but still holding a full block of some prefix, kept in LRU order (`_cached`) so a later
  request starting with the same tokens shares it instead of recomputing it; taken for new content only when no
  free block is left, least recently used first.

Only full blocks are ever shared, and a request only writes at positions at or past its length, which lie in
its own last (unshared) block; `writable` still copies a shared block on write (returning the copy to make), so
no caller can write into another request's KV whatever it asks.

Reuse is token-granular, as SGLang's radix cache is: past its last whole shared block, a prompt may start with
only some of a cached block's tokens (the same prompt again, whose last block is partial; a block a reply went on
to fill). Rank 0 remembers each cached block's tokens under its parent's key (`remember`), and `match_tail` finds
the one sharing the most tokens with the rest of a prompt; the new request copies that block into a fresh one of
its own (copy-on-write: it writes past the copied tokens) instead of recomputing them.

Prefix identity is a chain hash per full block: hash((parent block's key, the block's token ids)), so a block
matches only when every token before it matches too. Only rank 0 knows generated tokens, so only its allocator
registers keys (`cache_full`); other ranks pass none and follow the header.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_COPY = 8
"""The fewest tokens a partial match copies (match_tail; half a block in pools of small blocks); fewer are recomputed
in the prompt's chunk, which computes its last token anyway. Every prompt starts with BOS: a one-token match would
copy a block for nearly nothing."""


NO_BLOCK = -1
"""A table entry whose block went back (behind a sliding window): never read unmasked."""


class OutOfBlocks(RuntimeError):
    """The pool has no free or cached block left: the scheduler should have queued or preempted first."""


def block_keys(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The chain key of each full block of tokens (at most `limit` blocks)."""
    keys: list[int] = []
    extend_keys(keys, tokens, block_size, limit)
    return keys


def extend_keys(keys: list[int], tokens: Sequence[int], block_size: int, limit: int | None = None) -> None:
    """Append the chain keys of tokens' full blocks past those already in keys (up to `limit` blocks in all):
    a request's keys grow with it without rehashing what it already has."""
    full = len(tokens) // block_size
    parent = keys[-1] if keys else 0
    for b in range(len(keys), full if limit is None else min(full, limit)):
        parent = hash((parent, tuple(tokens[b * block_size : (b + 1) * block_size])))
        keys.append(parent)


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks a request needs to hold `positions` positions."""
    return -(-positions // block_size)


@dataclass
class BlockAllocator:
    """num_blocks blocks of block_size positions; see the module docstring for the states."""

    num_blocks: int
    block_size: int
    _refs: list[int] = field(init=False)
    _empty: list[int] = field(init=False)  # kept sorted descending: pop() gives the lowest id
    _cached: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)  # LRU first
    _key_of: dict[int, int] = field(init=False, default_factory=dict)  # block -> chain key (rank 0)
    _block_of: dict[int, int] = field(init=False, default_factory=dict)  # chain key -> block (rank 0)
    _tails: dict[int, dict[int, tuple[int, ...]]] = field(init=False, default_factory=dict)  # parent key -> tokens
    _parent_of: dict[int, int] = field(init=False, default_factory=dict)  # remembered block -> parent key (rank 0)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one position")
        self._refs = [0] * self.num_blocks
        self._empty = list(range(self.num_blocks - 1, -1, -1))

    # --- counts ---------------------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones (evicted to make room)."""
        return len(self._empty) + len(self._cached)

    @property
    def held(self) -> int:
        """Blocks in at least one request's table."""
        return self.num_blocks - self.available

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def min_copy(self) -> int:
        """The fewest tokens of a block worth copying (MIN_COPY)."""
        return max(1, min(MIN_COPY, self.block_size // 2))

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # --- allocation -----------------------------------------------------------------------------------------

    def allocate(self) -> int:
        """A block for new content: a free one, else the least recently used cached one (its prefix forgotten)."""
        if self._empty:
            block = self._empty.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more table holds block (a cached block comes back into use: it leaves the LRU)."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in the pool")
        if self._refs[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} holds nothing to share")
            del self._cached[block]
        self._refs[block] += 1

    def free(self, block: int, *, keep: bool) -> None:
        """One table lets go of block; at refcount 0 it becomes cached (keep: it is a full block of a prefix,
        most recently used now) or free."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held")
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if keep:
            self._cached[block] = None
        else:
            self._forget(block)
            self._empty.append(block)
            self._empty.sort(reverse=True)

    def free_table(self, table: Sequence[int], kept: int) -> None:
        """Release a request's table: its first `kept` blocks hold content and are kept as cached prefix blocks
        (freed last to first, so a prefix's tail is evicted before its head, which more requests share)."""
        for i in range(len(table) - 1, -1, -1):
            self.free(table[i], keep=i < kept)

    def writable(self, block: int) -> tuple[int, int | None]:
        """Copy-on-write: the block a table may write into in place of `block`, and the block to copy its
        content from (None when block is held by this table alone and is written in place)."""
        if self._refs[block] == 1:
            self._forget(block)  # its content changes: it no longer matches its key
            return block, None
        copy = self.allocate()
        self._refs[block] -= 1
        return copy, block

    # --- the prefix cache (keys known on rank 0 only) -------------------------------------------------------

    def cache_full(self, block: int, key: int) -> None:
        """Record that block holds the full block with chain key `key` (the first holder of a key keeps it)."""
        if key in self._block_of or block in self._key_of:
            return
        self._block_of[key], self._key_of[block] = block, key

    def match(self, keys: Sequence[int]) -> list[int]:
        """The blocks holding the longest run of keys from the first (a prefix's cached blocks), unshared yet."""
        found: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def block_of(self, key: int) -> int | None:
        """The block holding the full block of chain key `key`, if any (held or cached)."""
        return self._block_of.get(key)

    def remember(self, block: int, parent: int, tokens: Sequence[int]) -> None:
        """Record the tokens block holds (full or not) after the prefix with chain key `parent` (0: none), so a
        prompt that starts with some of them can copy it (match_tail)."""
        if not tokens or block in self._parent_of:
            return
        self._parent_of[block] = parent
        self._tails.setdefault(parent, {})[block] = tuple(tokens)

    def match_tail(self, parent: int, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The remembered block after prefix `parent` whose tokens start with the most of `tokens`, and how many:
        (block, n), or None when none starts with min_copy of them."""
        best: tuple[int, int] | None = None
        for block, held in self._tails.get(parent, {}).items():
            n = common_prefix(held, tokens)
            if n >= self.min_copy and (best is None or n > best[1]):
                best = (block, n)
        return best

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
        parent = self._parent_of.pop(block, None)
        if parent is not None:
            tails = self._tails[parent]
            del tails[block]
            if not tails:
                del self._tails[parent]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
