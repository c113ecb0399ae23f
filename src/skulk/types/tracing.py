"""Runtime tracing's data: one span of one rank's (or the API node's) work on one task (runbook 004)."""

from __future__ import annotations

from .base import CamelModel


class TraceSpan(CamelModel):
    """start_us is wall-clock microseconds since the epoch, so spans of several nodes line up on one timeline
    (as well as their clocks agree). rank None: the API node's own work (streaming to the client)."""

    task_id: str
    name: str
    category: str
    rank: int | None = None
    node_id: str | None = None
    start_us: int
    duration_us: int
    args: dict[str, int | float | str] = {}
