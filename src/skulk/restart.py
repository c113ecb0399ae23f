"""POST /admin/restart: the node stops in order (runners first, so accelerator memory is freed; the event log
flushed; its zenoh session closed) and then replaces its process image in place with os.execv: same pid, same
command line, a new node id (ids are per session), and it rejoins its cluster by itself (runbook 004)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("skulk.restart")

EXIT_DELAY_S = 0.2
"""Lets the HTTP answer that asked for the restart reach its client before the server stops."""


class RestartGate:
    """One restart at a time: a second request while one is pending is refused (409 at the API)."""

    def __init__(self) -> None:
        self.pending = False
        self._begin_exit: Callable[[], None] | None = None

    def arm(self, begin_exit: Callable[[], None]) -> None:
        """What starts the node's orderly stop (the API server's should_exit, as SIGTERM does)."""
        self._begin_exit = begin_exit

    def request(self, why: str) -> bool:
        if self.pending or self._begin_exit is None:
            return False
        self.pending = True
        log.warning("restarting in place (%s): stopping runners, then os.execv", why)
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, self._begin_exit)
        return True


def exec_self() -> NoReturn:
    """Replace this process with a fresh run of the same command line (same pid). execv skips the interpreter's
    exit, so first collect what the stopped runners left (their multiprocessing queues' semaphores unlink and
    unregister when collected): else the old image's resource tracker warns of leaked semaphores at the exec."""
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
