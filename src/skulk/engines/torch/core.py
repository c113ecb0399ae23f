"""The state every part of TorchEngine shares, and its construction: the model shard, the block pool and its
allocator, the link to the other ranks, the queue and the running rows.

TorchEngine is a stack of classes, each adding one concern on top of the ones below it (dependencies point down):
core.EngineCore (state) <- admission.Admission (headers, admission, preemption, blocks) <- step.Step (the forward
pass of a step on every rank, and sharing its tokens) <- local_step.LocalStep (single-rank speculative steps) <-
engine.TorchEngine (the Engine protocol). They are split for size only; an engine is always the whole stack.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from skulk.types.runners import RunnerPhase

from .blocks import BlockAllocator
from .drafter import Drafter
from .links import GroupLink, Link, LocalLink, ShardKind, tensor_all_reduce
from .loader import load_model
from .model import ModelSlice
from .requests import FaultHook, Request
from .schedule import pool_blocks
from .tokenizer import ChatTokenizer
from .wire import NewRequest, Release, RequestEvent

DEFAULT_MAX_BATCH = 64  # concurrent streams per instance (the pool may hold fewer: the rest queue)
DEFAULT_BLOCK_SIZE = 32
NO_BLOCK = -1  # a table entry whose block went back (behind a sliding window): never read unmasked
DEFAULT_PREFILL_CHUNK = 512
WARMUP_ID = "__skulk_warmup__"
PhaseHook = Callable[[RunnerPhase, str], None]
SPECULATE_ENV = "SKULK_SPECULATE"
"""0/off: no speculative decoding on a single rank either. For benchmarks: bench/split.py compares one rank with a
split like for like (a split never speculates)."""
OFF = ("0", "off", "false", "no")


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
        block_size: int = DEFAULT_BLOCK_SIZE,
        speculate: bool = True,
        draft_dir: Path | None = None,
        draft_quantize: str | None = None,
    ) -> None:
        """max_seq: an optional cap on the context below the model's max_position_embeddings (a placement's
        max_context). kv_cache_bytes: the block pool's size on this rank (None: schedule.pool_blocks' default
        share of free memory); it always holds at least one request of the whole context. speculate: prompt-lookup
        drafting (speculate.py) on a single rank. draft_dir: a draft model of the target's
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
        per_token = self.model.kv_bytes_per_token()
        num_blocks = pool_blocks(kv_cache_bytes, per_token, block_size, self.context_length, max_batch)
        self._agree = world_size > 1  # a group agrees on one pool size at its first step (_agree_pool)
        self.blocks = BlockAllocator(num_blocks, block_size)
        args = self.model.args
        every_layer_slides = all(args.is_sliding(i) for i in range(args.num_hidden_layers))
        self.window = (args.sliding_window or 0) if every_layer_slides else 0  # blocks behind it are freed
        self.speculate = speculate and world_size == 1 and os.environ.get(SPECULATE_ENV, "1") not in OFF
        self.cache = self.model.make_cache(num_blocks, block_size)
        self.drafter: Drafter | None = None
        if draft_dir is not None and self.speculate and not self.window:
            self.drafter = Drafter.load(draft_dir, self.model, num_blocks, block_size, prefill_chunk, dtype=dtype,
                                        device=self.device, quantize=draft_quantize or quantize)
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
        self._step_rows: tuple[int, int] | None = None  # the running rows this step decodes (None: all)
        self._unseeded = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))

    def _load_model(self, model_dir: Path, **kwargs: Any) -> ModelSlice:
        """This rank's slice (loader.load_model); a rank of another engine in a torch group computes with its own."""
        return load_model(model_dir, **kwargs)
