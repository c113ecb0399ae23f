"""What one engine rank exchanges with the others in a step: the header, hidden states, sampled tokens.

The engine is one slot-batch core for every world size; only these exchanges differ. `LocalLink` is the
world-size-1 case, where rank 0 is also the sampler and every exchange is the identity. `GroupLink` carries
them over torch.distributed: headers on the control group (wire.py), hidden states rank to rank for a
Pipeline, and the sampler's [token, finished, failed] rows to whoever embeds the next input. Everything travels
from host memory (the group is gloo, so CUDA, CPU and MLX ranks share one wire): a CUDA rank copies its hidden
states device → host before a send and host → device after a receive (device.py).

A Pipeline's critical path per token is one hidden-state message per hop and the sampled rows back to rank 0,
nothing else: headers travel ahead of the hidden states (posted to receivers that have already posted their
receive, wire.PostedHeaders), sends never wait for their receiver (isend, kept until complete), and rank 0 posts
the receive of a step's tokens as soon as it has sent the step, so the sampler's send finds it waiting. Rank 0
takes those tokens when it needs them (`PendingTokens.wait`), which is what lets it run ahead by a micro-batch.

For benchmarks, SKULK_LINK_DELAY_MS emulates a link's latency where the kernel cannot (delay.py): each send is
then posted that much later by a thread, and each collective completes that much later.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from .delay import DelayedSends, after_collective, emulated_delay_s
from .device import to_device, to_host
from .wire import Header, HeaderChannel, PostedHeaders, settle

ShardKind = Literal["pipeline", "tensor"]
TokenRows = list[list[int]]  # per running row: [token, finished, failed]
TOKENS_TAG = 3  # the sampler's rows to rank 0 (headers use wire.HEADER_TAG and PAYLOAD_TAG; hidden states 0)


class PendingTokens:
    """One step's [token, finished, failed] rows, here already or on their way from the sampler."""

    def __init__(self, rows: TokenRows | None = None, work: Any = None, wire: torch.Tensor | None = None,
                 link: GroupLink | None = None) -> None:
        self._rows, self._work, self._wire, self._link = rows, work, wire, link

    def wait(self) -> TokenRows:
        if self._rows is None:
            assert self._work is not None and self._wire is not None
            started = time.perf_counter()
            self._work.wait()
            if self._link is not None:
                self._link.wait_s += time.perf_counter() - started
            self._rows, self._work = self._wire.tolist(), None
        return self._rows


class Link(Protocol):
    wait_s: float
    """Seconds spent waiting on peers since the runner last took it (tracing)."""

    def send_header(self, header: Header) -> None: ...

    def receive_header(self) -> Header: ...

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def send_hidden(self, x: torch.Tensor) -> None: ...

    def exchange_tokens(self, rows: TokenRows | None, count: int) -> PendingTokens | None:
        """The sampler passes its rows; every rank that embeds the next input gets them (None elsewhere)."""
        ...

    def flush(self) -> None:
        """Wait until everything this rank sent has left (before a shutdown tears the group down)."""
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

    def exchange_tokens(self, rows: TokenRows | None, count: int) -> PendingTokens | None:
        return PendingTokens(rows)

    def flush(self) -> None:
        pass


def tensor_all_reduce(world_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Tensor rank's all-reduce (a sum in place); under an emulated latency, a ring's 2(W-1) one-way steps more."""
    delay_s = emulated_delay_s()

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        host = to_host(x)  # the group is gloo: a CUDA rank's partial sum goes through host memory (NCCL: later)
        dist.all_reduce(host, op=dist.ReduceOp.SUM)
        if host is not x:
            x.copy_(host)
        if delay_s:
            after_collective(delay_s, 2 * (world_size - 1))
        return x

    return all_reduce


class GroupLink:
    """One rank of a Pipeline or Tensor group."""

    def __init__(self, rank: int, world_size: int, kind: ShardKind, control_group: Any) -> None:
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.delay_s = emulated_delay_s()
        self.delay = DelayedSends(self.delay_s) if self.delay_s else None
        """Bench-only emulated latency (delay.py); None, and never looked at again, in production."""
        self.channel = PostedHeaders(control_group, rank, world_size, self.delay) if kind == "pipeline" \
            else HeaderChannel(control_group, self.delay_s)
        self.control_group = control_group
        self.wait_s = 0.0
        self._sending: list[tuple[Any, torch.Tensor]] = []  # hidden states on their way to the next rank

    def send_header(self, header: Header) -> None:
        self.channel.send(header)

    def receive_header(self) -> Header:
        return self.channel.receive()

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Received into host memory (the group is gloo, whatever the ranks compute on), then moved to this
        rank's device (device.to_device: the same tensor on the CPU)."""
        x = torch.empty(shape, dtype=dtype)
        started = time.perf_counter()
        dist.recv(x, src=self.rank - 1)
        self.wait_s += time.perf_counter() - started
        return to_device(x, device)

    def send_hidden(self, x: torch.Tensor) -> None:
        """Sent without waiting for the next rank (still busy with an earlier micro-batch, it may not have posted
        its receive yet); the tensor is kept until the send completes (wire.settle). A CUDA rank's hidden states
        are copied to host memory first (device.to_host), so a CPU or MLX rank reads them off the same wire."""
        x = to_host(x).contiguous()
        if self.delay is None:
            self._sending.append((dist.isend(x, dst=self.rank + 1), x))
        else:
            self._sending.append((self.delay.post(lambda: dist.isend(x, dst=self.rank + 1)), x))
        settle(self._sending, self.world_size)

    def exchange_tokens(self, rows: TokenRows | None, count: int) -> PendingTokens | None:
        """Tensor: the sampler broadcasts to every rank. Pipeline: the sampler sends to rank 0 only, into the
        receive rank 0 posted when it sent the step (taken later: PendingTokens)."""
        sampler, scheduler = self.rank == self.world_size - 1, self.rank == 0
        if self.kind == "pipeline" and not (sampler or scheduler):
            return None
        wire = torch.tensor(rows, dtype=torch.int64) if rows is not None else torch.empty((count, 3), dtype=torch.int64)
        wire = wire.reshape(count, 3)
        if self.kind == "tensor":
            started = time.perf_counter()
            dist.broadcast(wire, src=self.world_size - 1, group=self.control_group)
            if self.delay_s and not sampler:
                after_collective(self.delay_s, 1)
            self.wait_s += time.perf_counter() - started
            return PendingTokens(wire.tolist())
        if sampler and self.delay is not None:
            group = self.control_group
            self._sending.append((self.delay.post(lambda: dist.isend(wire, dst=0, group=group, tag=TOKENS_TAG)),
                                  wire))
            settle(self._sending, self.world_size)
            return None
        if sampler:
            dist.send(wire, dst=0, group=self.control_group, tag=TOKENS_TAG)
            return None
        work = dist.irecv(wire, src=self.world_size - 1, group=self.control_group, tag=TOKENS_TAG)
        return PendingTokens(work=work, wire=wire, link=self)

    def flush(self) -> None:
        for work, _ in self._sending:
            work.wait()
        self._sending = []
        if isinstance(self.channel, PostedHeaders):
            self.channel.flush()
