"""What one engine rank exchanges with the others in a step: the header, hidden states, sampled tokens.

The engine is one slot-batch core for every world size; only these exchanges differ. `LocalLink` is the
world-size-1 case, where rank 0 is also the sampler and every exchange is the identity. `GroupLink` carries
them over torch.distributed: headers on the control group (wire.py), hidden states rank to rank for a
Pipeline, and the sampler's [token, finished, failed] rows to whoever embeds the next input.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from .wire import Header, HeaderChannel

ShardKind = Literal["pipeline", "tensor"]
TokenRows = list[list[int]]  # per running row: [token, finished, failed]


class Link(Protocol):
    wait_s: float
    """Seconds spent waiting on peers since the runner last took it (tracing)."""

    def send_header(self, header: Header) -> None: ...

    def receive_header(self) -> Header: ...

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def send_hidden(self, x: torch.Tensor) -> None: ...

    def exchange_tokens(self, rows: TokenRows | None, count: int) -> TokenRows | None:
        """The sampler passes its rows; every rank that embeds the next input gets them back (None elsewhere)."""
        ...


class LocalLink:
    """World size 1: the scheduler is the sampler and nothing travels."""

    wait_s = 0.0

    def send_header(self, header: Header) -> None:
        pass

    def receive_header(self) -> Header:
        raise RuntimeError("a single rank schedules its own steps")

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise RuntimeError("a single rank embeds its own input")

    def send_hidden(self, x: torch.Tensor) -> None:
        raise RuntimeError("a single rank samples its own output")

    def exchange_tokens(self, rows: TokenRows | None, count: int) -> TokenRows | None:
        return rows


class GroupLink:
    """One rank of a Pipeline or Tensor group."""

    def __init__(self, rank: int, world_size: int, kind: ShardKind, control_group: Any) -> None:
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.channel = HeaderChannel(control_group)
        self.control_group = control_group
        self.wait_s = 0.0

    def send_header(self, header: Header) -> None:
        self.channel.send(header)

    def receive_header(self) -> Header:
        return self.channel.receive()

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        started = time.perf_counter()
        dist.recv(x, src=self.rank - 1)
        self.wait_s += time.perf_counter() - started
        return x

    def send_hidden(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.rank + 1)

    def exchange_tokens(self, rows: TokenRows | None, count: int) -> TokenRows | None:
        """Tensor: the sampler broadcasts to every rank. Pipeline: the sampler sends to rank 0 only."""
        sampler, scheduler = self.rank == self.world_size - 1, self.rank == 0
        if self.kind == "pipeline" and not (sampler or scheduler):
            return None
        wire = torch.tensor(rows, dtype=torch.int64) if rows is not None else torch.empty((count, 3), dtype=torch.int64)
        wire = wire.reshape(count, 3)
        started = time.perf_counter()
        if self.kind == "tensor":
            dist.broadcast(wire, src=self.world_size - 1, group=self.control_group)
        elif sampler:
            dist.send(wire, dst=0, group=self.control_group)
            return None
        else:
            dist.recv(wire, src=self.world_size - 1, group=self.control_group)
        self.wait_s += time.perf_counter() - started
        return wire.tolist()
