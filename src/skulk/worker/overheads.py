"""What this node's runners hold besides their weights and KV (their runtime overhead), as they measured it.

A runner's memory is its shard, its KV pool and a runtime: the interpreter, torch and its libraries, our kernels,
the tokenizer, warm-up's activations. That last part differs by machine (libraries, thread count) and by the
rank's role (the first rank compiles grammars and templates), so each node reports the figure its own runners
measured (runner/messages.Footprint) and placement counts it for this node's next ranks instead of a default.
"""

from __future__ import annotations

from skulk.types.backends import EngineName
from skulk.types.memory import Memory
from skulk.types.node_info import RankRole, RunnerOverhead


class OverheadMeter:
    """The latest measured overhead per engine and role (a new load replaces an older one's)."""

    def __init__(self) -> None:
        self._latest: dict[tuple[EngineName, RankRole], int] = {}

    def record(self, engine: EngineName, role: RankRole, overhead: int) -> None:
        self._latest[(engine, role)] = overhead

    def calibrated(self, engine: EngineName, role: RankRole, overhead: int) -> None:
        """The start-up calibration's figure (worker/calibrate.py), kept only where no runner measured first."""
        self._latest.setdefault((engine, role), overhead)

    def snapshot(self) -> list[RunnerOverhead] | None:
        """For node info (MemoryUsage.runner_overheads); None until a runner has measured."""
        if not self._latest:
            return None
        return [RunnerOverhead(engine=engine, role=role, overhead=Memory.from_bytes(overhead))
                for (engine, role), overhead in sorted(self._latest.items())]
