"""Heuristic warnings that point at why a distributed request is stuck.

Each check is a pure function of (state, runners, now, thresholds) → warnings, where `runners` are either
RunnerSupervisorDiagnostics (one node) or ClusterTimelineRunner (the whole cluster): both carry the fields
read here. Heuristics may be wrong; they say what they saw and leave the verdict to the operator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from skulk.diagnostics.clock import seconds_since
from skulk.types.diagnostics_bundle import DiagnosticWarning, WarningSeverity
from skulk.types.ids import TaskId
from skulk.types.runners import RunnerPhase, RunnerShutdown
from skulk.types.state import State

# Phases in which a rank waits on its peers; a rank stuck here while the others moved on is the classic hang.
BARRIER_PHASES: frozenset[RunnerPhase] = frozenset(
    {"task_agreement", "prefill_barrier", "decode_barrier", "decode_wait_first_token", "connect_group"}
)
# Phases that legitimately last as long as the generation does; judged by time since the last progress.
STREAMING_PHASES: frozenset[RunnerPhase] = frozenset({"prefill_stream", "decode_stream"})
SETTLED_PHASES: frozenset[RunnerPhase] = frozenset({"idle", "completion", "error", "shutdown_cleanup"})
# Event-sourced statuses in which the runner process must be up.
LIVE_STATUSES = frozenset(
    {"RunnerConnected", "RunnerLoading", "RunnerLoaded", "RunnerWarmingUp", "RunnerReady", "RunnerRunning"}
)


@dataclass(frozen=True)
class Thresholds:
    barrier_wait_s: float = 5.0
    phase_stuck_s: float = 60.0
    task_grace_s: float = 5.0


DEFAULT_THRESHOLDS = Thresholds()


class RunnerLike(Protocol):
    @property
    def node_id(self) -> str: ...
    @property
    def runner_id(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def device_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def process_alive(self) -> bool: ...
    @property
    def phase(self) -> RunnerPhase: ...
    @property
    def seconds_in_phase(self) -> float: ...
    @property
    def last_progress_at(self) -> str | None: ...
    @property
    def active_task_id(self) -> str | None: ...


Check = Callable[[State, Sequence[RunnerLike], datetime, Thresholds], list[DiagnosticWarning]]


def _held(r: RunnerLike, now: datetime) -> float:
    """How long a rank has waited: a stream since its last progress, any other phase since it began."""
    if r.phase in STREAMING_PHASES and r.last_progress_at:
        return seconds_since(r.last_progress_at, now)
    return r.seconds_in_phase


def _silent_stream(r: RunnerLike, now: datetime, th: Thresholds) -> bool:
    """A streaming rank with no progress past the barrier wait waits on a peer too: rank 0 of a pipelined
    Pipeline takes the sampler's tokens inside decode_stream (engines/torch/flight.py), not at a barrier phase."""
    return r.phase in STREAMING_PHASES and bool(r.last_progress_at) and _held(r, now) > th.barrier_wait_s


def rank_disagreement(
    state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds
) -> list[DiagnosticWarning]:
    """Ranks of one instance in different phases while one of them waits at a barrier too long."""
    by_instance: dict[str, list[RunnerLike]] = defaultdict(list)
    for runner in runners:
        by_instance[runner.instance_id].append(runner)
    found: list[DiagnosticWarning] = []
    for instance_id, ranks in sorted(by_instance.items()):
        if len({r.phase for r in ranks}) < 2:
            continue
        ranks.sort(key=lambda r: r.device_rank)  # before choosing: runners arrive in any order
        # once one rank has waited too long, name the lowest rank at a barrier, whether or not it has crossed the
        # threshold yet: which rank entered its barrier first is timing (a wedged rank 1 can take its header
        # before rank 0 finishes the prefill that leads rank 0 to wait), the lowest waiting rank is not
        waiting = [r for r in ranks if r.phase in BARRIER_PHASES or _silent_stream(r, now, th)]
        if not any(_held(r, now) > th.barrier_wait_s for r in waiting):
            continue
        layout = ", ".join(f"rank {r.device_rank}: {r.phase} {r.seconds_in_phase:.0f}s" for r in ranks)
        stuck = waiting[0]
        found.append(
            _about(
                stuck,
                "rank_disagreement",
                f"ranks of instance {instance_id[:8]} disagree ({layout}); rank "
                f"{stuck.device_rank} waits at {stuck.phase} for a peer that is elsewhere",
                severity="critical",
            )
        )
    return found


