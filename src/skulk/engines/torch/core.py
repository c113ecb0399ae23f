"""The state every part of TorchEngine shares, and its construction: the model shard, the block pool and its
allocator, the link to the other ranks, the queue and the running rows.

TorchEngine is a stack of classes, each adding one concern on top of the ones below it (dependencies point down):
core.EngineCore (state) <- flight.Flight (a Pipeline's steps in flight) <- admission.Admission (sending and
applying headers) <- step.Step (the forward pass of a step on every rank, and sharing its tokens) <-
local_step.LocalStep (single-rank speculative steps) <- engine.TorchEngine (the Engine protocol). They are split for
size only; an engine is always the whole stack. The request bookkeeping (queue, running rows, block tables, prefix
sharing, preemption) is a torch-free scheduler.Scheduler the core holds; `_pending`, `_running`, `blocks`,
`local_blocks` and `preemptions` read it.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from skulk.engines.kv_pools import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_FRACTION,
    DEFAULT_PREFILL_CHUNK,
    KV_BITS,
    group_pool_bytes,
    group_pools,
    hybrid_window,
)
from skulk.types.runners import RunnerPhase

from .blocks import BlockAllocator
from .cache import KVCache
from .device import available_bytes
from .drafter import Drafter
from .links import GroupLink, Link, LocalLink, ShardKind, tensor_all_reduce
from .loader import load_model
from .model import ModelSlice
from .pace import module_bytes
from .requests import FaultHook, Request
from .schedule import pool_blocks
from .scheduler import Scheduler
from .tokenizer import ChatTokenizer
from .vision import Tower, VisionInput
from .wire import NewRequest, Release, RequestEvent

DEFAULT_MAX_BATCH = 64  # concurrent streams per instance (the pool may hold fewer: the rest queue)
WARMUP_ID = "__skulk_warmup__"
PhaseHook = Callable[[RunnerPhase, str], None]
SPECULATE_ENV = "SKULK_SPECULATE"
"""0/off: no speculative decoding on a single rank either. For benchmarks: bench/split.py compares one rank with a
split like for like (a split never speculates)."""
OFF = ("0", "off", "false", "no")


KV_BITS_ENV = "SKULK_KV_CACHE_BITS"
"""The node's default KV cache bits for an engine whose placement sets none (config.Settings.kv_cache_bits)."""


def kv_bits_or_default(bits: int | None) -> int:
    """bits, else SKULK_KV_CACHE_BITS, else 16; ValueError for anything but 16, 8 or 4."""
    value = bits if bits is not None else int(os.environ.get(KV_BITS_ENV) or 16)
    if value not in KV_BITS:
        raise ValueError(f"kv_cache_bits must be one of {KV_BITS}, not {value}")
    return value


