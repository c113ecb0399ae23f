"""A TorchEngine's parts, built in one step (build_parts) from the engine's options (options.py): an Executor (the
model shard, its KV tensors, the link to the other ranks, a draft model) and a Scheduler (the queue, the running
rows and the block tables), with the facts both were sized by (Parts).

The engine (engine.py) composes these with the parts that work over them, each a class of its own that holds
references to what it uses, never a base class of another: admission.Admission (rank 0's headers and every rank's
application of them, from an admission.Inbox), step.Stepper (the forward pass of each step kind),
local_step.Speculator (a single rank's speculative decode steps), flight.Flights (rank 0's steps in flight through a
Pipeline, with the group's measured pace), timing.StepTimes (the step times that size a prefill chunk) and
journal.Journal (what the runner is told: request events, phases, speculative counts).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skulk.engines.kv_pools import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_FRACTION,
    DEFAULT_PREFILL_CHUNK,
    group_pool_bytes,
    group_pools,
    hybrid_window,
)

from .blocks import BlockAllocator
from .device import available_bytes
from .drafter import Drafter
from .executor import Executor, make_cache
from .journal import PhaseHook
from .links import GroupLink, Link, LocalLink, tensor_all_reduce
from .loader import load_model
from .model import ModelSlice
from .models.family import forget_stream
from .options import (
    DEFAULT_MAX_BATCH,
    KV_BITS_ENV,
    OFF,
    SPECULATE_ENV,
    Pool,
    Shard,
    Weights,
    kv_bits_or_default,
)
from .requests import Request
from .schedule import pool_blocks
from .scheduler import Scheduler

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_BATCH", "DEFAULT_PREFILL_CHUNK", "KV_BITS_ENV", "OFF", "SPECULATE_ENV",
           "ExecutorFactory", "Parts", "PhaseHook", "build_parts", "kv_bits_or_default"]

WARMUP_ID = "__skulk_warmup__"
"""The throwaway request of TorchEngine.warmup: never reported to the runner."""
Loader = Callable[..., Any]
"""Loads this rank's model slice (loader.load_model's keywords); a mixed group's MLX rank loads its own."""
ExecutorFactory = Callable[..., Executor]
"""Builds the Executor over what build_parts made (Executor's own arguments); a mixed group's MLX rank computes
with its own (engines/mlx/mixed.py)."""


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
                executor: ExecutorFactory = Executor, share_prefixes: bool = True) -> Parts:
    """This rank's model slice loaded, its block pools sized (schedule.pool_blocks, or a hybrid model's two,
    kv_pools.group_pools), the Scheduler over them, the KV tensors, a draft model and the link to the others.
    share_prefixes: rank 0 keys full blocks by their tokens so a later prompt shares them; off in a mixed instance
    (an MLX rank keeps per-request caches, engines/mlx/mixed.py)."""
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
    # a family with per-stream state (models/family.py) shares no prefixes and does not speculate, and forgets a
    # stream's state when its table goes back
    stateful = getattr(getattr(model, "family", None), "stateful", False)
    scheduler: Scheduler[Request] = Scheduler(
        BlockAllocator(num_blocks, pool.block_size),
        BlockAllocator(local_blocks, pool.block_size) if local_blocks else None,
        max_batch=pool.max_batch, prefill_chunk=pool.prefill_chunk, window=window, local_window=local_window,
        leads=shard.is_scheduler, share_prefixes=share_prefixes and not stateful,
        on_free=functools.partial(forget_stream, model) if stateful else None)
    speculate = (weights.speculate and shard.world_size == 1 and not stateful
                 and os.environ.get(SPECULATE_ENV, "1") not in OFF)
    cache = make_cache(model, num_blocks, pool.block_size, local_blocks or None, kv_bits)
    drafter = None
    if weights.draft_dir is not None and speculate and not window:
        drafter = Drafter.load(weights.draft_dir, model, num_blocks, pool.block_size, pool.prefill_chunk,
                               dtype=weights.dtype, device=device, quantize=weights.draft_quantize or weights.quantize)
    link: Link = LocalLink() if shard.world_size == 1 else GroupLink(shard.rank, shard.world_size, shard.kind,
                                                                      shard.control_group)
    computes = executor(shard, model, cache, link, drafter, device=device, block_size=pool.block_size,
                        kv_bits=kv_bits)
    return Parts(computes, scheduler, context, kv_bits, window, local_window, speculate)


def pool_sizes(model: Any, pool: Pool, context: int, local_window: int, kv_bits: int,
               device: torch.device) -> tuple[int, int]:
    """(blocks, local blocks): the block pool's size (schedule.pool_blocks), or a hybrid model's two pools'
    (kv_pools.group_pools: its budget split by each group's real bytes a position on this rank; 0 local blocks
    for a model of one group). An MLX stage of a mixed group counts its own bytes, at 16 bits. Without a set
    budget, a share of what `device` has free (device.available_bytes: the RAM's, or a GPU's). A family whose
    layers keep per-stream states (Qwen3-Next) holds max_batch streams of them beside the blocks: they come out of
    the budget first, as placement counts them in it (shard_plan.pool_bytes)."""
    size, streams, kv_bytes = pool.block_size, pool.max_batch, pool.kv_cache_bytes
    states = streams * int(model.state_bytes_per_stream()) if isinstance(model, ModelSlice) else 0
    if kv_bytes is not None:
        kv_bytes = max(0, kv_bytes - states)
    if not local_window:
        per_token = model.kv_bytes_per_token() if kv_bits == 16 else model.kv_bytes_per_token(bits=kv_bits)
        return pool_blocks(kv_bytes, per_token, size, context, streams,
                           None if kv_bytes is not None else max(0, available_bytes(device) - states)), 0
    group_per_token = model.group_bytes_per_token(bits=kv_bits)
    if kv_bytes is None:
        ceiling = group_pool_bytes(group_per_token, size, context, streams, local_window, pool.prefill_chunk)
        kv_bytes = min(int(max(0, available_bytes(device) - states) * DEFAULT_KV_FRACTION), ceiling)
    return group_pools(kv_bytes, group_per_token, size, context, streams, local_window, pool.prefill_chunk)
