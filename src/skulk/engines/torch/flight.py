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
and before it shuts the group down. With one stream this is the plain schedule.

Micro-batches do not always pay: each rank then runs `ranks` forwards of fewer rows per round instead of one,
which costs nearly as much each where the forward is bound by reading the weights. Rank 0 therefore decides per
step, with micro_batching.micro_batches_for (the rule the speed prediction applies too), from the group's pace it
measures as it runs (pace.py): `ranks` micro-batches when their round is shorter than the plain step, else one
(the plain schedule, still led through the same path). `micro_batches` True or False forces either.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from skulk.engines.micro_batching import forced_micro_batches, micro_batches_for

from .links import PendingTokens, TokenRows
from .options import Shard
from .pace import Pace
from .requests import Request
from .schedule import micro_batch
from .wire import StepKind

Lander = Callable[[Sequence[Request | None], TokenRows], None]
"""Records a step's [token, finished, failed] rows on its requests (None: a request released since)."""
InFlight = tuple[list[Request], PendingTokens, float, bool]
"""A step's requests, its tokens on their way, when rank 0 sent it, and whether it was a decode step alone."""
DECIDE_EVERY = 16
"""Decode steps between two decisions at the same row count (a decision is a few table lookups; the pace moves
slowly)."""


class Flights:
    """Rank 0's steps in flight through a Pipeline, a part the engine holds (every rank holds one; only rank 0's
    ever keeps a step in flight). It owns the steps whose tokens are due and the group's measured pace; the
    requests stay the engine's: `running` reads its running rows and `land` records a step's tokens on them."""

    def __init__(self, shard: Shard, pace: Pace, running: Callable[[], Sequence[Request]], land: Lander) -> None:
        self.micro_batches: bool | None = forced_micro_batches()
        """Rank 0 of a Pipeline leads micro-batches while earlier ones are in flight: always (True), never
        (False), or where they pay, by the group's measured pace (None, the default; module docstring). A bench
        forces it in a node's runners by SKULK_MICRO_BATCHES (micro_batching.forced_micro_batches)."""
        self.shard, self.pace, self._running, self._land = shard, pace, running, land
        self.micro = shard.world_size  # rank 0: micro-batches in flight now (until the pace says otherwise)
        self._decided: tuple[int, int] = (0, 0)  # rank 0: (decoding rows, decode steps left) of the last decision
        self.in_flight: deque[InFlight] = deque()  # rank 0: steps whose tokens are due
        self._busy: set[int] = set()  # rank 0: id() of each request in a step in flight
        self.overlapped = 0  # rank 0: steps led while an earlier one was still in flight

    @property
    def pipelined(self) -> bool:
        return self.shard.kind == "pipeline" and self.shard.world_size > 1 and self.micro_batches is not False

    def fly(self, reqs: list[Request], pending: PendingTokens, decode: bool) -> None:
        """A step's sampled rows are on their way: rank 0 of a pipelined group takes them later, anyone else now."""
        if self.shard.is_scheduler and self.pipelined:
            self.in_flight.append((reqs, pending, time.perf_counter(), decode))
            self._busy.update(map(id, reqs))
        else:
            self._land(reqs, pending.wait())

    def take_due(self, startable: bool) -> None:
        """Rank 0, before leading a step: take the oldest step's tokens while as many steps as micro-batches are
        in flight or nothing else could start (every decoding row is in flight and nothing is to be prefilled,
        added or released)."""
        if self.pipelined:
            self.micro = self._micro_batches()
        while self.in_flight and (len(self.in_flight) >= self.micro or not (startable or self._idle_row())):
            self._take_oldest()
        if self.in_flight:
            self.overlapped += 1

    def _micro_batches(self) -> int:
        """How many micro-batches the next steps keep in flight (module docstring), decided again when the
        decoding rows change or every DECIDE_EVERY steps."""
        if self.micro_batches is not None:
            return self.shard.world_size
        rows = sum(1 for r in self._running() if r.length >= len(r.prompt))
        last, left = self._decided
        if rows == last and left > 0:
            self._decided = (rows, left - 1)
            return self.micro
        self._decided = (rows, DECIDE_EVERY)
        chosen = micro_batches_for(self.pace.shares, self.pace.hops, rows, self.shard.world_size)
        return self.micro if chosen is None else chosen

    def pace_part(self, kind: StepKind, seconds: float, step_rows: tuple[int, int] | None) -> None:
        """Rank 0 of a pipelined group: its own part of a decode step just led (Pace)."""
        if kind == StepKind.DECODE and self.pipelined and self.micro_batches is None:
            start, end = step_rows or (0, len(self._running()))
            self.pace.part(end - start, seconds)

    def drain(self) -> bool:
        """Take every step in flight (before a preemption or a shutdown); whether there was any."""
        had = bool(self.in_flight)
        while self.in_flight:
            self._take_oldest()
        return had

    def _take_oldest(self) -> None:
        reqs, pending, sent, decode = self.in_flight.popleft()
        self._busy.difference_update(map(id, reqs))
        running = set(map(id, self._running()))  # a request released while in flight: nothing left to record
        waiting = time.perf_counter()
        rows = pending.wait()
        if decode:
            arrived = time.perf_counter()
            self.pace.tokens_back(len(reqs), arrived - sent, arrived - waiting)
        self._land([r if id(r) in running else None for r in reqs], rows)

    def _idle_row(self) -> bool:
        return any(r.length >= len(r.prompt) and not r.finished and id(r) not in self._busy for r in self._running())

    def decode_range(self) -> tuple[int, int] | None:
        """Rank 0: the running rows the next step decodes; None when no row can (schedule.micro_batch)."""
        running = self._running()
        decoding = [r.length >= len(r.prompt) for r in running]
        if not self.pipelined:
            return (0, len(running)) if any(decoding) else None
        return micro_batch([id(r) in self._busy for r in running], decoding, self.micro)
