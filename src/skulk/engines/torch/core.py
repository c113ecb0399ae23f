"""The state every part of TorchEngine shares, and its construction in one step from its parts: an Executor (the
model shard, its KV tensors, the link to the other ranks, a draft model) and a Scheduler (the queue, the running
rows and the block tables), built by build_parts from the engine's options (options.py).

TorchEngine holds three parts: the Executor (executor.py: `model`, `cache`, `link` and `drafter` read it), the
torch-free Scheduler, which owns the request bookkeeping (queue, running rows, block tables, prefix sharing,
preemption: `_pending`, `_running`, `blocks`, `local_blocks` and `preemptions` read it), and rank 0's steps in
flight through a Pipeline (flight.Flights, with the group's measured pace). Over them the engine is still a stack
of classes split for size, each adding one concern (dependencies point down): core.EngineCore (state) <-
admission.Admission (sending and applying headers) <- step.Step (the forward pass of a step on every rank, and
sharing its tokens) <- local_step.LocalStep (single-rank speculative steps) <- engine.TorchEngine (the Engine
protocol); an engine is always the whole stack.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch

from skulk.engines.kv_pools import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_FRACTION,
    DEFAULT_PREFILL_CHUNK,
    group_pool_bytes,
    group_pools,
    hybrid_window,
)
from skulk.types.runners import RunnerPhase

from .blocks import BlockAllocator
from .device import available_bytes
from .drafter import Drafter
from .executor import Executor, make_cache
from .flight import Flights
from .links import GroupLink, Link, LocalLink, TokenRows, tensor_all_reduce
from .loader import load_model
from .model import ModelSlice
from .models.family import forget_stream
from .options import (
    DEFAULT_MAX_BATCH,
    KV_BITS_ENV,
    OFF,
    SPECULATE_ENV,
    EngineKeywords,
    Pool,
    Shard,
    Weights,
    kv_bits_or_default,
    split_keywords,
)
from .pace import Pace, head_in_layers
from .requests import FaultHook, Request
from .schedule import pool_blocks
from .scheduler import Scheduler
from .tokenizer import ChatTokenizer
from .vision import Tower, VisionInput
from .wire import NewRequest, Release, RequestEvent

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_BATCH", "DEFAULT_PREFILL_CHUNK", "KV_BITS_ENV", "OFF", "SPECULATE_ENV",
           "EngineCore", "Parts", "PhaseHook", "build_parts", "kv_bits_or_default"]

WARMUP_ID = "__skulk_warmup__"
PhaseHook = Callable[[RunnerPhase, str], None]
Loader = Callable[..., Any]
"""Loads this rank's model slice (loader.load_model's keywords); a mixed group's MLX rank loads its own."""


@dataclass(frozen=True)
class Parts:
    """An engine's parts, built together (build_parts): what computes, what schedules, and the facts both were
    sized by."""

    executor: Executor
    scheduler: Scheduler[Request]
    context_length: int
    kv_bits: int
    window: int
    """Every layer slides: blocks behind this window are freed (0: none)."""
    local_window: int
    """A hybrid model's sliding group's window (0: none)."""
    speculate: bool


