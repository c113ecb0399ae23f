"""The mlx-lm caches of an MLX rank in a mixed Pipeline (mixed.py): one per request, or one batch for several.

The torch engine decodes every running request in one forward pass over its block tables; mlx-lm's layers
decode several sequences at once over a BatchKVCache (rows left-padded to a common length, a mask hiding the
padding), which is how mlx-lm's own batch generation runs. So a request lives in one of two places here: alone,
in its own KVCache per layer (while its prompt is prefilled, chunk by chunk, and when it decodes by itself), or
as a row of a batch that decodes together. A step's decode rows that are exactly a batch's requests run on it
as they are (rows reordered in place if the step lists them in another order); otherwise the rows move: out of
their old batch (`extract`, the rest kept by `filter`) and, merged, into a new one (`merge`): mlx-lm's own cache
operations, as its BatchGenerator uses them when requests join and leave. That copy is paid when the set of
requests changes, not per token.

Every lookup checks that the cache ends where the step's positions start: a header that steps a request
elsewhere (forged, or out of order) is a WireError, never a silently wrong token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from skulk.engines.torch.wire import WireError

Cache = list[Any]
"""One mlx-lm cache object per layer."""


@dataclass
class _Batch:
    ids: list[str]
    cache: Cache


class SequenceCaches:
    """Each request's cache, alone or as a row of a batch (module docstring)."""

    def __init__(self, new_cache: Callable[[], Cache]) -> None:
        self._new = new_cache
        self._alone: dict[str, Cache] = {}
        self._batches: list[_Batch] = []

    def __len__(self) -> int:
        return len(self._alone) + sum(len(b.ids) for b in self._batches)

    def one(self, request_id: str, position: int) -> Cache:
        """The request's own cache, ending at `position` (a fresh one at 0); a batch whose only row it is serves
        as it is."""
        batch = next((b for b in self._batches if b.ids == [request_id]), None)
        if batch is not None and position != 0:
            self._check(batch, [position])
            return batch.cache
        return self._alone_at(request_id, position)

    def batch(self, request_ids: Sequence[str], positions: Sequence[int]) -> Cache:
        """One cache for these requests' rows, in this order, each ending at its position."""
        ids = list(request_ids)
        same = next((b for b in self._batches if sorted(b.ids) == sorted(ids)), None)
        if same is None:
            parts = [self._alone_at(r, p) for r, p in zip(ids, positions, strict=True)]
            same = _Batch(ids, [layer[0].merge(list(layer)) for layer in zip(*parts, strict=True)])
            for r in ids:
                del self._alone[r]
            self._batches.append(same)
        elif same.ids != ids:
            order = mx.array([same.ids.index(r) for r in ids])
            for layer in same.cache:
                layer.filter(order)
            same.ids = ids
        self._check(same, positions)
        return same.cache

    def keep(self, live: set[str]) -> None:
        """Drop the caches of requests no longer running (released, or preempted to be recomputed from 0)."""
        for request_id in [r for r in self._alone if r not in live]:
            del self._alone[request_id]
        for batch in list(self._batches):
            rows = [i for i, r in enumerate(batch.ids) if r in live]
            if len(rows) < len(batch.ids):
                self._filter(batch, rows)

    def _alone_at(self, request_id: str, position: int) -> Cache:
        """The request's cache of its own (taken out of its batch if it is in one), ending at `position`."""
        if position == 0:
            self._forget(request_id)
            self._alone[request_id] = self._new()
        elif request_id not in self._alone:
            self._take_out(request_id)
        cache = self._alone.get(request_id)
        offset = cache[0].offset if cache else -1
        if cache is None or offset != position:
            raise WireError(f"request {request_id!r} steps at position {position}; its MLX cache holds {offset}")
        return cache

    def _check(self, batch: _Batch, positions: Sequence[int]) -> None:
        offsets = batch.cache[0].offset
        held = [int(o) for o in cast(list[int], offsets.tolist())] if isinstance(offsets, mx.array) else [int(offsets)]
        if held != list(positions):
            raise WireError(f"requests {batch.ids} step at positions {list(positions)}; their MLX caches hold {held}")

    def _take_out(self, request_id: str) -> None:
        """Move the request's row out of its batch into a cache of its own."""
        batch = next((b for b in self._batches if request_id in b.ids), None)
        if batch is None:
            return
        row = batch.ids.index(request_id)
        self._alone[request_id] = [layer.extract(row) for layer in batch.cache]
        self._filter(batch, [i for i in range(len(batch.ids)) if i != row])

    def _forget(self, request_id: str) -> None:
        self._alone.pop(request_id, None)
        batch = next((b for b in self._batches if request_id in b.ids), None)
        if batch is not None:
            self._filter(batch, [i for i, r in enumerate(batch.ids) if r != request_id])

    def _filter(self, batch: _Batch, rows: list[int]) -> None:
        if not rows:
            self._batches.remove(batch)
            return
        index = mx.array(rows)
        for layer in batch.cache:
            layer.filter(index)
        batch.ids = [batch.ids[i] for i in rows]
