"""Waiting on a condition a real node reports over HTTP, for tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    explain: Callable[[], str] | None = None,
    poll: float = 0.1,
) -> T:
    """Poll until check() is truthy and return it; fail with `what` (and `explain()`) at the deadline.

    Polling, not an event: the condition lives in another process and is only visible through its API.
    A benchmark timing time-to-condition passes a small poll, which bounds its resolution.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{explain()}" if explain else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(poll)
