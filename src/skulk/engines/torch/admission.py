"""Rank 0's scheduling and every rank's copy of its state: headers, admission, preemption, release, and the
block tables.

Rank 0 (_lead) turns queued adds and releases into a header, plans preemptions and admissions against the pool
and sends it; every other rank (_follow) applies the same header to the same state, in the same order, so queues,
rows and block tables stay identical without further agreement.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from skulk.engines.constrained import Grammars, tool_call_style

from . import windows
from .blocks import NO_BLOCK, BlockAllocator, blocks_for, common_prefix, extend_keys
from .core import WARMUP_ID
from .flight import Flight
from .requests import Request, held_for_reasoning, reasoning_budget, row_sampling
from .schedule import admission_blocks, can_admit, chunk_tokens, growth_blocks, next_kind
from .tokenizer import IncrementalDecoder, StopMatcher
from .vision import image_chunk, image_spans
from .wire import NO_COPY, Admitted, Header, NewRequest, Preempt, Release, Released, Started, StepKind, WireError

log = logging.getLogger(__name__)


class Admission(Flight):
    def _lead(self) -> Header:
        self._take_due(startable=bool(self._adds or self._releases or self._rests()))
        if self._in_flight and self._short_of_blocks():
            self._drain()  # a preemption may follow: it carries its victim's tokens, so all must be back
        changes = Header(StepKind.HEARTBEAT, tuple(self._adds), tuple(self._releases))
        self._adds, self._releases = [], []
        self._apply(changes)
        self._drop_local()
        preempts = self._plan_preemptions()
        rows = self._decode_range()
        decoding = rows is not None
        chunk = chunk_tokens(self.prefill_chunk, decoding=decoding, decode_s=self._decode_s,
                             last_chunk=self._last_chunk)
        head = next((r for r in self._running if r.length < len(r.prompt)), None)  # the chunk goes to it first
        if head is not None and head.spans:
            chunk = image_chunk(chunk, head.spans, head.length, self.prefill_chunk)
        admits, copies = self._admit_pending(chunk)
        self._grow(chunk)
        kind = next_kind(prefilling=bool(self._rests()), decoding=decoding)
        prefills = kind in (StepKind.PREFILL, StepKind.MIXED)
        self._step_rows = rows if self._pipelined and decoding else None  # None: every row, the plain schedule
        header = Header(kind, changes.adds, changes.releases, chunk if prefills else 0, admits, preempts, copies,
                        self._step_rows)
        self.link.send_header(header)
        self._last_header = time.monotonic()
        return header

    def _follow(self) -> Header:
        header = self.link.receive_header()
        self._apply(header)
        self._drop_local()
        for preempt in header.preempts:
            self._preempt(preempt)
        copies = header.copies or (NO_COPY,) * len(header.admits)
        if len(copies) != len(header.admits):
            raise WireError(f"header copies blocks for {len(copies)} of {len(header.admits)} admissions")
        for shared, copy in zip(header.admits, copies, strict=True):
            self._admit(shared, copy)
        self._grow(header.chunk)
        if header.rows is not None and header.rows[1] > len(self._running):
            raise WireError(f"header decodes rows {header.rows} of {len(self._running)} running")
        self._step_rows = header.rows
        return header

    def _plan_preemptions(self) -> tuple[Preempt, ...]:
        """Rank 0: while the running requests' next positions need more blocks than the pool has, preempt the most
        recently admitted (its blocks go back; it is recomputed later). The pool holds one whole-context request,
        so the first running request always fits."""
        preempts: list[Preempt] = []
        while len(self._running) > 1 and self._short_of_blocks():
            if self._in_flight:  # the victim's tokens must all be back (also: finished rows may free blocks)
                self._drain()
                continue
            victim = self._running[-1]
            preempt = Preempt(victim.request_id, tuple(victim.emitted))
            self._preempt(preempt)
            preempts.append(preempt)
        return tuple(preempts)

    def _short_of_blocks(self) -> bool:
        """Whether the running requests' next step needs more blocks than a pool has (a hybrid model's sliding pool
        counted for whole prefill chunks: the chunk is not chosen yet)."""
        if growth_blocks(self._running, self.block_size) > self.blocks.available:
            return True
        local = self.local_blocks
        return local is not None and windows.local_growth(self._running, self.prefill_chunk,
                                                          self.block_size) > local.available

    def _admit_pending(self, chunk: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, int], ...]]:
        """Rank 0: admit pending requests in queue order while this step's chunk outlasts the prompts already being
        prefilled (schedule.can_admit) and the pool has blocks for the whole prompt beside the running requests'
        growth; each shares the cached blocks of its longest cached prefix and copies the block holding most of its
        next tokens (_tail_source). The header carries those blocks per admission and every other rank repeats the
        admissions in order, so block tables stay identical."""
        admits: list[tuple[int, ...]] = []
        copies: list[tuple[int, int]] = []
        rests = self._rests()
        reserve = growth_blocks(self._running, self.block_size)
        local_reserve = windows.local_growth(self._running, chunk, self.block_size) if self.local_blocks else 0
        while self._pending and can_admit(rests=rests, chunk=chunk, free_slots=self.max_batch - len(self._running),
                                          admitted=len(admits)):
            head = self._pending[0]
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
                break  # the queue waits for blocks (FIFO: a short prompt behind never starves a long one ahead)
            if self.local_blocks is not None and local_reserve + self._local_need(
                    head, len(shared), copy[1], local, local_copy, chunk) > self.local_blocks.available:
                break
            flat = tuple(shared) if self.local_blocks is None else windows.pack(shared, local, local_copy)
            req = self._admit(flat, copy)
            admits.append(flat)
            copies.append(copy)
            rests.append(len(req.prompt) - req.length)
            if self.local_blocks is not None:
                local_reserve += windows.local_growth([req], chunk, self.block_size)
        return tuple(admits), tuple(copies) if any(c != NO_COPY for c in copies) else ()

    def _tail_sources(self, head: Request, shared: list[int]) -> tuple[tuple[int, int], int | None]:
        """Rank 0: the partial block the prompt copies after its shared whole blocks (_tail_source), and for a
        hybrid model the sliding group's block holding the same tokens (None: no copy). The copy takes the tokens
        both groups hold; NO_COPY if that is fewer than min_copy."""
        copy = self._tail_source(head, shared, self.blocks, lambda r: r.table)
        if self.local_blocks is None or copy == NO_COPY:
            return copy, None
        local = self._tail_source(head, shared, self.local_blocks, lambda r: r.local)
        took = min(copy[1], local[1])
        return ((copy[0], took), local[0]) if took >= self.blocks.min_copy else (NO_COPY, None)

    def _tail_source(self, head: Request, shared: list[int], blocks: BlockAllocator,
                     table: Callable[[Request], list[int]]) -> tuple[int, int]:
        """Rank 0: the block of a group (its allocator, a request's table of it) holding the most of the prompt's
        tokens after its shared whole blocks, and how many of them it takes: among cached blocks (blocks.match_tail)
        and the blocks running requests hold after the same shared ones (written up to their length, never again).
        NO_COPY: none. The prompt's last token is always computed, so it gets logits to sample from."""
        n, size = len(shared), self.block_size
        start = n * size
        want = head.prompt[start : min(start + size, len(head.prompt) - 1)]
        if not (want and self.share_prefixes) or head.spans:
            return NO_COPY
        best = blocks.match_tail(head.keys[n - 1] if n else 0, want) or NO_COPY
        for r in self._running:
            held = table(r)
            if not r.spans and r.length > start and len(held) > n and held[n] != NO_BLOCK and r.table[:n] == shared:
                took = common_prefix(r.tokens(start, min(r.length, start + size)), want)
                if took >= blocks.min_copy and took > best[1]:
                    best = (held[n], took)
        return best

    def _local_need(self, head: Request, n: int, copied: int, local: list[int], local_copy: int | None,
                    chunk: int) -> int:
        """Rank 0: sliding-pool blocks admitting head takes before its first step: its first chunk's past the n
        shared ones, and the cached ones it (and its copy's source) takes out of the LRU."""
        assert self.local_blocks is not None
        length = n * self.block_size + copied
        ahead = max(1, min(len(head.prompt) - length, chunk))
        pinned = [b for b in local if b != NO_BLOCK] + ([] if local_copy is None else [local_copy])
        return max(0, blocks_for(length + ahead, self.block_size) - n) + _revived(self.local_blocks, pinned)

    def _rests(self) -> list[int]:
        """Prompt tokens still to prefill, per request being prefilled, in row order."""
        return [len(r.prompt) - r.length for r in self._running if r.length < len(r.prompt)]

    def _apply(self, header: Header) -> None:
        for release in header.releases:
            self._release(release)
        for add in header.adds:
            self._pending.append(self._new_request(add))
            if add.request_id != WARMUP_ID:
                self._events.append(Admitted(add.request_id, add.command_id, len(add.prompt), time.perf_counter(),
                                             tuple(add.prompt[-8:]), add.sampling.constraint is not None))

    def _new_request(self, add: NewRequest) -> Request:
        s = add.sampling_params()
        row = row_sampling(s, self.model.args.vocab_size, self.device, self._unseeded)
        decoder = IncrementalDecoder(self.tokenizer.decode)
        stops = StopMatcher(s.stop)
        constraint = None
        if s.constraint is not None and (self.is_sampler or self.is_scheduler):  # rank 0 checks it compiles
            harmony = self.tokenizer.reasoning_mode(add.prompt, self.tokenizer.card_reasoning) == "harmony"
            constraint = self.grammars.matcher(s.constraint, harmony_reply=harmony)
        budget = reasoning_budget(s, add.prompt, self.tokenizer, constraint) if self.is_sampler else None
        constraint, held, gate = held_for_reasoning(constraint, add.prompt, self.tokenizer)
        return Request(add.request_id, add.prompt, s.max_tokens, row, decoder, stops, command_id=add.command_id,
                       constraint=constraint, budget=budget, held=held, gate=gate,
                       spans=image_spans(add.prompt, self.model.args.image_token_id),
                       vision=self._visions.get(add.request_id))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars for this model's vocabulary, built on first use."""
        style = tool_call_style(self.model.args.model_type, self.tokenizer.renders_tools,
                                self.tokenizer.template_text, self.tokenizer.card_tool_parser)
        return Grammars(self.tokenizer.hf, self.model.args.vocab_size, self.tokenizer.eos_ids, style)

    def _release(self, release: Release) -> None:
        """Drop a pending request, or a running one and its blocks (its full blocks stay cached for reuse)."""
        self._visions.pop(release.request_id, None)
        found = next((r for r in self._pending if r.request_id == release.request_id), None)
        if found is not None:
            self._pending.remove(found)
        else:
            found = next((r for r in self._running if r.request_id == release.request_id), None)
            if found is None:
                return
            self._running.remove(found)
            self._free_table(found)
            if found.lookup is not None and found.lookup.drafted:
                lookup = found.lookup
                self.spec_drafted += lookup.drafted
                self.spec_accepted += lookup.accepted
                log.info("MTP acceptance %.0f %% for %s: %d of %d %s draft tokens accepted",
                         100 * lookup.accepted / lookup.drafted, found.request_id, lookup.accepted, lookup.drafted,
                         "prompt-lookup" if self.drafter is None else "draft-model")
        if found.request_id == WARMUP_ID:
            self._warming = False
        else:
            self._events.append(Released(found.request_id, found.command_id, release.cancelled, release.failed))

    def _free_table(self, req: Request) -> None:
        """Give a leaving (or preempted) request's blocks back, those holding any of its tokens kept cached; on rank 0
        its full blocks are keyed by their tokens first, and every kept block's tokens remembered, so a later prompt
        starting with them finds them (whole blocks shared, a last partial one copied)."""
        kept = blocks_for(req.length, self.block_size)
        self._publish(req)
        self._let_go(req, req.table, self.blocks, kept)
        req.table = []
        if self.local_blocks is not None:
            self._let_go(req, req.local, self.local_blocks, kept)
            req.local = []

    def _let_go(self, req: Request, table: list[int], blocks: BlockAllocator, kept: int) -> None:
        """_free_table for one group's table: rank 0 remembers the tokens of its first `kept` blocks (those holding
        some), which stay cached; entries behind a window (NO_BLOCK) lead the table and hold nothing."""
        if self.is_scheduler and self.share_prefixes and not req.spans:
            for i, block in enumerate(table[:kept]):
                if block != NO_BLOCK:
                    tokens = req.tokens(i * self.block_size, min(req.length, (i + 1) * self.block_size))
                    blocks.remember(block, req.keys[i - 1] if i else 0, tokens)
        held = [b for b in table if b != NO_BLOCK]
        blocks.free_table(held, kept - (len(table) - len(held)))

    def _drop_behind_window(self, req: Request) -> None:
        """Free the blocks no query of the request can see again: every position in them is at least `window`
        behind its next one (its next chunk starts there too). Their table entries become NO_BLOCK: the kernels
        start at the window and the torch path's gather reads them masked."""
        behind = (req.length + 1 - self.window) // self.block_size
        for i in range(min(behind, len(req.table))):
            if req.table[i] != NO_BLOCK:
                self.blocks.free(req.table[i], keep=False)
                req.table[i] = NO_BLOCK

    def _publish(self, req: Request) -> None:
        """Rank 0: key the request's full blocks by their tokens, so another prompt starting with them shares them
        (while this one still runs, too: ten chats with one system prompt hold it once)."""
        if not (self.is_scheduler and self.share_prefixes) or req.spans:
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

    def _preempt(self, preempt: Preempt) -> None:
        """Take a running request out and put it back at the head of the queue, its generated tokens (the header's,
        so every rank agrees) appended to its prompt: recomputed when it is admitted again."""
        req = next((r for r in self._running if r.request_id == preempt.request_id), None)
        if req is None:
            raise WireError(f"header preempts {preempt.request_id!r}, which is not running")
        self._running.remove(req)
        self._free_table(req)
        req.prompt = [*req.prompt, *preempt.tokens]
        req.emitted, req.length, req.draft_len = [], 0, 0
        self._pending.appendleft(req)
        self.preemptions += 1

    def _admit(self, shared: tuple[int, ...], copy: tuple[int, int] = NO_COPY) -> Request:
        """Move the first pending request into the next row, sharing the cached blocks `shared` for its first
        positions, taking fresh blocks for the rest of its prompt, and copying the first `copy[1]` positions of
        block `copy[0]` into the first fresh one (copy-on-write of a partial match: it writes past them). A hybrid
        model's `shared` packs both groups' (windows.pack); its sliding table takes no block past them here."""
        if not self._pending or len(self._running) >= self.max_batch:
            raise WireError(f"header admits a request with {len(self._pending)} pending, {len(self._running)} running")
        local: list[int] = []
        local_copy: int | None = None
        if self.local_blocks is not None:
            try:
                full, local, local_copy = windows.unpack(shared, copy[1] > 0)
            except ValueError as exc:
                raise WireError(f"header admits with {exc}") from None
            if any(not NO_BLOCK <= b < self.local_blocks.num_blocks for b in [*local, local_copy or 0]):
                raise WireError(f"header shares sliding blocks {local} (copy {local_copy}) out of the pool")
            shared = tuple(full)
        req = self._pending[0]
        source, copied = copy
        length = len(shared) * self.block_size + copied
        if not 0 <= copied <= self.block_size or not 0 <= source < self.blocks.num_blocks \
                or (length >= len(req.prompt) and length):
            raise WireError(f"header reuses {length} positions ({len(shared)} blocks, then {copied} copied from "
                            f"block {source}) of a {len(req.prompt)}-token prompt")
        need = blocks_for(len(req.prompt), self.block_size) - len(shared)  # its first decode's: _grow
        for block in shared:
            self.blocks.share(block)
        if copied:
            self.blocks.share(source)  # held while the fresh blocks are taken, so none of them is the source
        req.table = [*shared, *(self.blocks.allocate() for _ in range(need))]
        if copied:
            self.cache.copy_block(source, req.table[len(shared)])
            self.blocks.free(source, keep=True)
        if self.local_blocks is not None:
            req.local = self._admit_local(local, local_copy)
        self._pending.popleft()
        req.length = length
        self._running.append(req)
        if req.request_id != WARMUP_ID:
            self._events.append(Started(req.request_id, req.command_id, length))
        return req

    def _admit_local(self, local: list[int], source: int | None) -> list[int]:
        """An admitted request's sliding table: the shared blocks of its window, and a fresh block holding a copy of
        block `source` (the partial block the full group copies too)."""
        blocks = self.local_blocks
        assert blocks is not None
        for block in local:
            if block != NO_BLOCK:
                blocks.share(block)
        if source is None:
            return list(local)
        blocks.share(source)  # held while the fresh block is taken, so it is not the source
        fresh = blocks.allocate()
        self.cache.copy_block(source, fresh, group=1)
        blocks.free(source, keep=True)
        return [*local, fresh]

    def _drop_local(self) -> None:
        """A hybrid model's sliding tables give back the blocks behind their windows (windows.drop_behind), before
        anything is planned: what the step needs is then counted against what the pool really has."""
        if self.local_blocks is not None:
            for req in self._running:
                windows.drop_behind(req.local, self.local_blocks, req.length, self.local_window, self.block_size)

    def _grow(self, chunk: int) -> None:
        """Every running request gets the block its next position falls in, in row order (so every rank takes
        the same blocks): rank 0 preempted enough that they exist. Where every layer slides, blocks wholly
        before the window go back first. A hybrid model's sliding tables take the blocks of every position the
        step writes (a chunk's share: windows.step_ahead)."""
        for req in self._running:
            if self.window:
                self._drop_behind_window(req)
            while len(req.table) < blocks_for(req.length + 1, self.block_size):
                req.table.append(self.blocks.allocate())
        if self.local_blocks is not None:
            for req, ahead in zip(self._running, windows.step_ahead(self._running, chunk), strict=True):
                while len(req.local) < blocks_for(req.length + ahead, self.block_size):
                    req.local.append(self.local_blocks.allocate())


def _revived(blocks: BlockAllocator, pinned: list[int]) -> int:
    """Cached blocks an admission takes out of the LRU (they stop counting as available)."""
    return sum(1 for b in pinned if blocks.refcount(b) == 0)
