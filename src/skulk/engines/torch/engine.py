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

The engine is a composition of parts, each a class of its own holding references to the others it uses (core.py's
docstring lists them), built in one step (core.build_parts) and held here as fields: the Executor and the Scheduler
(core.Parts), Admission over an Inbox, the Stepper with a Speculator where a single rank speculates, Flights with
the group's pace, StepTimes and the Journal. This class is the Engine protocol over them, step()'s order (agree on
the pool, lead or follow a header, run it, time it) and the names the runner, tests and benchmarks read.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, Unpack

import torch
import torch.distributed as dist

from skulk.engines.base import GROUP_STEP_HEARTBEAT_S, TokenOut
from skulk.engines.constrained import Grammars
from skulk.engines.errors import PromptRejected, check_prompt
from skulk.types.chat import ChatMessage, SamplingParams

from .admission import Admission, Inbox
from .blocks import BlockAllocator
from .core import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, WARMUP_ID, Parts, build_parts
from .drafter import Drafter
from .flight import Flights
from .journal import Journal, PhaseHook
from .links import GroupLink, Link
from .local_step import Speculator
from .options import EngineKeywords, Pool, Shard, Weights, split_keywords
from .pace import Pace, head_in_layers
from .requests import FaultHook, Request
from .scheduler import Scheduler
from .step import Stepper
from .timing import StepTimes
from .tokenizer import ChatTokenizer
from .vision import Tower, VisionInput, load_tower, read_images
from .wire import Header, NewRequest, RequestEvent, StepKind

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_BATCH", "DEFAULT_PREFILL_CHUNK", "PhaseHook", "TorchEngine"]


