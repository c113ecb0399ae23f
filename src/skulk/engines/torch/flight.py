"""Rank 0's steps in flight through a Pipeline: micro-batches, and the tokens that come back from the sampler.

A Pipeline of n ranks computes a step on one rank at a time, so with one batch every rank idles (n-1)/n of the
time. Rank 0 instead leads a step for one micro-batch of the running rows (schedule.micro_batch: a 1/n share of
them) and, while later ranks compute it, leads the next micro-batch's step, up to n steps in flight (vLLM's
pipeline-parallel micro-batches). A row joins a new step only once its last step's token is back at rank 0, so
every request computes the same sequence of positions from the same inputs as in the plain schedule, where each
step decodes every running row and its tokens come back before the next: greedy tokens are identical.

Only rank 0 decides: the header names the rows each step decodes (wire.Header.rows), every other rank computes
exactly those, and the sampler sends each step's tokens as soon as it has them (into the receive rank 0 posted
when it sent the step, links.PendingTokens). Rank 0 takes them when a row needs its next input, when n steps are
in flight, before it preempts (a preempted request carries its tokens in the header, so they must all be known)
and before it shuts the group down. With one stream this is the plain schedule; `micro_batches = False` keeps
the plain schedule for any batch.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from .core import EngineCore
from .links import PendingTokens, TokenRows
from .requests import Request
from .schedule import micro_batch
from .wire import Release


class Flight(EngineCore):
    micro_batches = True
    """Rank 0 of a Pipeline leads micro-batches while earlier ones are in flight (module docstring)."""

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self._in_flight: deque[tuple[list[Request], PendingTokens]] = deque()  # rank 0: steps whose tokens are due
        self._busy: set[int] = set()  # rank 0: id() of each request in a step in flight
        self.overlapped = 0  # rank 0: steps led while an earlier one was still in flight

    @property
    def _pipelined(self) -> bool:
        return self.kind == "pipeline" and self.world_size > 1 and self.micro_batches

    def _fly(self, reqs: list[Request], pending: PendingTokens) -> None:
        """A step's sampled rows are on their way: rank 0 of a pipelined group takes them later, anyone else now."""
        if self.is_scheduler and self._pipelined:
            self._in_flight.append((reqs, pending))
            self._busy.update(map(id, reqs))
        else:
            self._land(reqs, pending.wait())

    def _take_due(self, startable: bool) -> None:
        """Rank 0, before leading a step: take the oldest step's tokens while n steps are in flight or nothing
        else could start (every decoding row is in flight and nothing is to be prefilled, added or released)."""
        while self._in_flight and (len(self._in_flight) >= self.world_size or not (startable or self._idle_row())):
            self._take_oldest()
        if self._in_flight:
            self.overlapped += 1

    def _drain(self) -> None:
        """Take every step in flight (before a preemption or a shutdown)."""
        while self._in_flight:
            self._take_oldest()

    def _take_oldest(self) -> None:
        reqs, pending = self._in_flight.popleft()
        self._busy.difference_update(map(id, reqs))
        running = set(map(id, self._running))  # a request released while in flight: nothing left to record
        self._land([r if id(r) in running else None for r in reqs], pending.wait())

    def _land(self, reqs: list[Request] | list[Request | None], rows: TokenRows) -> None:
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

    def _idle_row(self) -> bool:
        return any(r.length >= len(r.prompt) and not r.finished and id(r) not in self._busy for r in self._running)

    def _decode_range(self) -> tuple[int, int] | None:
        """Rank 0: the running rows the next step decodes; None when no row can (schedule.micro_batch)."""
        running = self._running
        decoding = [r.length >= len(r.prompt) for r in running]
        if not self._pipelined:
            return (0, len(running)) if any(decoding) else None
        return micro_batch([id(r) in self._busy for r in running], decoding, self.world_size)
