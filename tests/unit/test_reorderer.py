"""Reorderer: strict idx order, exactly once, whatever the arrival order."""

from __future__ import annotations

import random

import pytest

from skulk.cluster.reorder import Reorderer
from skulk.types.events import IndexedEvent, NodeTimedOut
from skulk.types.ids import NodeId


def ev(idx: int) -> IndexedEvent:
    return IndexedEvent(idx=idx, event=NodeTimedOut(node_id=NodeId(f"n{idx}")))


def idxs(events: list[IndexedEvent]) -> list[int]:
    return [e.idx for e in events]


def test_in_order_arrivals_are_released_at_once() -> None:
    r = Reorderer(0)
    assert idxs(r.offer(ev(0))) == [0]
    assert idxs(r.offer(ev(1))) == [1]
    assert r.next_idx == 2
    assert r.missing() is None


def test_early_event_is_held_until_the_gap_fills() -> None:
    r = Reorderer(0)
    assert r.offer(ev(2)) == []
    assert r.missing() == (0, 1)
    assert r.offer(ev(1)) == []
    assert r.missing() == (0, 0)
    assert idxs(r.offer(ev(0))) == [0, 1, 2]
    assert r.missing() is None
    assert r.buffered == 0


def test_duplicates_and_stale_events_are_dropped() -> None:
    r = Reorderer(5)
    assert r.offer(ev(3)) == []
    assert idxs(r.offer(ev(5))) == [5]
    assert r.offer(ev(5)) == []
    assert r.offer(ev(7)) == []
    assert r.offer(ev(7)) == []
    assert r.buffered == 1
    assert idxs(r.offer(ev(6))) == [6, 7]


def test_missing_reports_only_the_first_gap() -> None:
    r = Reorderer(0)
    r.offer(ev(3))
    r.offer(ev(7))
    assert r.missing() == (0, 2)
    r.offer_all([ev(0), ev(1), ev(2)])
    assert r.missing() == (4, 6)


def test_offer_all_returns_everything_ready_in_order() -> None:
    r = Reorderer(10)
    assert idxs(r.offer_all([ev(12), ev(11), ev(10), ev(14)])) == [10, 11, 12]
    assert r.missing() == (13, 13)


def test_reset_jumps_forward_and_releases_buffered_tail() -> None:
    r = Reorderer(0)
    r.offer_all([ev(3), ev(8), ev(9), ev(11)])
    assert idxs(r.reset(8)) == [8, 9]
    assert r.next_idx == 10
    assert r.missing() == (10, 10)
    assert r.buffered == 1


def test_reset_never_moves_backwards() -> None:
    r = Reorderer(0)
    r.offer_all([ev(0), ev(1), ev(2)])
    assert r.reset(1) == []
    assert r.next_idx == 3


def test_bounded_buffer_keeps_the_events_nearest_delivery() -> None:
    r = Reorderer(0, max_buffered=3)
    r.offer_all([ev(5), ev(6), ev(7)])
    assert r.offer(ev(9)) == []  # farther than all: not kept
    r.offer(ev(2))  # nearer: evicts 7
    assert r.buffered == 3
    assert r.missing() == (0, 1)
    assert idxs(r.offer_all([ev(0), ev(1)])) == [0, 1, 2]
    assert r.missing() == (3, 4)


def test_rejects_negative_start() -> None:
    with pytest.raises(ValueError):
        Reorderer(-1)


@pytest.mark.parametrize("seed", range(20))
def test_any_permutation_with_duplicates_delivers_each_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    arrivals = [ev(i) for i in range(50)] + [ev(rng.randrange(50)) for _ in range(20)]
    rng.shuffle(arrivals)
    r = Reorderer(0)
    delivered = r.offer_all(arrivals)
    assert idxs(delivered) == list(range(50))
    assert r.missing() is None
