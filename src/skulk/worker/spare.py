"""A spare runner: one runner process started before it is needed, its engine's modules already imported.

Issue 38: after a shard holder's `kill -9` or a full restart, most of the time to the first token went to the
replacement runner's start: a fresh interpreter importing torch and transformers (2.7 CPU-s) before it could read
30 MB of weights, 6-13 s with two ranks and other work sharing two cores. A node keeps one spare, spawned once its
start is behind it (the node asks at each info round) and again SPARE_AFTER_START_S after each runner is ready,
never while a runner of it is still loading (the imports would compete with it). A supervisor takes it instead of
spawning (`take`), and sends it the runner's spec as its first message (runner.main.spare_main). The spare is the
node's own child, like every runner, so it exits with the node, even after a `kill -9`.

It costs memory: the imported modules, about 265 MB resident. A node keeps one only where SKULK_SPARE_RUNNER is on
(the default), never in its first SPARE_AFTER_START_S, and only while SPARE_MIN_AVAILABLE is available. What it
holds is offered to placement as free (memory_limit.budget's standby): the runner that takes it brings no new
process, and placement already counts that runner's runtime.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from skulk import memory_limit
from skulk.runner.channel import Mailbox

log = logging.getLogger("skulk.worker")

SPARE_MIN_AVAILABLE = 4 * 1024**3
"""Below this much available memory a node keeps no spare: a small host's memory is for the model."""
SPARE_AFTER_START_S = 20.0
"""No spare in a node's first seconds: its imports would compete with the start itself. Measured (bench/recovery.py
--spare both --load 2, two spinners on two cores): a spare spawned as the node joined delayed a full restart's
first placement by 5.5 s (the nodes' first info and link probes starved) and saved 3.7 s of load, so the restart's
first token came 2.6 s later; after a shard holder's kill, where the nodes had been up for a while, it shortened
the replacement's load. SKULK_SPARE_AFTER_S overrides it (tests)."""
SPARE_AFTER_ENV = "SKULK_SPARE_AFTER_S"


def spare_engine(engines: Sequence[str], platform: str = sys.platform) -> str:
    """The engine a spare imports: the first the node is told to offer (SKULK_ENGINES), else MLX on a Mac (Metal)
    and torch elsewhere, the engines placement gives such a node's ranks."""
    if engines:
        return engines[0]
    return "mlx" if platform == "darwin" else "torch"


def _after_start_s() -> float:
    try:
        return max(0.0, float(os.environ.get(SPARE_AFTER_ENV, SPARE_AFTER_START_S)))
    except ValueError:
        log.warning("%s is not a number of seconds; using %.0f", SPARE_AFTER_ENV, SPARE_AFTER_START_S)
        return SPARE_AFTER_START_S


@dataclass(frozen=True)
class WarmProcess:
    """A spare taken by a supervisor: the started process, the node's end of its inbox and the read end of its
    outbox pipe."""

    process: Any
    inbox: Mailbox
    outbox: Any


class SpareRunner:
    """At most one spare runner process for the engine the node prefers; refilled on request."""

    def __init__(self, engine: str, *, enabled: bool = True, min_available: int = SPARE_MIN_AVAILABLE,
                 after_s: float | None = None) -> None:
        self.engine = engine
        self.enabled = enabled
        self.min_available = min_available
        self.after_s = after_s if after_s is not None else _after_start_s()
        self.not_before = time.monotonic() + self.after_s
        """No spare before this (monotonic): the node's start-up, or a runner's first requests after it became
        ready (`hold_off`), is not shared with the spare's imports."""
        self._ctx = mp.get_context("spawn")
        self._warm: WarmProcess | None = None
        self._closed = False
        self._said_no_room = False

    def fill(self) -> None:
        """Spawn a spare if there is none, the node keeps one, and memory allows. Never blocks on its imports."""
        if self._closed or not self.enabled or (self._warm is not None and self._warm.process.is_alive()):
            return
        if time.monotonic() < self.not_before:
            return
        if memory_limit.available_now() < self.min_available:
            if not self._said_no_room:
                log.info("no spare runner: less than %d MiB available", self.min_available // 2**20)
                self._said_no_room = True
            return
        from skulk.runner.main import spare_main

        if self._warm is not None:  # the last spare died idle (an OOM kill, say): its pipe's read end goes with it
            self._warm.outbox.close()
            self._warm = None
        letters, mail = self._ctx.Pipe(duplex=False)
        outbox, pipe = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=spare_main, args=(self.engine, letters, pipe, os.getpid()),
                                    name="skulk-runner-spare")
        try:
            process.start()
        finally:
            pipe.close()  # the spare holds the write ends' other sides: its exit reads as the end of the pipe here
            letters.close()
        self._warm = WarmProcess(process, Mailbox(mail), outbox)

    def resident(self) -> int:
        """The spare's resident bytes (0 without one): what the node's memory budget counts as free for the runner
        that will take it (memory_limit.budget)."""
        warm = self._warm
        if warm is None or warm.process.pid is None:
            return 0
        try:
            return int(psutil.Process(warm.process.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def hold_off(self) -> None:
        """A runner just became ready: no spare for after_s more (its first requests, often a client's retry after
        a failure, would share the cores with the spare's imports: the first token came 1 s later under load)."""
        self.not_before = max(self.not_before, time.monotonic() + self.after_s)

    def take(self, engine: str) -> WarmProcess | None:
        """The spare, for a runner of `engine`, if one is alive and imported that engine's modules; it is no
        longer the pool's (the caller sends it its spec first, and owns it from then)."""
        warm = self._warm
        if warm is None or engine != self.engine or not warm.process.is_alive():
            return None
        self._warm = None
        return warm

    def close(self) -> None:
        """The node stops: an untaken spare is stopped (a `None` on its inbox ends it; killed if it is still
        importing) and none is spawned again."""
        self._closed = True
        warm, self._warm = self._warm, None
        if warm is None:
            return
        try:
            warm.inbox.put(None)
        except (OSError, ValueError):
            pass
        warm.process.join(timeout=0.5)
        if warm.process.is_alive():
            warm.process.kill()
            warm.process.join(timeout=5)
        warm.outbox.close()
