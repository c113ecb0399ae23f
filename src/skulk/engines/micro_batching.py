"""Whether a Pipeline pipelines micro-batches: one rule, used by the torch engine per step (engines/torch/flight.py)
and by the speed prediction (master/speed.py), so a preview predicts what the engine will do.

A Pipeline step of R rows costs every rank its share of the model at R rows, one after the other, plus the hops
between them and the sampled tokens' hop back to rank 0. With M micro-batches of R/M rows in flight at once, each
rank works on every micro-batch in turn while the others compute theirs, so a round in which every row advances
one token lasts the longer of the busiest rank's M shares at R/M rows and one micro-batch's trip round the ring:

    plain  = sum(shares(R)) + hops(R)
    micro  = max(M * max(shares(R/M)), sum(shares(R/M)) + hops(R/M))

Micro-batches pay where the hops are long against the compute (they hide them) or where a rank's forward at R/M
rows costs well under its forward at R (compute-bound). They lose where the forward is bound by reading the
weights (small batches on a CPU: t(4) is ~0.7 t(8) on the 100M int4 model, bench/split_engine.py) and the link is
short, since each rank then reads its weights M times per round instead of once. Nothing here knows where the
seconds come from: the engine feeds its own measured steps, the prediction the nodes' measured compute and links.
Torch-free: the master imports it.

SKULK_MICRO_BATCHES (benchmarks: bench/split.py --engine-rows) forces the rule either way in every runner of a
node, as split_engine.py forces it on the engine alone: `always` or `never`; unset, the rule decides.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise

Shares = Callable[[int], Sequence[float] | None]
"""Each rank's seconds for its part of a step of r rows (rank order), or None when unknown."""
Hops = Callable[[int], float | None]
"""Seconds of every message of one step of r rows round the ring (hidden states on, tokens back), or None."""
MICRO_BATCHES_ENV = "SKULK_MICRO_BATCHES"
"""`always` / `never`: a Pipeline's rank 0 pipelines micro-batches always / never; anything else: as the rule
decides (the default, and what production runs)."""


def forced_micro_batches(environ: Mapping[str, str] = os.environ) -> bool | None:
    """SKULK_MICRO_BATCHES as the engine's setting (flight.Flights.micro_batches): True, False, or None."""
    return {"always": True, "never": False}.get((environ.get(MICRO_BATCHES_ENV) or "").strip().lower())


def period_s(shares: Shares, hops: Hops, rows: int, micro: int) -> float | None:
    """Seconds for every one of `rows` decoding rows to advance one token with `micro` micro-batches in flight
    (1: the plain schedule); None when a figure is missing."""
    part = math.ceil(rows / max(1, micro))
    each, ring = shares(part), hops(part)
    if each is None or ring is None or not each:
        return None
    trip = sum(each) + ring
    return trip if micro <= 1 else max(micro * max(each), trip)


def micro_batches_for(shares: Shares, hops: Hops, rows: int, ranks: int) -> int | None:
    """How many micro-batches a Pipeline of `ranks` ranks keeps in flight for `rows` decoding rows: `ranks` when
    that round is shorter than the plain step, else 1. None when a figure is missing (the caller keeps what it
    did). Fewer rows than ranks, or one rank: always 1."""
    if ranks < 2 or rows < ranks:
        return 1
    plain, piped = period_s(shares, hops, rows, 1), period_s(shares, hops, rows, ranks)
    if plain is None or piped is None:
        return None
    return ranks if piped < plain else 1


def at_rows(table: Mapping[int, float], rows: int) -> float | None:
    """A figure measured by row count, at `rows`: measured, else linear between the counts around it (below the
    smallest measured, the smallest's; above the largest, extended from the two largest, never below the largest;
    from one count alone, only that count and below)."""
    points = sorted(table.items())
    if not points:
        return None
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, s0), (r1, s1) in pairwise(points):
        if r0 <= rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    if len(points) < 2:
        return None
    (r0, s0), (r1, s1) = points[-2], points[-1]
    return max(s1, s1 + (s1 - s0) * (rows - r1) / (r1 - r0))