def phase_stuck(state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds) -> list[DiagnosticWarning]:
    """A phase held past the threshold while a task is active; streams count from their last progress."""
    found: list[DiagnosticWarning] = []
    for r in runners:
        if r.active_task_id is None or r.phase in SETTLED_PHASES:
            continue
        if r.phase in STREAMING_PHASES and r.last_progress_at:
            held = seconds_since(r.last_progress_at, now)
        else:
            held = r.seconds_in_phase
        if held <= th.phase_stuck_s:
            continue
        found.append(
            _about(
                r,
                "phase_stuck",
                f"rank {r.device_rank} of instance {r.instance_id[:8]} has been in {r.phase} "
                f"for {held:.0f}s with task {r.active_task_id[:8]} active",
            )
        )
    return found


def master_outside_placement(
    state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds
) -> list[DiagnosticWarning]:
    """Commands and events for the instance cross to a master that does not run it; worth knowing."""
    master = state.master_node_id
    if master is None:
        return []
    return [
        DiagnosticWarning(
            code="master_outside_placement",
            severity="info",
            message=f"master {master[:8]} is not one of the nodes of instance {instance_id[:8]}",
            node_id=master,
            instance_id=instance_id,
        )
        for instance_id, instance in sorted(state.instances.items())
        if master not in instance.shard_assignments.node_to_runner
    ]


def task_mismatch(
    state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds
) -> list[DiagnosticWarning]:
    """A runner working on a task the state does not know, or one the state says is already over."""
    found: list[DiagnosticWarning] = []
    for r in runners:
        task_id = r.active_task_id
        if task_id is None or r.phase in SETTLED_PHASES or r.seconds_in_phase <= th.task_grace_s:
            continue
        task = state.tasks.get(TaskId(task_id))
        if task is None:
            code, what = "runner_task_unknown", "which the cluster state does not know"
        elif not task.task_status.is_open:
            code, what = "runner_task_finished", f"which the cluster state says is {task.task_status.value}"
        else:
            continue
        found.append(
            _about(
                r,
                code,
                f"rank {r.device_rank} of instance {r.instance_id[:8]} is in {r.phase} for task {task_id[:8]}, {what}",
            )
        )
    return found


def _state_status(state: State, runner_id: str) -> str | None:
    status = state.runners.get(runner_id)  # type: ignore[call-overload]
    return type(status).__name__ if status is not None else None


def process_mismatch(
    state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds
) -> list[DiagnosticWarning]:
    """The process and the state disagree: alive but gone in state, or dead but live in state."""
    found: list[DiagnosticWarning] = []
    for r in runners:
        status = _state_status(state, r.runner_id)
        if r.process_alive and (status is None or status == RunnerShutdown.__name__):
            code, what = (
                "runner_process_orphaned",
                f"is alive but the cluster state has it {status or 'gone'}",
            )
        elif not r.process_alive and status in LIVE_STATUSES:
            code, what = "runner_process_dead", f"is not running but the cluster state has it {status}"
        else:
            continue
        found.append(_about(r, code, f"runner {r.runner_id[:8]} (rank {r.device_rank} of {r.instance_id[:8]}) {what}"))
    return found


def version_mismatch(
    state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds
) -> list[DiagnosticWarning]:
    """Nodes on different Skulk versions may disagree on the wire format or the sharding arithmetic."""
    versions = {
        node: ident.skulk_version for node, ident in state.node_identities.items() if ident.skulk_version != "Unknown"
    }
    if len(set(versions.values())) < 2:
        return []
    listing = ", ".join(f"{node[:8]}={version}" for node, version in sorted(versions.items()))
    return [
        DiagnosticWarning(
            code="version_mismatch",
            severity="warning",
            message=f"nodes run different Skulk versions: {listing}",
        )
    ]


def _about(runner: RunnerLike, code: str, message: str, severity: WarningSeverity = "warning") -> DiagnosticWarning:
    """A warning that points at one runner, so the reader can go straight to its node and instance."""
    return DiagnosticWarning(
        code=code,
        severity=severity,
        message=message,
        node_id=runner.node_id,
        instance_id=runner.instance_id,
        runner_id=runner.runner_id,
    )


CHECKS: tuple[Check, ...] = (
    rank_disagreement,
    phase_stuck,
    master_outside_placement,
    task_mismatch,
    process_mismatch,
    version_mismatch,
)


def all_warnings(
    state: State, runners: Sequence[RunnerLike], now: datetime, th: Thresholds = DEFAULT_THRESHOLDS
) -> list[DiagnosticWarning]:
    return [w for check in CHECKS for w in check(state, runners, now, th)]
