"""The torch engine's request bookkeeping, apart from its tensors: the queue, the running rows, both pools' block
tables, prefix sharing and preemption. Pure and in memory: it imports no torch (tests/unit/test_scheduler.py checks),
so every decision here is tested without a model.

Rank 0 calls `schedule`: it plans a step against the pools and returns the step header (wire.py sends it). Every
other rank applies the same header to its own copy with `update`, in the same order, so queues, rows and block
tables stay identical everywhere without further agreement. Both start from `apply`, which takes the header's
releases and adds. What the engine does with tensors stays with it: the KV copies an admission asks for come back
as `BlockCopy`s for it to perform before the step's forward pass (each only reads its source and writes its own
fresh block, and nothing writes KV between the admissions, so performing them after the last one, in order, is
the same as performing each at its admission).

A sequence is anything with a Request's bookkeeping fields (`Seq`): the engine's requests.Request (which carries
sampling tensors too), or a test's plain record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

from . import windows
from .blocks import NO_BLOCK, BlockAllocator, blocks_for, common_prefix, extend_keys
from .header import NO_COPY, Header, NewRequest, Preempt, Release, StepKind, WireError
from .schedule import admission_blocks, can_admit, growth_blocks, next_kind


class Seq(Protocol):
    """What the scheduler reads and changes of one request."""

    request_id: str
    prompt: list[int]
    length: int  # positions its KV holds
    table: list[int]  # the full group's block table
    local: list[int]  # a hybrid model's sliding group's (NO_BLOCK behind the window)
    emitted: list[int]  # tokens generated since admission
    keys: list[int]  # rank 0: chain keys of its full blocks known so far
    draft_len: int
    spans: tuple[tuple[int, int], ...]  # its images' placeholder runs: an image prompt shares no blocks

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]: ...


S = TypeVar("S", bound=Seq)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """KV the executor copies before the step's forward pass: block source into block dest of a layer group (0: the
    full group, 1: a hybrid model's sliding one)."""

    source: int
    dest: int
    group: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Rank 0's choices for a step that depend on more than the tables (measured timings, steps in flight):
    whether any row decodes, the prefill chunk's tokens, and the rows the header names (None: every row)."""

    decoding: bool
    chunk: int
    rows: tuple[int, int] | None = None


@dataclass
class Scheduled(Generic[S]):
    """A step as scheduled (rank 0) or applied (every other rank): its header, the requests it admitted in row
    order, and the KV copies the executor performs before computing it."""

    header: Header
    started: list[S] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Dropped(Generic[S]):
    """A release as applied: the request it found (None: already gone) and whether it was running."""

    release: Release
    seq: S | None
    running: bool


class Named(Protocol):
    request_id: str


N = TypeVar("N", bound=Named)


class Queue(Generic[N]):
    """The scheduler's queue half, apart from blocks: the requests waiting (FIFO) and those running (index == batch
    row), and a request taken from either by its id. The Scheduler keeps its requests in one; so does the MLX engine
    (engines/mlx/engine.py), whose KV lives in mlx-lm's caches rather than a block pool."""

    def __init__(self) -> None:
        self.pending: deque[N] = deque()
        self.running: list[N] = []

    def ids(self) -> set[str]:
        """The ids of every request queued or running."""
        return {r.request_id for r in (*self.pending, *self.running)}

    def take(self, request_id: str) -> tuple[N | None, int | None]:
        """Drop the request from the queue or the running rows: (it, its row; None while it was pending), or (None,
        None) where it is in neither."""
        found = next((r for r in self.pending if r.request_id == request_id), None)
        if found is not None:
            self.pending.remove(found)
            return found, None
        row = next((i for i, r in enumerate(self.running) if r.request_id == request_id), None)
        if row is None:
            return None, None
        return self.running.pop(row), row


def _settled() -> bool:
    return False


def _ignore(_: object) -> None:
    return None


