"""Emulated link latency (engines/torch/delay.py, SKULK_LINK_DELAY_MS): every rank-to-rank message reaches its
receiver no earlier than the delay after it was sent, in the order sent, and the sender is never held."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from skulk.engines.torch import links as links_module
from skulk.engines.torch import wire as wire_module
from skulk.engines.torch.delay import DELAY_ENV, DelayedSends, emulated_delay_s
from skulk.engines.torch.links import GroupLink
from skulk.engines.torch.wire import Header, StepKind
from skulk.worker.links import LinkMeter

DELAY_S = 0.1
QUICK_S = DELAY_S / 2  # a call that returns within this did not wait out the delay (a loaded machine may be slow)


def gloo_pair() -> list[Any]:
    """Two ranks of a real gloo group in this process (one thread each to rendezvous)."""
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    groups: list[Any] = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.distributed_c10d.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert all(groups), "the gloo pair did not form"
    return groups


@pytest.mark.timeout(60)
def test_a_delayed_message_arrives_no_earlier_than_the_delay_and_the_sender_goes_on() -> None:
    sender, receiver = gloo_pair()
    delayed = DelayedSends(DELAY_S)
    messages = [torch.full((4,), float(i)) for i in range(3)]
    started = time.perf_counter()
    handles = [delayed.post(lambda m=m: sender.send([m], 1, 5)) for m in messages]
    posted = time.perf_counter() - started
    arrivals, got = [], []
    for _ in messages:
        into = torch.empty(4)
        receiver.recv([into], 0, 5).wait()
        arrivals.append(time.perf_counter() - started)
        got.append(into[0].item())
    for handle in handles:
        handle.wait()
    assert posted < QUICK_S, f"posting 3 sends held the sender {posted * 1000:.1f} ms"
    assert min(arrivals) >= DELAY_S, f"a message arrived {min(arrivals) * 1000:.1f} ms after it was sent"
    assert got == [0.0, 1.0, 2.0], "messages arrived out of order"


@pytest.mark.timeout(30)
def test_a_send_that_fails_on_the_delay_thread_raises_where_the_sender_waits() -> None:
    def refuse() -> Any:
        raise RuntimeError("peer gone")

    handle = DelayedSends(0.001).post(refuse)
    with pytest.raises(RuntimeError, match="peer gone"):
        handle.wait()


class Recorded:
    """dist.isend stand-in: when each message was posted, and a work that is already complete."""

    def __init__(self) -> None:
        self.at: list[tuple[float, int | None]] = []
        self.done = threading.Event()

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        self.at.append((time.perf_counter(), tag))
        self.done.set()
        return self

    def wait(self) -> None:
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank", [0, 1], ids=["scheduler-header-and-hidden", "sampler-tokens"])
def test_a_rank_under_the_delay_sends_everything_late_without_waiting(monkeypatch: pytest.MonkeyPatch,
                                                                     rank: int) -> None:
    monkeypatch.setenv(DELAY_ENV, str(DELAY_S * 1000))
    recorded = Recorded()
    monkeypatch.setattr(links_module.dist, "isend", recorded.isend)
    monkeypatch.setattr(wire_module.dist, "isend", recorded.isend)
    link = GroupLink(rank, 2, "pipeline", control_group=None)
    started = time.perf_counter()
    if rank == 0:
        link.send_header(Header(StepKind.DECODE))
        link.send_hidden(torch.zeros(1, 8))
    else:
        link.exchange_tokens([[7, 0, 0]], 1)
    returned = time.perf_counter() - started
    link.flush()
    assert returned < QUICK_S, f"the sends held rank {rank} {returned * 1000:.1f} ms"
    assert recorded.at and min(at for at, _ in recorded.at) - started >= DELAY_S
    assert len(recorded.at) == (2 if rank == 0 else 1)


def test_unset_means_no_emulation_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DELAY_ENV, raising=False)
    link = GroupLink(0, 2, "pipeline", control_group=None)
    assert link.delay is None and emulated_delay_s() == 0.0 and LinkMeter().emulated_rtt_ms == 0.0
    for bad in ("", "fast", "-1"):
        assert emulated_delay_s({DELAY_ENV: bad}) == 0.0
    monkeypatch.setenv(DELAY_ENV, "0.25")
    assert LinkMeter().emulated_rtt_ms == pytest.approx(0.5), "the round trip the node reports carries both ways"
