"""Rank 0's measured pace of a Pipeline by decode rows: what micro_batching's rule needs, learned from the steps
the group runs (a table lookup per step, no calibration).

Rank 0 times two things per decode step of r rows: its own part (embedding, its layers, the hidden states' send,
the Python around them: the step's seconds less any wait on a peer) and the step's trip, from the end of its part
to its tokens' arrival (the later ranks' parts and every hop), timed only when rank 0 had to wait for them (a wait
of more than BLOCKED_S: the tokens were not there yet, so the wait ended on their arrival). The later ranks' parts
are taken as rank 0's own per layer (like machines, the common case; rank 0 cannot see them), and the hops as what
is left of the trip. That understates the sampler, which also computes the lm_head and samples (SmolLM2's lm_head
is a fifth of its weights), so the rule can take micro-batches that only break even: SmolLM2's 8 streams over
Pipeline 2 measured the same with and without them (bench/split_engine.py --forced, quiet). Figures at row counts
never run are interpolated (micro_batching.at_rows): a batch grows a stream at a time, so the counts around both R
and R/ranks are usually measured.
"""

from __future__ import annotations

from skulk.engines.micro_batching import at_rows

BLOCKED_S = 1e-4
"""A wait on a step's tokens longer than this was a real wait (taking tokens that had already arrived costs
~12 us with gloo, whose irecv cannot say whether it completed before it is waited on)."""
WEIGHT = 0.2
"""The newest step's weight in each running average."""


class Pace:
    """Rank 0's running averages by decode rows (module docstring)."""

    def __init__(self, world_size: int, own_layers: int, total_layers: int) -> None:
        self.world_size = world_size
        others = max(1, world_size - 1)
        self.ratio = (total_layers - own_layers) / others / max(1, own_layers)
        """A later rank's part against rank 0's own (by layers)."""
        self.own: dict[int, float] = {}
        self.trip: dict[int, float] = {}

    def part(self, rows: int, seconds: float) -> None:
        _average(self.own, rows, seconds)

    def tokens_back(self, rows: int, seconds: float, waited: float) -> None:
        if waited > BLOCKED_S:
            _average(self.trip, rows, seconds)

    def shares(self, rows: int) -> list[float] | None:
        """Every rank's seconds for its part of a step of `rows` rows (micro_batching.Shares)."""
        own = at_rows(self.own, rows)
        return None if own is None else [own, *[own * self.ratio] * (self.world_size - 1)]

    def hops(self, rows: int) -> float | None:
        """The messages' seconds round the ring for `rows` rows: the trip less the later ranks' parts."""
        trip, shares = at_rows(self.trip, rows), self.shares(rows)
        return None if trip is None or shares is None else max(0.0, trip - sum(shares[1:]))


def _average(table: dict[int, float], rows: int, seconds: float) -> None:
    old = table.get(rows)
    table[rows] = seconds if old is None else old + WEIGHT * (seconds - old)
