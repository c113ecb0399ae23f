"""A CPU load generator for the recovery benches: N pure-Python spinners beside the nodes (issue 38).

Recovery figures measured on a quiet machine did not hold on a busy one, and nothing told load from code apart.
`cpu_load(n)` starts n processes at nice 0 (the nodes' own priority: they compete as equals, as another
service's work on the same host would) that each keep one core busy until the block ends. Each spinner also
watches its parent and exits when it is gone, so even a bench killed with SIGKILL leaves none behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""
"""Checks its parent every ~10 ms of spinning: reparented (the bench died) means exit."""


def default_load() -> int:
    """One busy process per core: the 'machine's cores busy' of the issue."""
    return os.cpu_count() or 1


@contextmanager
def cpu_load(processes: int) -> Iterator[list[int]]:
    """`processes` spinners for the duration of the block (0: none); yields their pids. Always reaped."""
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            spinners.append(subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield [s.pid for s in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=10)


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, for the figures' header."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"