class EngineCore:
    """What every layer of TorchEngine reads and changes; one instance per rank."""

    share_prefixes = True
    """Rank 0 keys full blocks by their tokens so a later prompt shares them; off in a mixed instance (an MLX
    rank keeps per-request caches, engines/mlx/mixed.py)."""

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
        kv_cache_bits: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        speculate: bool = True,
        draft_dir: Path | None = None,
        draft_quantize: str | None = None,
    ) -> None:
        """max_seq: an optional cap on the context below the model's max_position_embeddings (a placement's
        max_context). kv_cache_bytes: the block pool's size on this rank (None: schedule.pool_blocks' default
        share of free memory); it always holds at least one request of the whole context. speculate: prompt-lookup
        drafting (speculate.py) on a single rank. kv_cache_bits: 16 (the model's dtype), 8 or 4 (quantized keys
        and values, kv_quant.py; None: SKULK_KV_CACHE_BITS, else 16). draft_dir: a draft model of the target's
        tokenizer (a card's draft model), which drafts instead of prompt lookup (drafter.py);
        draft_quantize: its own at-load quantization (None: the target's)."""
        if max_batch < 1 or prefill_chunk < 1 or block_size < 1:
            raise ValueError("max_batch, prefill_chunk and block_size must be at least 1")
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.device = torch.device(device)
        tensor = kind == "tensor" and world_size > 1
        self.model = self._load_model(
            model_dir, start_layer=0 if tensor else start_layer, end_layer=None if tensor else end_layer,
            tp_rank=rank if tensor else 0, tp_size=world_size if tensor else 1,
            all_reduce=tensor_all_reduce(world_size) if tensor else None, dtype=dtype, device=self.device,
            quantize=quantize,
        )
        positions = self.model.args.max_position_embeddings
        self.context_length = min(positions, max_seq) if max_seq is not None else positions
        self.max_batch, self.prefill_chunk, self.block_size = max_batch, prefill_chunk, block_size
        self.kv_bits = kv_bits_or_default(kv_cache_bits)
        if self.kv_bits != 16 and not isinstance(self.model, ModelSlice):
            raise ValueError(f"kv_cache_bits {self.kv_bits}: this rank's engine keeps its KV cache in 16 bits")
        args = self.model.args
        sliding = [args.is_sliding(i) for i in range(args.num_hidden_layers)]
        self.local_window = hybrid_window(args.sliding_window, sliding)  # a hybrid model's sliding group; 0: none
        num_blocks, local_blocks = self._pool_sizes(kv_cache_bytes)
        self._agree = world_size > 1  # a group agrees on one pool size at its first step (_agree_pool)
        every_layer_slides = all(sliding)
        self.window = (args.sliding_window or 0) if every_layer_slides else 0  # blocks behind it are freed
        self.is_scheduler, self.is_sampler = rank == 0, rank == world_size - 1
        self.scheduler: Scheduler[Request] = Scheduler(
            BlockAllocator(num_blocks, block_size), BlockAllocator(local_blocks, block_size) if local_blocks else None,
            max_batch=max_batch, prefill_chunk=prefill_chunk, window=self.window, local_window=self.local_window,
            leads=self.is_scheduler, share_prefixes=self.share_prefixes)
        self.speculate = speculate and world_size == 1 and os.environ.get(SPECULATE_ENV, "1") not in OFF
        self.cache = self._make_cache()
        self.drafter: Drafter | None = None
        if draft_dir is not None and self.speculate and not self.window:
            self.drafter = Drafter.load(draft_dir, self.model, num_blocks, block_size, prefill_chunk, dtype=dtype,
                                        device=self.device, quantize=draft_quantize or quantize)
        self.tokenizer = ChatTokenizer(model_dir)
        # rank 0 runs a vision-language model's tower (vision.py); loaded on first use: a text request never pays
        self._model_dir, self._tower_dtype = model_dir, self.model.args.dtype
        self._tower: Tower | None = None
        self._visions: dict[str, VisionInput] = {}  # rank 0: added requests' image embeddings, until released
        self.needs_ids = tensor or rank == 0  # who embeds token ids
        self.link: Link = LocalLink() if world_size == 1 else GroupLink(rank, world_size, kind, control_group)
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

    def _pool_sizes(self, kv_bytes: int | None) -> tuple[int, int]:
        """(blocks, local blocks): the block pool's size (schedule.pool_blocks), or a hybrid model's two pools'
        (kv_pools.group_pools: its budget split by each group's real bytes a position on this rank; 0 local blocks
        for a model of one group)."""
        size, context, streams = self.block_size, self.context_length, self.max_batch
        if not self.local_window:
            return pool_blocks(kv_bytes, self._per_token(), size, context, streams,
                               None if kv_bytes is not None else available_bytes(self.device)), 0
        per_token = self.model.group_bytes_per_token(bits=self.kv_bits)
        if kv_bytes is None:
            ceiling = group_pool_bytes(per_token, size, context, streams, self.local_window, self.prefill_chunk)
            kv_bytes = min(int(available_bytes(self.device) * DEFAULT_KV_FRACTION), ceiling)
        return group_pools(kv_bytes, per_token, size, context, streams, self.local_window, self.prefill_chunk)

    def _per_token(self) -> int:
        """KV bytes a position costs on this rank (an MLX stage of a mixed group counts its own, at 16 bits)."""
        if self.kv_bits == 16:
            return self.model.kv_bytes_per_token()
        return self.model.kv_bytes_per_token(bits=self.kv_bits)

    def _make_cache(self) -> Any:
        """The KV cache for the allocators' pools (a hybrid model's sliding layers in their own), at kv_bits."""
        local = None if self.local_blocks is None else self.local_blocks.num_blocks
        if self.kv_bits == 16 and local is None:  # an MLX stage of a mixed group takes neither
            return self.model.make_cache(self.blocks.num_blocks, self.block_size)
        return self.model.make_cache(self.blocks.num_blocks, self.block_size, local_blocks=local, bits=self.kv_bits)

    def _load_model(self, model_dir: Path, **kwargs: Any) -> ModelSlice:
        """This rank's slice (loader.load_model); a rank of another engine in a torch group computes with its own."""
        return load_model(model_dir, **kwargs)

    def footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes resident from allocation) this rank holds: its slice's tensors and a draft
        model's, each storage once (fused projections are views of one buffer), and the KV pools it zeroed when it
        allocated them (cache.ZEROED_BELOW). The runner's resident memory less these is its runtime overhead, which
        the node reports and placement counts (types/node_info.RunnerOverhead)."""
        models = [m for m in (self.model, self.drafter.model if self.drafter else None) if isinstance(m, nn.Module)]
        caches = [c for c in (self.cache, self.drafter.cache if self.drafter else None) if isinstance(c, KVCache)]
        return sum(module_bytes(m) for m in models), sum(c.zeroed_nbytes for c in caches)
