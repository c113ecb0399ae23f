"""TorchEngine: one core for every world size, with a paged KV cache, continuous batching, chunked prefill, a
shared prefix cache and preemption.

One step() is one header and exactly the work it names. Rank 0 is the scheduler: it turns queued
add_request/cancel calls into the header's adds and releases, applies them to its own state, decides the step
(schedule.py: a prefill chunk, a decode, or both in one forward pass while both are wanted) and sends it;
every other rank applies the same header to the same state, so pending queues, running rows and block tables
stay identical everywhere without further agreement. A single rank (world size 1) is the same core over a
LocalLink, where sending a header costs nothing and rank 0 is also the sampler.

The KV cache is a pool of fixed-size blocks (cache.py); each request holds a block table (blocks.py), gets its
prompt's blocks when admitted and one more whenever its next position crosses into a new block, and gives them
back when it leaves. Full blocks stay cached under the chain key of their tokens, so a request whose prompt
starts with the same tokens (the next turn of a chat, a shared system prompt) shares them by reference instead
of recomputing them, even while their first owner still runs. When the pool is short, pending requests wait in
the queue (FIFO), and when a running request cannot grow, the most recently admitted one is preempted: its blocks
go back (cached, so its resumption usually finds most of them), it goes back to the head of the queue with the
tokens it generated appended to its prompt, and is recomputed when blocks free up; it never fails. A request
being prefilled holds its rows too; a decode step computes its row but samples nothing from it (the row's
key/value lands on the position its next chunk overwrites, in the same step when the chunk rides on it: MIXED).

Pipeline: rank r owns [start_layer, end_layer); hidden states go rank to rank, the last rank samples and sends
[token, finished, failed] per row back to rank 0. Tensor: every rank runs all layers on its shard with a real
all_reduce; the last rank samples and broadcasts. Only the sampler's step() returns TokenOuts.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from skulk.engines.base import GROUP_STEP_HEARTBEAT_S, TokenOut
from skulk.engines.constrained import Grammars, tool_call_style
from skulk.engines.errors import check_prompt
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.runners import RunnerPhase

from .blocks import BlockAllocator, blocks_for, extend_keys
from .cache import MixedBatch, StepBatch
from .links import GroupLink, Link, LocalLink, ShardKind, TokenRows
from .loader import load_model
from .model import MIXED_STACK_ROWS
from .requests import FaultHook, Request, accept_each, row_sampling
from .schedule import admission_blocks, can_admit, chunk_tokens, growth_blocks, next_kind, pool_blocks, share_chunk
from .speculate import MAX_DRAFT, PromptLookup, accepted_prefix
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from .wire import (
    Admitted,
    Header,
    NewRequest,
    Preempt,
    Release,
    Released,
    RequestEvent,
    Started,
    StepKind,
    WireError,
)

DEFAULT_MAX_BATCH = 64  # concurrent streams per instance (the pool may hold fewer: the rest queue)
DEFAULT_BLOCK_SIZE = 32
NO_BLOCK = -1  # a table entry whose block went back (behind a sliding window): never read unmasked
DEFAULT_PREFILL_CHUNK = 512
WARMUP_ID = "__skulk_warmup__"
PhaseHook = Callable[[RunnerPhase, str], None]
PromptPart = tuple[int, Request, int, int]
"""(row, request, start, end): the prompt positions [start, end) one step prefills for the request in row."""

_PHASES: dict[tuple[str, StepKind], RunnerPhase] = {
    ("pipeline", StepKind.PREFILL): "prefill_pipeline",
    ("pipeline", StepKind.DECODE): "decode_stream",
    ("tensor", StepKind.PREFILL): "prefill_barrier",
    ("tensor", StepKind.DECODE): "decode_barrier",
}
_EMA = 0.3  # weight of the newest step in the scheduler's running cost averages
log = logging.getLogger(__name__)


def _tensor_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


class TorchEngine:
    def __init__(
        self,
        model_dir: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        kind: ShardKind = "pipeline",
        start_layer: int = 0,
        end_layer: int | None = None,
        control_group: Any = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_seq: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantize: str | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        speculate: bool = True,
    ) -> None:
        """max_seq: an optional cap on the context below the model's max_position_embeddings (a placement's
        max_context). kv_cache_bytes: the block pool's size on this rank (None: schedule.pool_blocks' default
        share of free memory); it always holds at least one request of the whole context. speculate: prompt-lookup
        drafting (speculate.py) for greedy requests on a single rank."""
        if max_batch < 1 or prefill_chunk < 1 or block_size < 1:
            raise ValueError("max_batch, prefill_chunk and block_size must be at least 1")
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.device = torch.device(device)
        tensor = kind == "tensor" and world_size > 1
        self.model = load_model(
            model_dir, start_layer=0 if tensor else start_layer, end_layer=None if tensor else end_layer,
            tp_rank=rank if tensor else 0, tp_size=world_size if tensor else 1,
            all_reduce=_tensor_all_reduce if tensor else None, dtype=dtype, device=self.device, quantize=quantize,
        )
        positions = self.model.args.max_position_embeddings
        self.context_length = min(positions, max_seq) if max_seq is not None else positions
        self.max_batch, self.prefill_chunk, self.block_size = max_batch, prefill_chunk, block_size
        per_token = self.model.kv_bytes_per_token()
        num_blocks = pool_blocks(kv_cache_bytes, per_token, block_size, self.context_length, max_batch)
        self._agree = world_size > 1  # a group agrees on one pool size at its first step (_agree_pool)
        self.blocks = BlockAllocator(num_blocks, block_size)
        args = self.model.args
        every_layer_slides = all(args.is_sliding(i) for i in range(args.num_hidden_layers))
        self.window = (args.sliding_window or 0) if every_layer_slides else 0  # blocks behind it are freed
        self.speculate = speculate and world_size == 1
        self.cache = self.model.make_cache(num_blocks, block_size)
        self.tokenizer = ChatTokenizer(model_dir)
        self.is_scheduler, self.is_sampler = rank == 0, rank == world_size - 1
        self.needs_ids = tensor or rank == 0  # who embeds token ids
        self.link: Link = LocalLink() if world_size == 1 else GroupLink(rank, world_size, kind, control_group)
        self.on_phase: PhaseHook | None = None
        self.closed = False
        self.fault_hook: FaultHook | None = None
        self._pending: deque[Request] = deque()
        self._running: list[Request] = []  # index == batch row, identical on every rank
        self._adds: list[NewRequest] = []  # rank 0: for the next header
        self._releases: list[Release] = []  # rank 0: for the next header
        self.preemptions = 0  # requests preempted (and later resumed) since start
        self._events: list[RequestEvent] = []
        self._phase: RunnerPhase = "idle"
        self._last_header = 0.0
        self._decode_s = 0.0  # rank 0: running average of a decode step
        self._last_chunk: tuple[int, float] | None = None  # rank 0: (tokens, seconds) of the last prefill chunk
        self._warming = False
        self._chunk_done = 0  # prompt tokens the last prefill step computed
        self._unseeded = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools)

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = ""
    ) -> None:
        """Rank 0 queues the request for the next header; on other ranks this is a no-op."""
        if not self.is_scheduler:
            return
        check_prompt(prompt_ids, self.context_length)
        known = {r.request_id for r in (*self._pending, *self._running)} | {a.request_id for a in self._adds}
        if request_id in known:
            raise ValueError(f"request {request_id!r} is already running")
        add = NewRequest.of(request_id, command_id, list(prompt_ids), sampling)
        req = self._new_request(add)  # what every rank will build from the header: if it raises, it does here
        if self.fault_hook is not None:
            self.fault_hook("admit", req)
        self._adds.append(add)

    def cancel(self, request_id: str) -> None:
        """Rank 0 releases the request in the next header (every rank then frees it); elsewhere a no-op."""
        if not self.is_scheduler:
            return
        before = len(self._adds)
        self._adds = [a for a in self._adds if a.request_id != request_id]
        if len(self._adds) == before:
            self._releases.append(Release(request_id, cancelled=True))

    def has_work(self) -> bool:
        """Rank 0: something to compute or announce, or (in a group) a heartbeat is due. Others: always, until
        shutdown, because they must be inside step() whenever rank 0 sends."""
        if not self.is_scheduler:
            return not self.closed
        if self._pending or self._running or self._adds or self._releases:
            return True
        return self.world_size > 1 and time.monotonic() - self._last_header >= GROUP_STEP_HEARTBEAT_S

    def step(self) -> list[TokenOut]:
        if self._agree:
            self._agree_pool()
        with torch.inference_mode():
            header = self._lead() if self.is_scheduler else self._follow()
            started = time.perf_counter()
            if header.kind == StepKind.PREFILL:
                outs = self._prefill(header)
            elif header.kind == StepKind.MIXED:
                outs = self._mixed(header)
            elif header.kind == StepKind.DECODE:
                drafts = self._drafts() if self.speculate and self.fault_hook is None else None
                outs = self._speculate(drafts) if drafts else self._decode()
            else:
                if header.kind == StepKind.SHUTDOWN:
                    self.closed = True
                self._enter_phase("idle", "heartbeat")
                return []
            if self.is_scheduler:
                self._measure(header, time.perf_counter() - started, self._chunk_done)
            return outs

    def _agree_pool(self) -> None:
        """Every rank's allocator must make the same choices, so a group takes its smallest pool. Done at the
        first step, which every rank enters together (a collective while the ranks still load could outlast the
        group timeout), before any block is used; the cache's pages were never touched, so remaking it is free."""
        self._agree = False
        control = self.link.control_group if isinstance(self.link, GroupLink) else None
        agreed = torch.tensor([self.blocks.num_blocks], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
        if int(agreed.item()) != self.blocks.num_blocks:
            self.blocks = BlockAllocator(int(agreed.item()), self.block_size)
            self.cache = self.model.make_cache(self.blocks.num_blocks, self.block_size)

    def warmup(self) -> None:
        """Rank 0 generates two tokens of a throwaway request and every rank steps until the header releases
        it, so each rank has run its layers and a group's connections are exercised."""
        self._warming = True
        if self.is_scheduler:
            prompt = self.tokenizer.encode("warmup") or [0]
            self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self._warming:
            self.step()
        self._events.clear()

    # --- extras for the runner -----------------------------------------------------------------------------

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting on peers (pipeline recv, token share) since the runner last took it."""
        return self.link.wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self.link.wait_s = value

    @property
    def queued(self) -> int:
        """Requests waiting for rows or blocks (rank 0's view: the queue diagnostics show)."""
        return len(self._pending) + len(self._adds)

    def kv_usage(self) -> dict[str, int]:
        """The block pool at a glance: blocks in all, held by requests, cached prefixes, and their size."""
        return {"kv_blocks": self.blocks.num_blocks, "kv_blocks_held": self.blocks.held,
                "kv_blocks_cached": self.blocks.cached, "kv_block_size": self.block_size,
                "running": len(self._running), "queued": self.queued, "preemptions": self.preemptions}

    def take_events(self) -> list[RequestEvent]:
        """Requests admitted and released by the headers since the last call (cheap when nothing happened)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Rank 0 tells everyone to leave (with any last releases); a dead peer no longer matters here."""
        if self.is_scheduler and not self.closed:
            self.closed = True
            try:
                if self._agree:  # the others wait for the agreement before any header
                    self._agree_pool()
                self.link.send_header(Header(StepKind.SHUTDOWN, (), tuple(self._releases)))
            except RuntimeError:
                pass
        self.closed = True

    # --- headers -------------------------------------------------------------------------------------------

    def _lead(self) -> Header:
        changes = Header(StepKind.HEARTBEAT, tuple(self._adds), tuple(self._releases))
        self._adds, self._releases = [], []
        self._apply(changes)
        preempts = self._plan_preemptions()
        decoding = any(r.length >= len(r.prompt) for r in self._running)
        chunk = chunk_tokens(self.prefill_chunk, decoding=decoding, decode_s=self._decode_s,
                             last_chunk=self._last_chunk)
        admits = self._admit_pending(chunk)
        self._grow()
        kind = next_kind(prefilling=bool(self._rests()), decoding=decoding)
        prefills = kind in (StepKind.PREFILL, StepKind.MIXED)
        header = Header(kind, changes.adds, changes.releases, chunk if prefills else 0, admits, preempts)
        self.link.send_header(header)
        self._last_header = time.monotonic()
        return header

    def _follow(self) -> Header:
        header = self.link.receive_header()
        self._apply(header)
        for preempt in header.preempts:
            self._preempt(preempt)
        for shared in header.admits:
            self._admit(shared)
        self._grow()
        return header

    def _plan_preemptions(self) -> tuple[Preempt, ...]:
        """Rank 0: while the running requests' next positions need more blocks than the pool has, preempt the most
        recently admitted (its blocks go back; it is recomputed later). The pool holds one whole-context request,
        so the first running request always fits."""
        preempts: list[Preempt] = []
        while len(self._running) > 1 and growth_blocks(self._running, self.block_size) > self.blocks.available:
            victim = self._running[-1]
            preempt = Preempt(victim.request_id, tuple(victim.emitted))
            self._preempt(preempt)
            preempts.append(preempt)
        return tuple(preempts)

    def _admit_pending(self, chunk: int) -> tuple[tuple[int, ...], ...]:
        """Rank 0: admit pending requests in queue order while this step's chunk outlasts the prompts already being
        prefilled (schedule.can_admit) and the pool has blocks for the whole prompt beside the running requests'
        growth; each shares the cached blocks of its longest cached prefix. The header carries those blocks per
        admission and every other rank repeats the admissions in order, so block tables stay identical."""
        admits: list[tuple[int, ...]] = []
        rests = self._rests()
        reserve = growth_blocks(self._running, self.block_size)
        while self._pending and can_admit(rests=rests, chunk=chunk, free_slots=self.max_batch - len(self._running),
                                          admitted=len(admits)):
            head = self._pending[0]
            limit = (len(head.prompt) - 1) // self.block_size  # the prompt's last token is always computed
            extend_keys(head.keys, head.prompt, self.block_size, limit)
            shared = self.blocks.match(head.keys[:limit])
            revived = sum(1 for b in shared if self.blocks.refcount(b) == 0)  # cached blocks it takes out of the LRU
            if admission_blocks(len(head.prompt), len(shared), self.block_size) + revived + reserve \
                    > self.blocks.available:
                break  # the queue waits for blocks (FIFO: a short prompt behind never starves a long one ahead)
            req = self._admit(tuple(shared))
            admits.append(tuple(shared))
            rests.append(len(req.prompt) - req.length)
        return tuple(admits)

    def _rests(self) -> list[int]:
        """Prompt tokens still to prefill, per request being prefilled, in row order."""
        return [len(r.prompt) - r.length for r in self._running if r.length < len(r.prompt)]

    def _apply(self, header: Header) -> None:
        for release in header.releases:
            self._release(release)
        for add in header.adds:
            self._pending.append(self._new_request(add))
            if add.request_id != WARMUP_ID:
                self._events.append(Admitted(add.request_id, add.command_id, len(add.prompt), time.perf_counter()))

    def _new_request(self, add: NewRequest) -> Request:
        s = add.sampling_params()
        row = row_sampling(s, self.model.args.vocab_size, self.device, self._unseeded)
        decoder = IncrementalDecoder(self.tokenizer.decode)
        stops = StopMatcher(s.stop)
        constraint = None
        if s.constraint is not None and (self.is_sampler or self.is_scheduler):  # rank 0 checks it compiles
            constraint = self.grammars.matcher(s.constraint)
        return Request(add.request_id, add.prompt, s.max_tokens, row, decoder, stops, command_id=add.command_id,
                       constraint=constraint)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars for this model's vocabulary, built on first use."""
        style = tool_call_style(self.model.args.model_type, self.tokenizer.renders_tools,
                                str(getattr(self.tokenizer.hf, "chat_template", None) or ""))
        return Grammars(self.tokenizer.hf, self.model.args.vocab_size, self.tokenizer.eos_ids, style)

    def _release(self, release: Release) -> None:
        """Drop a pending request, or a running one and its blocks (its full blocks stay cached for reuse)."""
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
                log.info("MTP acceptance %.0f %% for %s: %d of %d prompt-lookup draft tokens accepted",
                         100 * lookup.accepted / lookup.drafted, found.request_id, lookup.accepted, lookup.drafted)
        if found.request_id == WARMUP_ID:
            self._warming = False
        else:
            self._events.append(Released(found.request_id, found.command_id, release.cancelled, release.failed))

    def _free_table(self, req: Request) -> None:
        """Give a leaving (or preempted) request's blocks back; on rank 0 its full blocks are keyed by their tokens
        first, so a later prompt starting with them finds them."""
        full = req.length // self.block_size
        self._publish(req)
        held = [b for b in req.table if b != NO_BLOCK]
        self.blocks.free_table(held, full - (len(req.table) - len(held)))
        req.table = []

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
        if not self.is_scheduler:
            return
        full = req.length // self.block_size
        extend_keys(req.keys, req.tokens(0, full * self.block_size), self.block_size, full)
        for block, key in zip(req.table[:full], req.keys[:full], strict=True):
            if block != NO_BLOCK:
                self.blocks.cache_full(block, key)

    def _preempt(self, preempt: Preempt) -> None:
        """Take a running request out and put it back at the head of the queue, its generated tokens (the header's,
        so every rank agrees) appended to its prompt: recomputed when it is admitted again."""
        req = next((r for r in self._running if r.request_id == preempt.request_id), None)
        if req is None:
            raise WireError(f"header preempts {preempt.request_id!r}, which is not running")
        self._running.remove(req)
        self._free_table(req)
        req.prompt = [*req.prompt, *preempt.tokens]
        req.emitted, req.length = [], 0
        self._pending.appendleft(req)
        self.preemptions += 1

    def _admit(self, shared: tuple[int, ...]) -> Request:
        """Move the first pending request into the next row, sharing the cached blocks `shared` for its first
        positions and taking fresh blocks for the rest of its prompt."""
        if not self._pending or len(self._running) >= self.max_batch:
            raise WireError(f"header admits a request with {len(self._pending)} pending, {len(self._running)} running")
        req = self._pending[0]
        length = len(shared) * self.block_size
        if length >= len(req.prompt) and shared:
            raise WireError(f"header shares {len(shared)} blocks of a {len(req.prompt)}-token prompt")
        need = blocks_for(len(req.prompt), self.block_size) - len(shared)  # its first decode's: _grow
        for block in shared:
            self.blocks.share(block)
        req.table = [*shared, *(self.blocks.allocate() for _ in range(need))]
        self._pending.popleft()
        req.length = length
        self._running.append(req)
        if req.request_id != WARMUP_ID:
            self._events.append(Started(req.request_id, req.command_id, length))
        return req

    def _grow(self) -> None:
        """Every running request gets the block its next position falls in, in row order (so every rank takes
        the same blocks): rank 0 preempted enough that they exist. Where every layer slides, blocks wholly
        before the window go back first."""
        for req in self._running:
            if self.window:
                self._drop_behind_window(req)
            while len(req.table) < blocks_for(req.length + 1, self.block_size):
                req.table.append(self.blocks.allocate())

    def _enter_phase(self, phase: RunnerPhase, event: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    def _measure(self, header: Header, seconds: float, tokens: int) -> None:
        """Rank 0's running average of a decode step and the cost of the last chunk that rode on one (chunk
        sizing): the time it added to it. A prefill step alone forgets it: its chunk ran alone, on another path and
        often at another size (a burst's prompts together), so it says little about what a riding chunk adds."""
        if header.kind == StepKind.DECODE:
            self._decode_s += _EMA * (seconds - self._decode_s) if self._decode_s else seconds
        elif header.kind == StepKind.MIXED:
            self._last_chunk = (tokens, max(seconds - self._decode_s, 0.0))
        elif header.kind == StepKind.PREFILL:
            self._last_chunk = None

    # --- compute -------------------------------------------------------------------------------------------

    def _prefill(self, header: Header) -> list[TokenOut]:
        """The next chunk of every prompt being prefilled (one part each, several short prompts in one pass)."""
        self._enter_phase(_PHASES[self.kind, StepKind.PREFILL], "prefill")
        chunks = self._chunks(header.chunk)
        parts = [self._chunk_batch(chunk) for chunk in chunks]
        batch = parts[0] if len(parts) == 1 else MixedBatch(tuple(parts))
        logits = self._forward(self._ids([], chunks), batch, (1, self._chunk_done), last_only=True)
        done = self._finish(chunks)
        if not done:
            return []
        reqs = [chunks[j][1] for j in done]
        outs = self._accept(logits[0, done].unsqueeze(1), reqs) if logits is not None else []
        if self.is_scheduler and self.kind == "pipeline" and self.world_size > 1:
            self._enter_phase("decode_wait_first_token", "prefill_sent")
        self._share_tokens(reqs, outs)
        return outs

    def _mixed(self, header: Header) -> list[TokenOut]:
        """A decode step of every running request and the next chunk of the prompts being prefilled, in one
        forward pass (cache.MixedBatch): the chunks ride on the decode step's read of the weights."""
        self._enter_phase(_PHASES[self.kind, StepKind.DECODE], "decode")
        chunks = self._chunks(header.chunk)
        # a row being prefilled decodes too (its token is dropped): its write at its length is overwritten by its
        # chunk, this step or a later one
        decode, last_tokens, rows = self._decode_rows()
        batch = MixedBatch((decode, *(self._chunk_batch(chunk) for chunk in chunks)))
        n = len(self._running)
        logits = self._forward(self._ids(last_tokens, chunks), batch, (1, n + self._chunk_done), last_only=True)
        decoding = self._advance(rows)
        done = self._finish(chunks)
        reqs = [*decoding, *(chunks[j][1] for j in done)]
        outs: list[TokenOut] = []
        if logits is not None:  # rows: one per running request, then each chunk's last token
            outs = self._accept(logits[0, [*rows, *(n + j for j in done)]].unsqueeze(1), reqs)
        self._share_tokens(reqs, outs)
        return outs

    def _chunks(self, chunk: int) -> list[PromptPart]:
        """The prompt parts this step prefills (schedule.share_chunk), with _chunk_done set to their tokens."""
        prefilling = [(i, r) for i, r in enumerate(self._running) if r.length < len(r.prompt)]
        shares = share_chunk([len(r.prompt) - r.length for _, r in prefilling], chunk)
        self._chunk_done = sum(shares)
        return [(i, r, r.length, r.length + take) for (i, r), take in zip(prefilling, shares, strict=True) if take]

    def _chunk_batch(self, part: PromptPart) -> StepBatch:
        _, req, start, end = part
        tables = torch.tensor([req.table], dtype=torch.int32, device=self.device)
        return StepBatch.build(torch.arange(start, end, device=self.device).unsqueeze(0), tables, kv_len=end)

    def _ids(self, last_tokens: list[int], chunks: list[PromptPart]) -> torch.Tensor | None:
        """The step's input ids as one sequence: decode rows' last tokens, then each chunk's prompt tokens."""
        if not self.needs_ids:
            return None
        return torch.tensor([[*last_tokens, *(t for _, req, start, end in chunks for t in req.prompt[start:end])]],
                            device=self.device)

    def _finish(self, chunks: list[PromptPart]) -> list[int]:
        """Advance each chunk's request to its end (publishing its new full blocks); the indices of the chunks
        that completed their prompt."""
        for _, req, _, end in chunks:
            req.length = end
            self._publish(req)
        return [j for j, (_, req, _, end) in enumerate(chunks) if end == len(req.prompt)]

    def _decode(self) -> list[TokenOut]:
        self._enter_phase(_PHASES[self.kind, StepKind.DECODE], "decode")
        running = self._running
        batch, last_tokens, rows = self._decode_rows()
        ids = torch.tensor(last_tokens, device=self.device).unsqueeze(1) if self.needs_ids else None
        logits = self._forward(ids, batch, (len(running), 1))
        decoding = self._advance(rows)
        if logits is not None and len(rows) < len(running):
            logits = logits[rows]
        outs = self._accept(logits, decoding) if logits is not None else []
        self._share_tokens(decoding, outs)
        return outs

    def _drafts(self) -> list[list[int]] | None:
        """A prompt-lookup draft per running request (some empty), when every one decodes greedily without
        log-probabilities and at least one has a draft; None for a plain decode step. Drafts stop short of a
        request's max_tokens and context, fit the free blocks, and keep the step under MIXED_STACK_ROWS rows."""
        running = self._running
        if any(r.sampling.temperature > 0 or r.sampling.logprobs is not None or r.constraint is not None
               for r in running):  # a constrained row's token is its grammar's, not the raw argmax drafts check
            return None
        room, free = max(0, MIXED_STACK_ROWS // len(running) - 1), self.blocks.available
        drafts: list[list[int]] = []
        for req in running:
            if req.lookup is None:
                req.lookup = PromptLookup()
            limit = min(MAX_DRAFT, room, req.max_tokens - req.generated - 1, self.context_length - req.length - 1,
                        (len(req.table) + free) * self.block_size - req.length - 1)
            draft = req.lookup.propose(req.tokens(), limit)
            free -= max(0, blocks_for(req.length + 1 + len(draft), self.block_size) - len(req.table))
            drafts.append(draft)
        return drafts if any(drafts) else None

    def _speculate(self, drafts: list[list[int]]) -> list[TokenOut]:
        """A decode step that also verifies each request's draft: its last token and draft as one chunk (a MixedBatch
        part per request), then per request the draft's prefix greedy decoding confirms and the model's next token,
        each accepted as a decode step would accept it (speculate.py). Single rank only: nothing is shared."""
        self._enter_phase(_PHASES[self.kind, StepKind.DECODE], "decode")
        parts, ids = [], []
        for req, draft in zip(self._running, drafts, strict=True):
            tokens = [req.last_token, *draft]
            while len(req.table) < blocks_for(req.length + len(tokens), self.block_size):
                req.table.append(self.blocks.allocate())
            ids += tokens
            table = torch.tensor([req.table], dtype=torch.int32, device=self.device)
            positions = torch.arange(req.length, req.length + len(tokens), device=self.device).unsqueeze(0)
            parts.append(StepBatch.build(positions, table, kv_len=req.length + len(tokens)))
        logits = self._forward(torch.tensor([ids], device=self.device), MixedBatch(tuple(parts)), (1, len(ids)))
        assert logits is not None
        greedy = logits[0].argmax(-1).tolist()
        outs: list[TokenOut] = []
        at = 0
        for req, draft in zip(list(self._running), drafts, strict=True):
            picks = greedy[at : at + len(draft) + 1]
            keep = accepted_prefix(draft, picks)
            if req.lookup is not None:
                req.lookup.record(len(draft), keep)
            for j in range(keep + 1):
                req.length += 1
                out = self._accept(logits[0, at + j : at + j + 1].unsqueeze(1), [req])[0]
                outs.append(out)
                if not out.error:
                    req.emitted.append(out.token_id)
                if out.finish_reason is not None or out.error:
                    self._releases.append(Release(req.request_id, cancelled=False, failed=bool(out.error)))
                    break
            at += len(draft) + 1
        return outs

    def _decode_rows(self) -> tuple[StepBatch, list[int], list[int]]:
        """A decode row per running request: the batch, each row's input token (a row still being prefilled has
        none yet: any id will do, its output is dropped) and the indices of the rows that sample."""
        running = self._running
        width = max(len(r.table) for r in running)
        tables = torch.tensor([r.table + [0] * (width - len(r.table)) for r in running], dtype=torch.int32,
                              device=self.device)
        batch = StepBatch.build(torch.tensor([[r.length] for r in running], device=self.device), tables,
                                kv_len=max(r.length for r in running) + 1)
        rows = [i for i, r in enumerate(running) if r.length >= len(r.prompt)]
        return batch, [max(r.last_token, 0) for r in running], rows

    def _advance(self, rows: list[int]) -> list[Request]:
        """The requests of the sampling rows, each one position further along."""
        decoding = [self._running[i] for i in rows]
        for req in decoding:
            req.length += 1
        return decoding

    def _forward(
        self, ids: torch.Tensor | None, batch: StepBatch | MixedBatch, shape: tuple[int, int], *,
        last_only: bool = False
    ) -> torch.Tensor | None:
        """Run this rank's part of the forward pass; the sampler gets logits, everyone else None."""
        if ids is not None:
            x = ids
        else:
            x = self.link.recv_hidden((*shape, self.model.args.hidden_size), self.model.args.dtype, self.device)
        out = self.model(x, batch, self.cache, last_only=last_only)
        if self.kind == "pipeline" and not self.is_sampler:
            self.link.send_hidden(out)
            return None
        return out if self.is_sampler else None

    def _share_tokens(self, reqs: list[Request], outs: list[TokenOut]) -> None:
        """Get [token, finished, failed] per row from the sampler to the ranks that embed the next input. A row
        that failed on the sampler is finished too: rank 0 releases it in the next header, so every rank frees
        its slot, while its batch-mates go on."""
        rows: TokenRows | None = None
        if self.is_sampler:
            rows = [[0, 1, 1] if o.error else [o.token_id, int(o.finish_reason is not None), 0] for o in outs]
        shared = self.link.exchange_tokens(rows, len(reqs))
        if shared is None:
            return
        for req, (token, finished, failed) in zip(reqs, shared, strict=True):
            req.last_token = token
            if not failed:
                req.emitted.append(token)
            if not self.is_scheduler:
                continue
            if finished:
                req.finished = True
                self._releases.append(Release(req.request_id, cancelled=False, failed=bool(failed)))

    def _accept(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        """The sampler's bookkeeping: text, finish and per-request failure (requests.py)."""
        return accept_each(logits[:, -1], reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)
