"""Emulated link latency, for benchmarks only: SKULK_LINK_DELAY_MS holds every rank-to-rank message for a one-way
latency, without blocking the rank that sends it.

bench/split.py measures what a split costs over a LAN, but the kernels it runs on (Firecracker VMs) have no netem
qdisc, so `tc` can shape a link's bandwidth (tbf) and not its latency. This stands in for the missing delay, the
way netem would apply it: on the wire. A send is handed to one thread per rank (`DelayedSends`) that posts it
`delay` seconds later, in the order sent (the latency is the same for every message, so FIFO is arrival order);
the caller gets a handle it waits on like torch.distributed's own work, so the sender goes on computing its next
micro-batch as it would over a real link, and the receiver sees each message no earlier than sent + delay.
Holding the message on the sending side rather than stamping it on arrival is the same wire (the latency belongs
to neither end), and needs no receive posted ahead of time: a Pipeline rank learns a hidden state's shape only
from the header before it.

Collectives (a Tensor group's all-reduces and broadcasts) block every rank until they complete anyway, so they
are emulated where they finish: `after_collective` sleeps for the one-way steps a real link adds to them.

Unset (the default, and always in production) nothing here runs: the link keeps `None` and every send path
checks that one attribute.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from skulk.engines.link_delay import DELAY_ENV, emulated_delay_s

__all__ = ["DELAY_ENV", "DelayedSends", "Later", "after_collective", "emulated_delay_s"]


class Later:
    """A send the delay thread has not posted yet: `wait` waits for it to be posted, then for the send itself."""

    __slots__ = ("_error", "_posted", "_work")

    def __init__(self) -> None:
        self._posted = threading.Event()
        self._work: Any = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._posted.wait()
        if self._error is not None:
            raise self._error
        if self._work is not None:
            self._work.wait()

    def _done(self, work: Any, error: BaseException | None) -> None:
        self._work, self._error = work, error
        self._posted.set()


class DelayedSends:
    """One rank's outgoing messages, each posted `delay_s` after it was sent (module docstring)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._queue: deque[tuple[float, Callable[[], Any], Later]] = deque()
        self._ready = threading.Condition()
        threading.Thread(target=self._run, name="link-delay", daemon=True).start()

    def post(self, send: Callable[[], Any]) -> Later:
        """`send` posts the message (an isend, returning its work) and runs on the delay thread when due."""
        later = Later()
        with self._ready:
            self._queue.append((time.perf_counter() + self.delay_s, send, later))
            self._ready.notify()
        return later

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                due, send, later = self._queue[0]
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            with self._ready:
                self._queue.popleft()  # only this thread pops, and posts append behind it: still the head
            try:
                later._done(send(), None)
            except BaseException as exc:  # the sender sees it when it waits, as it would a failed isend
                later._done(None, exc)


def after_collective(delay_s: float, one_way_steps: int) -> None:
    """A collective just completed: what a real link would have added to it (blocking, as the collective is)."""
    if delay_s > 0 and one_way_steps > 0:
        time.sleep(delay_s * one_way_steps)