class Scheduler(Generic[S]):
    """One rank's copy of the scheduling state; see the module docstring. leads: this is rank 0 (it alone keys
    blocks by their tokens: only it knows generated tokens). share_prefixes: later prompts may share cached
    blocks (off in a mixed instance, whose MLX rank keeps per-request caches)."""

    def __init__(self, blocks: BlockAllocator, local_blocks: BlockAllocator | None = None, *, max_batch: int,
                 prefill_chunk: int, window: int = 0, local_window: int = 0, leads: bool = True,
                 share_prefixes: bool = True, on_free: Callable[[int], None] | None = None) -> None:
        self.blocks, self.local_blocks = blocks, local_blocks
        self.block_size = blocks.block_size
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.window = window  # every layer slides: blocks wholly behind it go back
        self.local_window = local_window  # a hybrid model's sliding group's window
        self.leads, self.share_prefixes = leads, share_prefixes
        self.queue: Queue[S] = Queue()
        self.pending, self.running = self.queue.pending, self.queue.running  # running: identical on every rank
        self.on_free = on_free
        """Told a leaving (or preempted) request's first block as its table goes back: a stateful family's model
        drops the state it keeps for that stream (models/family.forget_stream)."""
        self.preemptions = 0

    # --- the header's changes, on every rank ------------------------------------------------------------------

    def apply(self, header: Header, make: Callable[[NewRequest], S],
              dropped: Callable[[Dropped[S]], None] = _ignore) -> list[S]:
        """The header's releases (each as applied passed to `dropped`, before any add is made), then its adds, each
        made a sequence by `make` and queued; the sequences queued, in order."""
        for release in header.releases:
            dropped(self.release(release))
        added: list[S] = []
        for add in header.adds:
            added.append(make(add))
            self.pending.append(added[-1])
        return added

    def add(self, seq: S) -> None:
        self.pending.append(seq)

    def release(self, release: Release) -> Dropped[S]:
        """Drop a pending request, or a running one and its blocks (its full blocks stay cached for reuse)."""
        found, row = self.queue.take(release.request_id)
        if found is None or row is None:
            return Dropped(release, found, False)
        self._free_table(found)
        return Dropped(release, found, True)

    # --- rank 0 ---------------------------------------------------------------------------------------------

    def schedule(self, changes: Header, plan: Callable[[], StepPlan],
                 drain: Callable[[], bool] = _settled) -> Scheduled[S]:
        """Rank 0, after `apply(changes)`: preempt until the running rows can grow, take the step's plan (it reads
        the rows left), admit what the chunk and the pools allow, grow every row, and name the step's kind.
        drain: take the tokens of steps still in flight (True if there were any): a preempted request carries
        its tokens in the header, so they must all be back, and finished rows may free blocks."""
        self.drop_local()
        preempts = self._plan_preemptions(drain)
        step = plan()
        done = self._admit_pending(step.chunk)
        self.grow(step.chunk)
        kind = next_kind(prefilling=bool(self.rests()), decoding=step.decoding)
        chunk = step.chunk if kind in (StepKind.PREFILL, StepKind.MIXED) else 0
        done.header = replace(done.header, kind=kind, adds=changes.adds, releases=changes.releases, chunk=chunk,
                              preempts=preempts, rows=step.rows)
        return done

    def short_of_blocks(self) -> bool:
        """Whether the running requests' next step needs more blocks than a pool has (a hybrid model's sliding pool
        counted for whole prefill chunks: the chunk is not chosen yet)."""
        if growth_blocks(self.running, self.block_size) > self.blocks.available:
            return True
        local = self.local_blocks
        return local is not None and windows.local_growth(self.running, self.prefill_chunk,
                                                          self.block_size) > local.available

    def rests(self) -> list[int]:
        """Prompt tokens still to prefill, per request being prefilled, in row order."""
        return [len(r.prompt) - r.length for r in self.running if r.length < len(r.prompt)]

    def _plan_preemptions(self, drain: Callable[[], bool]) -> tuple[Preempt, ...]:
        """While the running requests' next positions need more blocks than the pool has, preempt the most
        recently admitted (its blocks go back; it is recomputed later). The pool holds one whole-context request,
        so the first running request always fits."""
        preempts: list[Preempt] = []
        while len(self.running) > 1 and self.short_of_blocks():
            if drain():  # the victim's tokens must all be back (also: finished rows may free blocks)
                continue
            victim = self.running[-1]
            preempt = Preempt(victim.request_id, tuple(victim.emitted))
            self.preempt(preempt)
            preempts.append(preempt)
        return tuple(preempts)

    def _admit_pending(self, chunk: int) -> Scheduled[S]:
        """Admit pending requests in queue order while this step's chunk outlasts the prompts already being
        prefilled (schedule.can_admit) and the pool has blocks for the whole prompt beside the running requests'
        growth; each shares the cached blocks of its longest cached prefix and copies the block holding most of
        its next tokens (_tail_source). The header carries those blocks per admission and every other rank
        repeats the admissions in order, so block tables stay identical. The header returned carries only them."""
        admits: list[tuple[int, ...]] = []
        copies: list[tuple[int, int]] = []
        done: Scheduled[S] = Scheduled(Header(StepKind.HEARTBEAT))
        rests = self.rests()
        reserve = growth_blocks(self.running, self.block_size)
        local_reserve = windows.local_growth(self.running, chunk, self.block_size) if self.local_blocks else 0
        while self.pending and can_admit(rests=rests, chunk=chunk, free_slots=self.max_batch - len(self.running),
                                         admitted=len(admits)):
            fit = self._fit(self.pending[0], chunk, reserve, local_reserve)
            if fit is None:
                break  # the queue waits for blocks (FIFO: a short prompt behind never starves a long one ahead)
            flat, copy = fit
            req, moves = self.admit(flat, copy)
            done.started.append(req)
            done.copies.extend(moves)
            admits.append(flat)
            copies.append(copy)
            rests.append(len(req.prompt) - req.length)
            if self.local_blocks is not None:
                local_reserve += windows.local_growth([req], chunk, self.block_size)
        done.header = Header(StepKind.HEARTBEAT, admits=tuple(admits),
                             copies=tuple(copies) if any(c != NO_COPY for c in copies) else ())
        return done

    def _fit(self, head: S, chunk: int, reserve: int, local_reserve: int
             ) -> tuple[tuple[int, ...], tuple[int, int]] | None:
        """The queue head's admission as the header carries it (its shared blocks, both groups' packed for a hybrid
        model, and its copy), or None while the pools cannot take it beside `reserve` (and `local_reserve`)."""
        # the prompt's last token is always computed; an image prompt shares no blocks (vision.py)
        limit = 0 if head.spans else (len(head.prompt) - 1) // self.block_size
        extend_keys(head.keys, head.prompt, self.block_size, limit)
        shared = self.blocks.match(head.keys[:limit])
        local: list[int] = []
        if self.local_blocks is not None:  # the prefix both groups hold (windows.py)
            n, local = windows.window_hit(self.local_blocks.block_of, head.keys, len(shared), self.local_window,
                                          self.block_size)
            shared = shared[:n]
        copy, local_copy = self._tail_sources(head, shared)
        if admission_blocks(len(head.prompt), len(shared), self.block_size) + reserve \
                + _revived(self.blocks, [*shared, copy[0]] if copy != NO_COPY else shared) > self.blocks.available:
            return None
        if self.local_blocks is not None and local_reserve + self._local_need(
                head, len(shared), copy[1], local, local_copy, chunk) > self.local_blocks.available:
            return None
        return (tuple(shared) if self.local_blocks is None else windows.pack(shared, local, local_copy)), copy

    def _tail_sources(self, head: S, shared: list[int]) -> tuple[tuple[int, int], int | None]:
        """The partial block the prompt copies after its shared whole blocks (_tail_source), and for a hybrid
        model the sliding group's block holding the same tokens (None: no copy). The copy takes the tokens both
        groups hold; NO_COPY if that is fewer than min_copy."""
        copy = self._tail_source(head, shared, self.blocks, lambda r: r.table)
        if self.local_blocks is None or copy == NO_COPY:
            return copy, None
        local = self._tail_source(head, shared, self.local_blocks, lambda r: r.local)
        took = min(copy[1], local[1])
        return ((copy[0], took), local[0]) if took >= self.blocks.min_copy else (NO_COPY, None)

    def _tail_source(self, head: S, shared: list[int], blocks: BlockAllocator,
                     table: Callable[[S], list[int]]) -> tuple[int, int]:
        """The block of a group (its allocator, a request's table of it) holding the most of the prompt's tokens
        after its shared whole blocks, and how many of them it takes: among cached blocks (blocks.match_tail) and
        the blocks running requests hold after the same shared ones (written up to their length, never again).
        NO_COPY: none. The prompt's last token is always computed, so it gets logits to sample from."""
        n, size = len(shared), self.block_size
        start = n * size
        want = head.prompt[start : min(start + size, len(head.prompt) - 1)]
        if not (want and self.share_prefixes) or head.spans:
            return NO_COPY
        best = blocks.match_tail(head.keys[n - 1] if n else 0, want) or NO_COPY
        for r in self.running:
            held = table(r)
            if not r.spans and r.length > start and len(held) > n and held[n] != NO_BLOCK and r.table[:n] == shared:
                took = common_prefix(r.tokens(start, min(r.length, start + size)), want)
                if took >= blocks.min_copy and took > best[1]:
                    best = (held[n], took)
        return best

    def _local_need(self, head: S, n: int, copied: int, local: list[int], local_copy: int | None,
                    chunk: int) -> int:
        """Sliding-pool blocks admitting head takes before its first step: its first chunk's past the n shared
        ones, and the cached ones it (and its copy's source) takes out of the LRU."""
        assert self.local_blocks is not None
        length = n * self.block_size + copied
        ahead = max(1, min(len(head.prompt) - length, chunk))
        pinned = [b for b in local if b != NO_BLOCK] + ([] if local_copy is None else [local_copy])
        return max(0, blocks_for(length + ahead, self.block_size) - n) + _revived(self.local_blocks, pinned)

    # --- every other rank -----------------------------------------------------------------------------------

    def update(self, header: Header) -> Scheduled[S]:
        """Every other rank, after `apply(header)`: the same preemptions, admissions (WireError for one no rank 0
        could have sent) and growth rank 0 made, in the same order."""
        self.drop_local()
        for preempt in header.preempts:
            self.preempt(preempt)
        copies = header.copies or (NO_COPY,) * len(header.admits)
        if len(copies) != len(header.admits):
            raise WireError(f"header copies blocks for {len(copies)} of {len(header.admits)} admissions")
        done: Scheduled[S] = Scheduled(header)
        for shared, copy in zip(header.admits, copies, strict=True):
            req, moves = self.admit(shared, copy)
            done.started.append(req)
            done.copies.extend(moves)
        self.grow(header.chunk)
        if header.rows is not None and header.rows[1] > len(self.running):
            raise WireError(f"header decodes rows {header.rows} of {len(self.running)} running")
        return done

    # --- the decisions both apply ---------------------------------------------------------------------------

    def preempt(self, preempt: Preempt) -> None:
        """Take a running request out and put it back at the head of the queue, its generated tokens (the header's,
        so every rank agrees) appended to its prompt: recomputed when it is admitted again."""
        req = next((r for r in self.running if r.request_id == preempt.request_id), None)
        if req is None:
            raise WireError(f"header preempts {preempt.request_id!r}, which is not running")
        self.running.remove(req)
        self._free_table(req)
        req.prompt = [*req.prompt, *preempt.tokens]
        req.emitted, req.length, req.draft_len = [], 0, 0
        self.pending.appendleft(req)
        self.preemptions += 1

    def admit(self, shared: tuple[int, ...], copy: tuple[int, int] = NO_COPY) -> tuple[S, list[BlockCopy]]:
        """Move the first pending request into the next row, sharing the cached blocks `shared` for its first
        positions, taking fresh blocks for the rest of its prompt, and copying the first `copy[1]` positions of
        block `copy[0]` into the first fresh one (copy-on-write of a partial match: it writes past them). A hybrid
        model's `shared` packs both groups' (windows.pack); its sliding table takes no block past them here.
        Returns the request and the copies for the executor."""
        if not self.pending or len(self.running) >= self.max_batch:
            raise WireError(f"header admits a request with {len(self.pending)} pending, {len(self.running)} running")
        local: list[int] = []
        local_copy: int | None = None
        if self.local_blocks is not None:
            shared, local, local_copy = self._unpack(shared, copy[1] > 0)
        req = self.pending[0]
        source, copied = copy
        length = len(shared) * self.block_size + copied
        if not 0 <= copied <= self.block_size or not 0 <= source < self.blocks.num_blocks \
                or (length >= len(req.prompt) and length):
            raise WireError(f"header reuses {length} positions ({len(shared)} blocks, then {copied} copied from "
                            f"block {source}) of a {len(req.prompt)}-token prompt")
        need = blocks_for(len(req.prompt), self.block_size) - len(shared)  # its first decode's: grow
        for block in shared:
            self.blocks.share(block)
        if copied:
            self.blocks.share(source)  # held while the fresh blocks are taken, so none of them is the source
        req.table = [*shared, *(self.blocks.allocate() for _ in range(need))]
        moves: list[BlockCopy] = []
        if copied:
            moves.append(BlockCopy(source, req.table[len(shared)]))
            self.blocks.free(source, keep=True)
        if self.local_blocks is not None:
            req.local = self._admit_local(local, local_copy, moves)
        self.pending.popleft()
        req.length = length
        self.running.append(req)
        return req, moves

    def _unpack(self, flat: tuple[int, ...], copied: bool) -> tuple[tuple[int, ...], list[int], int | None]:
        """A hybrid model's admission as the header packs it (windows.pack), checked against the sliding pool."""
        assert self.local_blocks is not None
        try:
            full, local, local_copy = windows.unpack(flat, copied)
        except ValueError as exc:
            raise WireError(f"header admits with {exc}") from None
        if any(not NO_BLOCK <= b < self.local_blocks.num_blocks for b in [*local, local_copy or 0]):
            raise WireError(f"header shares sliding blocks {local} (copy {local_copy}) out of the pool")
        return tuple(full), local, local_copy

    def _admit_local(self, local: list[int], source: int | None, moves: list[BlockCopy]) -> list[int]:
        """An admitted request's sliding table: the shared blocks of its window, and a fresh block holding a copy of
        block `source` (the partial block the full group copies too), appended to moves."""
        blocks = self.local_blocks
        assert blocks is not None
        for block in local:
            if block != NO_BLOCK:
                blocks.share(block)
        if source is None:
            return list(local)
        blocks.share(source)  # held while the fresh block is taken, so it is not the source
        fresh = blocks.allocate()
        moves.append(BlockCopy(source, fresh, group=1))
        blocks.free(source, keep=True)
        return [*local, fresh]

    def drop_local(self) -> None:
        """A hybrid model's sliding tables give back the blocks behind their windows (windows.drop_behind), before
        anything is planned: what the step needs is then counted against what the pool really has."""
        if self.local_blocks is not None:
            for req in self.running:
                windows.drop_behind(req.local, self.local_blocks, req.length, self.local_window, self.block_size)

    def grow(self, chunk: int) -> None:
        """Every running request gets the block its next position falls in, in row order (so every rank takes
        the same blocks): rank 0 preempted enough that they exist. Where every layer slides, blocks wholly
        before the window go back first. A hybrid model's sliding tables take the blocks of every position the
        step writes (a chunk's share: windows.step_ahead)."""
        for req in self.running:
            if self.window:
                self._drop_behind_window(req)
            while len(req.table) < blocks_for(req.length + 1, self.block_size):
                req.table.append(self.blocks.allocate())
        if self.local_blocks is not None:
            for req, ahead in zip(self.running, windows.step_ahead(self.running, chunk), strict=True):
                while len(req.local) < blocks_for(req.length + ahead, self.block_size):
                    req.local.append(self.local_blocks.allocate())

    def reserve(self, req: S, positions: int) -> tuple[int, int]:
        """A single rank's speculative step: the request's tables (and a hybrid model's sliding one) take the
        blocks of its first `positions` positions, since the draft writes past its next position before the
        target confirms it (the draft's limit kept it within the free blocks). Blocks taken from each pool."""
        took = local_took = 0
        while len(req.table) < blocks_for(positions, self.block_size):
            req.table.append(self.blocks.allocate())
            took += 1
        if self.local_blocks is not None:
            while len(req.local) < blocks_for(positions, self.block_size):
                req.local.append(self.local_blocks.allocate())
                local_took += 1
        return took, local_took

    def _drop_behind_window(self, req: S) -> None:
        """Free the blocks no query of the request can see again: every position in them is at least `window`
        behind its next one (its next chunk starts there too). Their table entries become NO_BLOCK: the kernels
        start at the window and the torch path's gather reads them masked."""
        behind = (req.length + 1 - self.window) // self.block_size
        for i in range(min(behind, len(req.table))):
            if req.table[i] != NO_BLOCK:
                self.blocks.free(req.table[i], keep=False)
                req.table[i] = NO_BLOCK

    # --- the prefix cache -----------------------------------------------------------------------------------

    def publish(self, req: S) -> None:
        """Rank 0: key the request's full blocks by their tokens, so another prompt starting with them shares them
        (while this one still runs, too: ten chats with one system prompt hold it once)."""
        if not (self.leads and self.share_prefixes) or req.spans:
            return
        full = req.length // self.block_size
        extend_keys(req.keys, req.tokens(0, full * self.block_size), self.block_size, full)
        for block, key in zip(req.table[:full], req.keys[:full], strict=True):
            if block != NO_BLOCK:
                self.blocks.cache_full(block, key)
        i = min(full, len(req.local)) - 1  # -1 for a model of one group
        while i >= 0 and req.local[i] != NO_BLOCK:  # a hybrid model's sliding blocks (held ones: the table's tail)
            self.local_blocks.cache_full(req.local[i], req.keys[i])  # type: ignore[union-attr]
            i -= 1

    def _free_table(self, req: S) -> None:
        """Give a leaving (or preempted) request's blocks back, those holding any of its tokens kept cached; on
        rank 0 its full blocks are keyed by their tokens first, and every kept block's tokens remembered, so a later
        prompt starting with them finds them (whole blocks shared, a last partial one copied)."""
        kept = blocks_for(req.length, self.block_size)
        self.publish(req)
        if self.on_free is not None and req.table:
            self.on_free(req.table[0])
        self._let_go(req, req.table, self.blocks, kept)
        req.table = []
        if self.local_blocks is not None:
            self._let_go(req, req.local, self.local_blocks, kept)
            req.local = []

    def _let_go(self, req: S, table: list[int], blocks: BlockAllocator, kept: int) -> None:
        """_free_table for one group's table: rank 0 remembers the tokens of its first `kept` blocks (those holding
        some), which stay cached; entries behind a window (NO_BLOCK) lead the table and hold nothing."""
        if self.leads and self.share_prefixes and not req.spans:
            for i, block in enumerate(table[:kept]):
                if block != NO_BLOCK:
                    tokens = req.tokens(i * self.block_size, min(req.length, (i + 1) * self.block_size))
                    blocks.remember(block, req.keys[i - 1] if i else 0, tokens)
        held = [b for b in table if b != NO_BLOCK]
        blocks.free_table(held, kept - (len(table) - len(held)))


def _revived(blocks: BlockAllocator, pinned: list[int]) -> int:
    """Cached blocks an admission takes out of the LRU (they stop counting as available)."""
    return sum(1 for b in pinned if blocks.refcount(b) == 0)
