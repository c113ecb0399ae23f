"""What a TorchEngine is built from: three frozen records, each one concern of its construction, read once from
the keywords the engine is constructed with (core.build_parts turns them into its parts in one step).

`Shard` is this rank's place in its group, `Pool` the KV block pool and the batch it serves, `Weights` how the
model (and a draft model) is loaded and where it computes. The engine's keywords stay the flat names every caller
already passes (`TorchEngine(model_dir, max_batch=8, kind="tensor", ...)`); `EngineKeywords` types them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch

from skulk.engines.kv_pools import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_CHUNK, KV_BITS

from .links import ShardKind

DEFAULT_MAX_BATCH = 64  # concurrent streams per instance (the pool may hold fewer: the rest queue)
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


@dataclass(frozen=True)
class Shard:
    """This rank's place in its group: a Pipeline stage owns layers [start_layer, end_layer); a Tensor rank owns
    its shard of every layer. control_group: the torch.distributed group headers travel on (None: the default)."""

    rank: int = 0
    world_size: int = 1
    kind: ShardKind = "pipeline"
    start_layer: int = 0
    end_layer: int | None = None
    control_group: Any = None

    @property
    def tensor(self) -> bool:
        """A real Tensor split: every rank loads every layer's shard and all-reduces."""
        return self.kind == "tensor" and self.world_size > 1

    @property
    def is_scheduler(self) -> bool:
        return self.rank == 0

    @property
    def is_sampler(self) -> bool:
        return self.rank == self.world_size - 1


@dataclass(frozen=True)
class Pool:
    """The KV block pool and the batch it serves. max_seq: an optional cap on the context below the model's
    max_position_embeddings (a placement's max_context). kv_cache_bytes: the pool's size on this rank (None:
    schedule.pool_blocks' default share of free memory); it always holds at least one request of the whole context.
    kv_cache_bits: 16 (the model's dtype), 8 or 4 (quantized keys and values, kv_quant.py; None: SKULK_KV_CACHE_BITS,
    else 16)."""

    max_batch: int = DEFAULT_MAX_BATCH
    max_seq: int | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    kv_cache_bytes: int | None = None
    kv_cache_bits: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1 or self.block_size < 1:
            raise ValueError("max_batch, prefill_chunk and block_size must be at least 1")


@dataclass(frozen=True)
class Weights:
    """How the model is loaded and where it computes. speculate: prompt-lookup drafting (speculate.py) on a single
    rank. draft_dir: a draft model of the target's tokenizer (a card's draft model), which drafts instead of prompt
    lookup (drafter.py); draft_quantize: its own at-load quantization (None: the target's)."""

    dtype: str | torch.dtype | None = None
    device: str | torch.device = "cpu"
    quantize: str | None = None
    speculate: bool = True
    draft_dir: Path | None = None
    draft_quantize: str | None = None


class EngineKeywords(TypedDict, total=False):
    """The keywords a TorchEngine is constructed with: Shard's, Pool's and Weights' fields."""

    rank: int
    world_size: int
    kind: ShardKind
    start_layer: int
    end_layer: int | None
    control_group: Any
    max_batch: int
    max_seq: int | None
    prefill_chunk: int
    kv_cache_bytes: int | None
    kv_cache_bits: int | None
    block_size: int
    dtype: str | torch.dtype | None
    device: str | torch.device
    quantize: str | None
    speculate: bool
    draft_dir: Path | None
    draft_quantize: str | None


def split_keywords(keywords: EngineKeywords) -> tuple[Shard, Pool, Weights]:
    """The three records from an engine's keywords; TypeError for a keyword none of them has."""
    given: dict[str, Any] = dict(keywords)
    records = []
    for record in (Shard, Pool, Weights):
        names = {f.name for f in dataclasses.fields(record)}
        records.append(record(**{k: given.pop(k) for k in list(given) if k in names}))
    if given:
        raise TypeError(f"unexpected engine keyword(s): {', '.join(sorted(given))}")
    shard, pool, weights = records
    assert isinstance(shard, Shard) and isinstance(pool, Pool) and isinstance(weights, Weights)
    return shard, pool, weights