class TorchEngine:
    """The Engine protocol over the parts in core.py's docstring, composed in __init__ (module docstring)."""

    def __init__(self, model_dir: Path, **keywords: Unpack[EngineKeywords]) -> None:
        """keywords: options.Shard's, Pool's and Weights' fields (their docstrings say what each means)."""
        shard, pool, weights = split_keywords(keywords)
        parts = self.build(model_dir, shard, pool, weights)
        self.shard, self.executor, self.scheduler = shard, parts.executor, parts.scheduler
        self.rank, self.world_size, self.kind = shard.rank, shard.world_size, shard.kind
        self.is_scheduler, self.is_sampler = shard.is_scheduler, shard.is_sampler
        self.device = self.executor.device
        self.context_length, self.kv_bits, self.speculate = parts.context_length, parts.kv_bits, parts.speculate
        self.window, self.local_window = parts.window, parts.local_window
        self.max_batch, self.prefill_chunk, self.block_size = pool.max_batch, pool.prefill_chunk, pool.block_size
        self._agree = self.world_size > 1  # a group agrees on one pool size at its first step (_agree_pool)
        self.closed = False
        self.tokenizer = ChatTokenizer(model_dir)
        # rank 0 runs a vision-language model's tower (vision.py); loaded on first use: a text request never pays
        self._model_dir, self._tower_dtype = model_dir, self.model.args.dtype
        self._tower: Tower | None = None
        self.journal, self.times, self.inbox = Journal(), StepTimes(pool.prefill_chunk), Inbox(shard.is_scheduler)
        self.flights = self._flights(shard, parts.scheduler)
        self.admission = Admission(shard, self.scheduler, self.executor, self.flights, self.inbox, self.journal,
                                   self.times, self.tokenizer)
        speculator = Speculator(self.scheduler, self.executor, self.journal, self.inbox.finish,
                                self.tokenizer, kind=shard.kind, context_length=self.context_length,
                                block_size=pool.block_size) if parts.speculate else None
        self.stepper = Stepper(shard, self.scheduler, self.executor, self.flights, self.journal, self.tokenizer,
                               self.context_length, speculator)

    @classmethod
    def build(cls, model_dir: Path, shard: Shard, pool: Pool, weights: Weights) -> Parts:
        """This rank's Executor and Scheduler (core.build_parts); a mixed group's MLX rank builds its own."""
        return build_parts(model_dir, shard, pool, weights)

    def _flights(self, shard: Shard, scheduler: Scheduler[Request]) -> Flights:
        """Rank 0's steps in flight, paced by its own layers against the group's (pace.Pace)."""
        total = self.model.args.num_hidden_layers
        own = (total if shard.end_layer is None else shard.end_layer) - shard.start_layer
        head = head_in_layers(self.model) if shard.is_scheduler else 0
        return Flights(shard, Pace(self.world_size, own, total, head), lambda: scheduler.running, self.inbox.land)

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools, template_kwargs)

    def encode_images(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], VisionInput]:
        """Rank 0: the prompt of a request with images (each image's marker expanded to its placeholder run) and
        the vision tower's embeddings for it (vision.py). PromptRejected for a model without vision, a Tensor
        split (every rank embeds there; only rank 0 has the tower) or an image that cannot be read."""
        vision = read_images(self.vision_tower(), messages)
        return self.tokenizer.encode_chat(messages, tools, template_kwargs), vision  # each marker expanded

    def vision_tower(self) -> Tower:
        """The checkpoint's vision tower, loaded at the first image (PromptRejected where images are not read)."""
        if self.kind == "tensor" and self.world_size > 1:
            raise PromptRejected("images are not served on a Tensor split: place the model as Pipeline or alone")
        if self._tower is None:
            tower = load_tower(self._model_dir, self._tower_dtype, self.device)
            if tower is None:
                raise PromptRejected("this model takes text only: images cannot be read")
            self._tower = tower
        return self._tower

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = "",
        vision: VisionInput | None = None,
    ) -> None:
        """Rank 0 queues the request for the next header; on other ranks this is a no-op. vision: its images'
        embeddings (encode_images), one per placeholder token of the prompt."""
        if not self.is_scheduler:
            return
        check_prompt(prompt_ids, self.context_length)
        self.admission.add(request_id, prompt_ids, sampling, command_id, vision, self.fault_hook)

    def cancel(self, request_id: str) -> None:
        """Rank 0 releases the request in the next header (every rank then frees it); elsewhere a no-op."""
        if self.is_scheduler:
            self.inbox.cancel(request_id)

    def has_work(self) -> bool:
        """Rank 0: something to compute or announce, or (in a group) a heartbeat is due. Others: always, until
        shutdown, because they must be inside step() whenever rank 0 sends."""
        if not self.is_scheduler:
            return not self.closed
        if self._pending or self._running or self.inbox.adds or self.inbox.releases:
            return True
        return self.world_size > 1 and time.monotonic() - self.admission.last_header >= GROUP_STEP_HEARTBEAT_S

    def step(self) -> list[TokenOut]:
        """One header and exactly the work it names (module docstring); rank 0 times it for chunk sizing and, in a
        Pipeline, for the group's pace."""
        if self._agree:
            self._agree_pool()
        with torch.inference_mode():
            header = self.admission.lead() if self.is_scheduler else self.admission.follow()
            started, waited = time.perf_counter(), self.link.wait_s
            if header.kind in (StepKind.HEARTBEAT, StepKind.SHUTDOWN):
                if header.kind == StepKind.SHUTDOWN:
                    self.closed = True
                self.journal.enter("idle", "heartbeat")
                return []
            outs = self.stepper.run(header)
            if self.is_scheduler:
                seconds = time.perf_counter() - started
                self.times.measure(header.kind, seconds, self.stepper.chunk_done)
                self.flights.pace_part(header.kind, seconds - (self.link.wait_s - waited), header.rows)
            return outs

    def _agree_pool(self) -> None:
        """Every rank's allocator must make the same choices, so a group takes its smallest pool. Done at the
        first step, which every rank enters together (a collective while the ranks still load could outlast the
        group timeout), before any block is used; the cache's pages were never touched, so remaking it is free."""
        self._agree = False
        control = self.link.control_group if isinstance(self.link, GroupLink) else None
        local = self.local_blocks.num_blocks if self.local_blocks is not None else 0
        agreed = torch.tensor([self.blocks.num_blocks, local], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
        blocks, local_blocks = (int(n) for n in agreed.tolist())
        if (blocks, local_blocks) != (self.blocks.num_blocks, local):  # a hybrid model's groups agree each
            self.blocks = BlockAllocator(blocks, self.block_size)
            self.local_blocks = BlockAllocator(local_blocks, self.block_size) if local_blocks else None
            self.executor.resize(blocks, local_blocks or None)

    def warmup(self) -> None:
        """Rank 0 generates two tokens of a throwaway request and every rank steps until the header releases
        it, so each rank has run its layers and a group's connections are exercised."""
        self.admission.warming = True
        if self.is_scheduler:
            prompt = self.tokenizer.encode("warmup") or [0]
            self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self.admission.warming:
            self.step()
        self.journal.events.clear()

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
        return len(self._pending) + len(self.inbox.adds)

    def kv_usage(self) -> dict[str, int]:
        """The block pool at a glance: blocks in all, held by requests, cached prefixes, their size and bits, and
        the speculative draft tokens proposed and accepted so far (GET /metrics reads the latest record)."""
        usage = {"kv_blocks": self.blocks.num_blocks, "kv_blocks_held": self.blocks.held,
                 "kv_blocks_cached": self.blocks.cached, "kv_block_size": self.block_size, "kv_bits": self.kv_bits,
                 "running": len(self._running), "queued": self.queued, "preemptions": self.preemptions,
                 "spec_drafted": self.journal.spec_drafted, "spec_accepted": self.journal.spec_accepted}
        if self.local_blocks is not None:  # a hybrid model's sliding layers' pool (kv_pools.py)
            usage |= {"kv_local_blocks": self.local_blocks.num_blocks, "kv_local_blocks_held": self.local_blocks.held,
                      "kv_local_blocks_cached": self.local_blocks.cached, "kv_local_window": self.local_window}
        return usage

    def take_events(self) -> list[RequestEvent]:
        """Requests admitted and released by the headers since the last call (cheap when nothing happened)."""
        return self.journal.take()

    def close(self) -> None:
        """Rank 0 tells everyone to leave (with any last releases); a dead peer no longer matters here."""
        if self.is_scheduler and not self.closed:
            self.closed = True
            try:
                if self._agree:  # the others wait for the agreement before any header
                    self._agree_pool()
                self.flights.drain()  # the sampler's sends of the steps in flight complete into rank 0's receives
                self.link.send_header(Header(StepKind.SHUTDOWN, (), tuple(self.inbox.releases)))
                self.link.flush()
            except RuntimeError:
                pass
        self.closed = True

    # --- the parts' state, under the names the runner, tests and benchmarks read and set ---------------------

    @property
    def model(self) -> Any:
        """This rank's model slice (a ModelSlice; a mixed group's MLX rank's own stage): the executor's."""
        return self.executor.model

    @model.setter
    def model(self, value: Any) -> None:
        self.executor.model = value

    @property
    def cache(self) -> Any:
        """The KV cache over the block pools (the executor's)."""
        return self.executor.cache

    @property
    def link(self) -> Link:
        return self.executor.link

    @property
    def drafter(self) -> Drafter | None:
        return self.executor.drafter

    @property
    def needs_ids(self) -> bool:
        """Whether this rank embeds token ids (rank 0, or every rank of a Tensor split)."""
        return self.executor.needs_ids

    @property
    def blocks(self) -> BlockAllocator:
        """The full group's block allocator (the scheduler's)."""
        return self.scheduler.blocks

    @blocks.setter
    def blocks(self, value: BlockAllocator) -> None:
        self.scheduler.blocks = value

    @property
    def local_blocks(self) -> BlockAllocator | None:
        """A hybrid model's sliding group's block allocator (None: a model of one group)."""
        return self.scheduler.local_blocks

    @local_blocks.setter
    def local_blocks(self, value: BlockAllocator | None) -> None:
        self.scheduler.local_blocks = value

    @property
    def _pending(self) -> deque[Request]:
        """The queue (the scheduler's)."""
        return self.scheduler.pending

    @property
    def _running(self) -> list[Request]:
        """The running rows, index == batch row, identical on every rank (the scheduler's)."""
        return self.scheduler.running

    @property
    def _adds(self) -> list[NewRequest]:
        """Rank 0: requests added for the next header (the inbox's)."""
        return self.inbox.adds

    @property
    def preemptions(self) -> int:
        """Requests preempted (and later resumed) since start."""
        return self.scheduler.preemptions

    @property
    def share_prefixes(self) -> bool:
        """Rank 0 keys full blocks by their tokens so a later prompt shares them; off in a mixed instance (an MLX
        rank keeps per-request caches, engines/mlx/mixed.py). The scheduler's, set before the first request."""
        return self.scheduler.share_prefixes

    @share_prefixes.setter
    def share_prefixes(self, value: bool) -> None:
        self.scheduler.share_prefixes = value

    @property
    def micro_batches(self) -> bool | None:
        """Rank 0 of a Pipeline leads micro-batches: always (True), never (False), where they pay (None)."""
        return self.flights.micro_batches

    @micro_batches.setter
    def micro_batches(self, value: bool | None) -> None:
        self.flights.micro_batches = value

    @property
    def pace(self) -> Pace:
        return self.flights.pace

    @pace.setter
    def pace(self, value: Pace) -> None:
        self.flights.pace = value

    @property
    def micro(self) -> int:
        """Micro-batches rank 0 keeps in flight now."""
        return self.flights.micro

    @property
    def overlapped(self) -> int:
        """Steps rank 0 led while an earlier one was still in flight."""
        return self.flights.overlapped

    @property
    def fault_hook(self) -> FaultHook | None:
        """A test's or the runner's faults at admission and sampling (requests.FaultHook); the stepper's."""
        return self.stepper.fault_hook

    @fault_hook.setter
    def fault_hook(self, value: FaultHook | None) -> None:
        self.stepper.fault_hook = value

    @property
    def on_phase(self) -> PhaseHook | None:
        """Told each runner phase the steps enter (the journal's)."""
        return self.journal.on_phase

    @on_phase.setter
    def on_phase(self, value: PhaseHook | None) -> None:
        self.journal.on_phase = value

    @property
    def spec_drafted(self) -> int:
        return self.journal.spec_drafted

    @property
    def spec_accepted(self) -> int:
        return self.journal.spec_accepted

    @property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars (admission's, built on first use)."""
        return self.admission.grammars

    def footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes resident from allocation) this rank holds (Executor.footprint). The runner's
        resident memory less these is its runtime overhead, which the node reports and placement counts
        (types/node_info.RunnerOverhead)."""
        return self.executor.footprint()
