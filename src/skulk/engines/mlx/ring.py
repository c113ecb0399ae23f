"""An MLX instance over several ranks: mx.distributed's ring backend (TCP), hostfile and ports from placement.

Pipeline: rank r keeps only its layers [start, end) of mlx-lm's model (sliced before the lazily loaded weights
are evaluated, so the others are never read). Its first layer's class is swapped for a subclass that first
receives the hidden state from rank r-1 (`recv_like`), and its last layer's for one that sends the output to
rank r+1 (`send`): the model's own `__call__` (embedding, masks, norm, head) runs unchanged around them, and a
rank that is not last evaluates the inner model only, never the head.

Control: every rank runs the same scheduler over the same requests, so the only inputs rank 0 shares are what
its runner hears (new requests, cancels, shutdown): a `Header` of JSON validated into a fixed pydantic model
(never pickle), one all_sum of its size per step and, only when something changed, one of its bytes. The
sampler (the last rank) shares each sampled row's [token, finished, failed] with one all_sum, so every rank
feeds the same next input and releases the same rows.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skulk.types.chat import SamplingParams

from .rendezvous import RendezvousError, meet

RING_WAIT_S = 300.0
"""How long a rank waits for the slowest of its ring to start (a loaded host imports MLX and torch for minutes)."""
MAX_HEADER_BYTES = 256 * 1024 * 1024  # one step's new prompts; a larger size is a forged header


class RingError(RuntimeError):
    """A header no rank 0 could have sent, or a ring that could not form."""


class NewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str = Field(max_length=256)
    command_id: str = Field(default="", max_length=256)
    prompt: list[int] = Field(min_length=1)
    sampling: SamplingParams


class Header(BaseModel):
    """What rank 0 heard since the last step; every rank applies it before computing."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    adds: list[NewRequest] = []
    cancels: list[str] = []
    shutdown: bool = False

    @property
    def empty(self) -> bool:
        return not (self.adds or self.cancels or self.shutdown)


def connect(rank: int, hosts: Sequence[str], wait_s: float = RING_WAIT_S) -> Any:
    """Form the ring (blocks until every rank is up); MLX reads the hostfile and rank from the environment.
    The ranks first meet with the GIL released (rendezvous.py: MLX's init holds it, starving the runner's
    heartbeat while a slower rank is still starting)."""
    try:
        meet(rank, hosts, wait_s)
    except (OSError, RendezvousError) as exc:
        raise RingError(f"rank {rank} could not meet the other ranks of the MLX ring {list(hosts)}: {exc}") from exc
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[h] for h in hosts], f)
    os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = f.name, str(rank)
    try:
        group = mx.distributed.init(backend="ring", strict=True)
    except RuntimeError as exc:
        raise RingError(f"rank {rank} could not join the MLX ring {list(hosts)}: {exc}") from exc
    finally:
        os.unlink(f.name)
    if group.size() != len(hosts) or group.rank() != rank:
        raise RingError(f"the ring formed as rank {group.rank()} of {group.size()}, not {rank} of {len(hosts)}")
    return group


class RingLink:
    """This rank's view of the ring: header broadcast, hidden states to the next rank, tokens from the last."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world_size = group.rank(), group.size()
        self.wait_s = 0.0

    def exchange_header(self, header: Header | None) -> Header:
        """Rank 0 passes its header; every rank gets it back (an empty one costs one int all_sum)."""
        started = time.perf_counter()
        payload = b"" if header is None or header.empty else header.model_dump_json().encode()
        size = int(np.array(mx.distributed.all_sum(mx.array([len(payload)], dtype=mx.int64), group=self.group))[0])
        if not 0 <= size <= MAX_HEADER_BYTES:
            raise RingError(f"header of {size} bytes refused")
        if size == 0:
            self.wait_s += time.perf_counter() - started
            return Header()
        mine = mx.array(list(payload), dtype=mx.uint8) if self.rank == 0 else mx.zeros((size,), dtype=mx.uint8)
        data = mx.distributed.all_sum(mine, group=self.group)
        raw = np.array(data, copy=False).tobytes()
        self.wait_s += time.perf_counter() - started
        try:
            return Header.model_validate_json(raw)
        except ValidationError as exc:
            raise RingError(f"header refused: {str(exc)[:200]}") from exc

    def share_tokens(self, rows: list[list[int]] | None, count: int) -> list[list[int]]:
        """The sampler's [token, finished, failed] per row, on every rank."""
        if count == 0:
            return []
        mine = mx.array(rows, dtype=mx.int32) if rows is not None else mx.zeros((count, 3), dtype=mx.int32)
        if mine.shape != (count, 3):
            raise RingError(f"{mine.shape} token rows for {count} requests")
        started = time.perf_counter()
        shared = cast(list[list[int]], mx.distributed.all_sum(mine, group=self.group).tolist())
        self.wait_s += time.perf_counter() - started
        return shared


def slice_pipeline(model: nn.Module, link: RingLink, start: int, end: int) -> None:
    """Keep layers [start, end) of mlx-lm's model, receiving before the first and sending after the last."""
    inner = inner_model(model)
    layers = list(inner.layers)
    if not 0 <= start < end <= len(layers):
        raise ValueError(f"layers [{start}, {end}) of a {len(layers)}-layer model")
    kept = layers[start:end]
    if link.rank > 0:
        swap_layer(kept[0], functools.partial(_receiving, link=link))
    if link.rank < link.world_size - 1:
        swap_layer(kept[-1], functools.partial(_sending, link=link))
    keep_layers(inner, kept)


class _OneRank:
    """The group mlx-lm's PipelineMixin.pipeline reads: this process alone (the ring's own link sends)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def keep_layers(inner: Any, kept: list[nn.Module]) -> None:
    """Make `kept` the decoder stack. A stack built on mlx-lm's PipelineMixin (Qwen3-Next, DeepSeek, GLM,
    Qwen3.5, ...) then re-derives what it indexes by position, as it does when mlx-lm pipelines it itself:
    Qwen3-Next's first attention and first recurrent layer, whose caches give its two masks."""
    inner.layers = kept
    if callable(getattr(inner, "pipeline", None)):
        inner.pipeline(_OneRank())


def shard_tensor(model: nn.Module, link: RingLink) -> None:
    """Tensor: mlx-lm's own `shard` (attention heads and MLP columns split, an all_sum after each block)."""
    shard = getattr(model, "shard", None)
    if shard is None:
        raise RingError(f"mlx-lm's {type(model).__module__} has no tensor sharding; place it with Pipeline")
    shard(link.group)


def inner_model(model: nn.Module) -> Any:
    """The decoder stack under mlx-lm's head (`model.model`; vision-language models nest it one deeper)."""
    found: Any = model
    return found.model if hasattr(found, "model") else found.language_model.model


def swap_layer(layer: nn.Module, make: Callable[[type], Any]) -> None:
    """Give this one layer a subclass of its own class whose __call__ is make(its class): its attributes, weights
    and cache use stay mlx-lm's."""
    cls = type(layer)
    name = getattr(make, "func", make).__name__.strip("_").title()
    layer.__class__ = type(f"{name}{cls.__name__}", (cls,), {"__call__": make(cls)})


def _receiving(cls: type, link: RingLink) -> Any:
    def call(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        x = mx.distributed.recv_like(x, link.rank - 1, group=link.group)
        return cls.__call__(self, x, *args, **kwargs)

    return call


def _sending(cls: type, link: RingLink) -> Any:
    def call(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = cls.__call__(self, x, *args, **kwargs)
        return mx.distributed.send(out, link.rank + 1, group=link.group)

    return call
