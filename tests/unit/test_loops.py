"""Loops: a node's long-running tasks cannot die silently."""

from __future__ import annotations

import asyncio
import logging

import pytest

from skulk.loops import Loops


async def _forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


@pytest.mark.timeout(10)
async def test_a_loop_that_raises_stops_the_others_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    loops = Loops("node")
    started = asyncio.Event()
    survivor: list[asyncio.Task[None] | None] = []

    async def broken() -> None:
        await started.wait()
        raise RuntimeError("event sync died")

    async def body() -> None:
        survivor.append(loops.spawn(_forever(started)))
        loops.spawn(broken())
        await asyncio.Event().wait()  # serving until something stops us

    with caplog.at_level(logging.CRITICAL, logger="skulk.loops"):
        assert await loops.run(body) is True
    assert survivor[0] is not None and survivor[0].cancelled()
    assert "event sync died" in caplog.text
    assert "a loop of node died" in caplog.text


@pytest.mark.timeout(10)
async def test_a_body_that_returns_cancels_its_loops_cleanly() -> None:
    loops = Loops("node")
    started = asyncio.Event()
    spawned: list[asyncio.Task[None] | None] = []

    async def body() -> None:
        spawned.append(loops.spawn(_forever(started)))
        await started.wait()

    assert await loops.run(body) is False
    assert spawned[0] is not None and spawned[0].cancelled()


@pytest.mark.timeout(10)
async def test_nothing_is_spawned_after_the_loops_stopped() -> None:
    loops = Loops("node")

    async def body() -> None:
        return None

    assert await loops.run(body) is False
    assert loops.spawn(_forever(asyncio.Event())) is None
