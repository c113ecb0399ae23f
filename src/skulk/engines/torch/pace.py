"""Rank 0's measured pace of a Pipeline by decode rows: what micro_batching's rule needs, learned from the steps
the group runs (a table lookup per step, no calibration).

Rank 0 times two things per decode step of r rows: its own part (embedding, its layers, the hidden states' send,
the Python around them: the step's seconds less any wait on a peer) and the step's trip, from the end of its part
to its tokens' arrival (the later ranks' parts and every hop), timed only when rank 0 had to wait for them (a wait
of more than BLOCKED_S: the tokens were not there yet, so the wait ended on their arrival). The later ranks' parts
are taken as rank 0's own per byte of weights it reads (like machines, the common case; rank 0 cannot see them):
the rest of the layers shared evenly among them, and the last rank's lm_head on top, which rank 0 weighs by its
own embedding (the same vocabulary-by-hidden matrix, the very one where they are tied). The hops are what is left
of the trip. Counting by layers alone understated the sampler: SmolLM2's lm_head (8-bit, as its embedding) is 28 MB
against 1.8 MB for each of its 4-bit layers, so over Pipeline 2 with 15 layers each its last rank's forward took
4.5 ms against rank 0's 2.5 (bench/split_engine.py, one stream). Figures at row counts
never run are interpolated (micro_batching.at_rows): a batch grows a stream at a time, so the counts around both R
and R/ranks are usually measured.
"""

from __future__ import annotations

from typing import Any

from skulk.engines.micro_batching import at_rows

BLOCKED_S = 1e-4
"""A wait on a step's tokens longer than this was a real wait (taking tokens that had already arrived costs
~12 us with gloo, whose irecv cannot say whether it completed before it is waited on)."""
WEIGHT = 0.2
"""The newest step's weight in each running average."""


class Pace:
    """Rank 0's running averages by decode rows (module docstring)."""

    def __init__(self, world_size: int, own_layers: int, total_layers: int, head_layers: float = 0.0) -> None:
        """head_layers: the last rank's lm_head in rank 0's layers' worth of weight bytes (head_in_layers)."""
        self.world_size = world_size
        others = max(1, world_size - 1)
        each = (total_layers - own_layers) / others
        own = max(1, own_layers)
        self.ratios = [each / own] * (others - 1) + [(each + head_layers) / own]
        """Each later rank's part against rank 0's own (by weight bytes)."""
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
        return None if own is None else [own, *(own * ratio for ratio in self.ratios[: self.world_size - 1])]

    def hops(self, rows: int) -> float | None:
        """The messages' seconds round the ring for `rows` rows: the trip less the later ranks' parts."""
        trip, shares = at_rows(self.trip, rows), self.shares(rows)
        return None if trip is None or shares is None else max(0.0, trip - sum(shares[1:]))


def head_in_layers(model: Any) -> float:
    """The lm_head's weight bytes in layers' worth, judged on rank 0 of a torch slice (model.ModelSlice) from its
    embedding (the head's shape, and format where they are tied) against its own layers' mean (parameters and
    buffers). 0 for a stage without them (an MLX rank 0 of a mixed pipeline: its pace counts layers alone)."""
    embedding, layers = getattr(model, "embed_tokens", None), getattr(model, "layers", None)
    if embedding is None or layers is None or not hasattr(layers, "values") or not len(layers):
        return 0.0
    per_layer = sum(module_bytes(layer) for layer in layers.values()) / len(layers)
    return module_bytes(embedding) / per_layer if per_layer else 0.0


def module_bytes(module: Any) -> int:
    """Bytes of the memory a module's tensors view, each storage once (fused projections' parts are views)."""
    storages = {}
    for tensor in (*module.parameters(), *module.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _average(table: dict[int, float], rows: int, seconds: float) -> None:
    old = table.get(rows)
    table[rows] = seconds if old is None else old + WEIGHT * (seconds - old)
