"""What a request that hears nothing is waiting for, and what its API node decides about it (api/patience.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class WaitingOn(StrEnum):
    """Why a stream heard nothing: each ends, when it ends, with its own message."""

    unassigned = "unassigned"
    """No task yet: the master has not handed the request to an instance."""
    loading = "loading"
    """Its instance's runners are not all ready (loading, warming up, restarting)."""
    queue = "queue"
    """Its instance is serving other requests: this one waits its turn (queued, or preempted)."""
    silent_runner = "silent_runner"
    """Its instance says it is ready yet produced nothing for anyone."""


@dataclass(frozen=True, slots=True)
class WaitFacts:
    """What the API node knows when a stream's wait runs out (gathered by api/patience.py's shell)."""

    waited_s: float
    """Since the request started (no chunk yet) or since its last chunk."""
    assigned: bool
    """The state has the request's task (an instance took it)."""
    serving: bool
    """Every rank of that instance is ready or running."""
    heard_ago_s: float | None
    """Since any stream of that instance on this node last received a chunk; None: none did while this waited."""
    ahead: int
    """Open tasks on that instance that are older than this request's."""
    queue_moved: bool
    """Fewer tasks are ahead than at the previous check: the instance finished someone's request meanwhile."""


@dataclass(frozen=True, slots=True)
class Patience:
    """The bounds of a wait. `silence_s`: how long an instance may produce nothing for anyone (or load) before a
    request gives up on it; `queued_s`: how long a request may wait while its instance serves others;
    `recheck_s`: how often a waiting request looks again."""

    silence_s: float
    queued_s: float
    recheck_s: float


@dataclass(frozen=True, slots=True)
class KeepWaiting:
    for_s: float
    on: WaitingOn


@dataclass(frozen=True, slots=True)
class GiveUp:
    on: WaitingOn
    silent_s: float
    """How long what it waited on was silent (the request's own wait, or less where others were heard lately)."""