def build_parts(model_dir: Path, shard: Shard, pool: Pool, weights: Weights, *, load: Loader = load_model,
                share_prefixes: bool = True) -> Parts:
    """This rank's model slice loaded, its block pools sized (schedule.pool_blocks, or a hybrid model's two,
    kv_pools.group_pools), the Scheduler over them, the KV tensors, a draft model and the link to the others."""
    device, tensor = torch.device(weights.device), shard.tensor
    model = load(model_dir, start_layer=0 if tensor else shard.start_layer,
                 end_layer=None if tensor else shard.end_layer, tp_rank=shard.rank if tensor else 0,
                 tp_size=shard.world_size if tensor else 1,
                 all_reduce=tensor_all_reduce(shard.world_size) if tensor else None, dtype=weights.dtype,
                 device=device, quantize=weights.quantize)
    args = model.args
    positions = args.max_position_embeddings
    context = min(positions, pool.max_seq) if pool.max_seq is not None else positions
    kv_bits = kv_bits_or_default(pool.kv_cache_bits)
    if kv_bits != 16 and not isinstance(model, ModelSlice):
        raise ValueError(f"kv_cache_bits {kv_bits}: this rank's engine keeps its KV cache in 16 bits")
    sliding = [args.is_sliding(i) for i in range(args.num_hidden_layers)]
    local_window = hybrid_window(args.sliding_window, sliding)
    num_blocks, local_blocks = pool_sizes(model, pool, context, local_window, kv_bits, device)
    window = (args.sliding_window or 0) if all(sliding) else 0
    scheduler: Scheduler[Request] = Scheduler(
        BlockAllocator(num_blocks, pool.block_size),
        BlockAllocator(local_blocks, pool.block_size) if local_blocks else None,
        max_batch=pool.max_batch, prefill_chunk=pool.prefill_chunk, window=window, local_window=local_window,
        leads=shard.is_scheduler, share_prefixes=share_prefixes)
    speculate = weights.speculate and shard.world_size == 1 and os.environ.get(SPECULATE_ENV, "1") not in OFF
    cache = make_cache(model, num_blocks, pool.block_size, local_blocks or None, kv_bits)
    drafter = None
    if weights.draft_dir is not None and speculate and not window:
        drafter = Drafter.load(weights.draft_dir, model, num_blocks, pool.block_size, pool.prefill_chunk,
                               dtype=weights.dtype, device=device, quantize=weights.draft_quantize or weights.quantize)
    link: Link = LocalLink() if shard.world_size == 1 else GroupLink(shard.rank, shard.world_size, shard.kind,
                                                                      shard.control_group)
    executor = Executor(shard, model, cache, link, drafter, device=device, block_size=pool.block_size,
                        kv_bits=kv_bits)
    return Parts(executor, scheduler, context, kv_bits, window, local_window, speculate)


def pool_sizes(model: Any, pool: Pool, context: int, local_window: int, kv_bits: int,
               device: torch.device) -> tuple[int, int]:
    """(blocks, local blocks): the block pool's size (schedule.pool_blocks), or a hybrid model's two pools'
    (kv_pools.group_pools: its budget split by each group's real bytes a position on this rank; 0 local blocks
    for a model of one group). An MLX stage of a mixed group counts its own bytes, at 16 bits. Without a set
    budget, a share of what `device` has free (device.available_bytes: the RAM's, or a GPU's)."""
    size, streams, kv_bytes = pool.block_size, pool.max_batch, pool.kv_cache_bytes
    if not local_window:
        per_token = model.kv_bytes_per_token() if kv_bits == 16 else model.kv_bytes_per_token(bits=kv_bits)
        return pool_blocks(kv_bytes, per_token, size, context, streams,
                           None if kv_bytes is not None else available_bytes(device)), 0
    group_per_token = model.group_bytes_per_token(bits=kv_bits)
    if kv_bytes is None:
        ceiling = group_pool_bytes(group_per_token, size, context, streams, local_window, pool.prefill_chunk)
        kv_bytes = min(int(available_bytes(device) * DEFAULT_KV_FRACTION), ceiling)
    return group_pools(kv_bytes, group_per_token, size, context, streams, local_window, pool.prefill_chunk)


