"""cluster/transport.HandOver: zenoh threads' messages reach the loop in order, a burst with one wake-up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from skulk.cluster.transport import HandOver

pytestmark = pytest.mark.timeout(30)


async def test_a_burst_from_another_thread_arrives_in_order_with_fewer_wakeups() -> None:
    """A thread hands over 200 messages back to back while the loop is busy: all arrive, in order, and they
    ride fewer wake-ups than messages (the loop cannot run the first wake-up before the burst is queued)."""
    loop = asyncio.get_running_loop()
    hand_over = HandOver(loop)
    seen: list[int] = []
    done = asyncio.Event()

    def on_message(n: int) -> None:
        seen.append(n)
        if n == 199:
            done.set()

    sender = threading.Thread(target=lambda: [hand_over(on_message, n) for n in range(200)])
    sender.start()
    sender.join()  # the loop is blocked here, so every message is queued before the first wake-up runs
    await asyncio.wait_for(done.wait(), 10)
    assert seen == list(range(200))
    assert hand_over.wakeups == 1


async def test_a_callback_that_raises_does_not_drop_the_rest_of_its_burst() -> None:
    loop = asyncio.get_running_loop()
    reported: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    hand_over = HandOver(loop)
    seen: list[str] = []
    done = asyncio.Event()

    def broken(_: str) -> None:
        raise ValueError("bad message")

    hand_over(seen.append, "a")
    hand_over(broken, "b")
    hand_over(seen.append, "c")
    hand_over(lambda _: done.set(), "d")
    await asyncio.wait_for(done.wait(), 10)
    assert seen == ["a", "c"]
    assert [str(e) for e in reported] == ["bad message"]
    hand_over(seen.append, "e")  # the next burst arms a new wake-up
    await asyncio.sleep(0)
    assert seen == ["a", "c", "e"] and hand_over.wakeups == 2


def test_a_message_after_the_loop_closed_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    hand_over = HandOver(loop)
    loop.close()
    hand_over(print, "never")  # no RuntimeError from a node shutting down
