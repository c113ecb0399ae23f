"""A node's long-running loops under one asyncio.TaskGroup, so that none of them can die silently.

A bare `create_task` whose coroutine raises only logs "Task exception was never retrieved" when it is garbage
collected, and the node goes on answering HTTP with, say, its event sync dead. Here an exception escaping any
loop cancels the others and is logged CRITICAL with its traceback; the caller then stops the node non-zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger("skulk.loops")


class Loops:
    """spawn() loops while run() is active; run() returns whether any of them (or the body) failed."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._group: asyncio.TaskGroup | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
        """Start coro under the group; once the group is closed the coroutine is closed unrun (None)."""
        if self._group is None:
            coro.close()
            return None
        task = self._group.create_task(coro)
        self._tasks = [t for t in self._tasks if not t.done()] + [task]
        return task

    def cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def wait_cancelled(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def run(self, body: Callable[[], Awaitable[None]]) -> bool:
        """Run body (which spawns the loops); when it returns, cancel the loops. True if anything raised."""
        failed = False
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                await body()
                self.cancel_all()
        except* Exception as errors:
            for error in errors.exceptions:
                log.critical("a loop of %s died; stopping it", self.owner, exc_info=error)
            failed = True
        finally:
            self._group = None
        return failed