class EngineCore:
    """What every layer of TorchEngine reads and changes; one instance per rank."""

    share_prefixes = True
    """Rank 0 keys full blocks by their tokens so a later prompt shares them; off in a mixed instance (an MLX
    rank keeps per-request caches, engines/mlx/mixed.py)."""

    def __init__(self, model_dir: Path, **keywords: Unpack[EngineKeywords]) -> None:
        """keywords: options.Shard's, Pool's and Weights' fields (their docstrings say what each means)."""
        self.shard, pool, weights = split_keywords(keywords)
        parts = build_parts(model_dir, self.shard, pool, weights, load=self._load_model,
                            share_prefixes=self.share_prefixes)
        self.executor, self.scheduler = parts.executor, parts.scheduler
        self.rank, self.world_size, self.kind = self.shard.rank, self.shard.world_size, self.shard.kind
        self.is_scheduler, self.is_sampler = self.shard.is_scheduler, self.shard.is_sampler
        self.device = self.executor.device
        self.context_length, self.kv_bits, self.speculate = parts.context_length, parts.kv_bits, parts.speculate
        if getattr(getattr(self.model, "family", None), "stateful", False):  # per-stream state: models/family.py
            self.share_prefixes = self.speculate = False
            self.scheduler.on_free = functools.partial(forget_stream, self.model)
        self.window, self.local_window = parts.window, parts.local_window
        self.max_batch, self.prefill_chunk, self.block_size = pool.max_batch, pool.prefill_chunk, pool.block_size
        self._agree = self.world_size > 1  # a group agrees on one pool size at its first step (_agree_pool)
        self.tokenizer = ChatTokenizer(model_dir)
        # rank 0 runs a vision-language model's tower (vision.py); loaded on first use: a text request never pays
        self._model_dir, self._tower_dtype = model_dir, self.model.args.dtype
        self._tower: Tower | None = None
        self._visions: dict[str, VisionInput] = {}  # rank 0: added requests' image embeddings, until released
        self.on_phase: PhaseHook | None = None
        self.closed = False
        self.fault_hook: FaultHook | None = None
        self._adds: list[NewRequest] = []  # rank 0: for the next header
        self._releases: list[Release] = []  # rank 0: for the next header
        # speculative draft tokens proposed and accepted over the engine's life, added once per request at its
        # release (never per token); kv_usage reports them, so GET /metrics reads them from the flight recorder
        self.spec_drafted = 0
        self.spec_accepted = 0
        self._events: list[RequestEvent] = []
        self._phase: RunnerPhase = "idle"
        self._last_header = 0.0
        self._decode_s = 0.0  # rank 0: running average of a decode step
        self._last_chunk: tuple[int, float] | None = None  # rank 0: (tokens, seconds) of the last prefill chunk
        self._warming = False
        self._chunk_done = 0  # prompt tokens the last prefill step computed
        self._step_rows: tuple[int, int] | None = None  # the running rows this step decodes (None: all)
        self._unseeded = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))
        total = self.model.args.num_hidden_layers
        own = (total if self.shard.end_layer is None else self.shard.end_layer) - self.shard.start_layer
        head = head_in_layers(self.model) if self.is_scheduler else 0
        # rank 0: a Pipeline's steps in flight, and its own part and the tokens' trip, by rows (flight.py)
        self.flights = Flights(self.shard, Pace(self.world_size, own, total, head), lambda: self.scheduler.running,
                               self._land)

    # The executor's parts, under the names the rest of the stack reads them by.

    @property
    def model(self) -> Any:
        """This rank's model slice (a ModelSlice; a mixed group's MLX rank's own stage)."""
        return self.executor.model

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

    # A Pipeline's steps in flight (Flights), under the names tests and benchmarks set and read.

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

    def _land(self, reqs: Sequence[Request | None], rows: TokenRows) -> None:
        """Record [token, finished, failed] per row on a rank that embeds the next input. A row that failed on the
        sampler is finished too: rank 0 releases it in the next header, so every rank frees its slot, while its
        batch-mates go on."""
        for req, (token, finished, failed) in zip(reqs, rows, strict=True):
            if req is None:
                continue
            req.last_token = token
            if not failed:
                req.emitted.append(token)
            if self.is_scheduler and finished:
                req.finished = True
                self._releases.append(Release(req.request_id, cancelled=False, failed=bool(failed)))

    # The scheduler's state, under the names the rest of the stack reads it by.

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
        return self.scheduler.pending

    @property
    def _running(self) -> list[Request]:
        """Index == batch row, identical on every rank."""
        return self.scheduler.running

    @property
    def preemptions(self) -> int:
        """Requests preempted (and later resumed) since start."""
        return self.scheduler.preemptions

    def _load_model(self, model_dir: Path, **kwargs: Any) -> ModelSlice:
        """This rank's slice (loader.load_model); a rank of another engine in a torch group computes with its own."""
        return load_model(model_dir, **kwargs)

    def footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes resident from allocation) this rank holds (Executor.footprint). The runner's
        resident memory less these is its runtime overhead, which the node reports and placement counts
        (types/node_info.RunnerOverhead)."""
        return self.executor.footprint()
