"""Fakes for diagnostics tests: a supervisor with a real RunnerSpec and SupervisorView, a node handle."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from skulk.config import Settings
from skulk.runner.spec import RunnerSpec
from skulk.types.diagnostics import FlightRecorderEntry, Milestone, MlxMemorySnapshot
from skulk.types.diagnostics_bundle import ClusterTimelineRunner, SkippedDesiredEntry
from skulk.types.ids import InstanceId, NodeId, RunnerId, TaskId
from skulk.types.instances import MlxRingInstance, Sharding
from skulk.types.memory import Memory
from skulk.types.node_info import (
    AcceleratorInfo,
    DiskUsage,
    MemoryUsage,
    NetworkInfo,
    NetworkInterface,
    NodeIdentity,
    SystemPerformance,
)
from skulk.types.runners import RunnerPhase, RunnerRunning
from skulk.types.state import State
from skulk.types.tasks import TaskStatus
from skulk.worker.supervisor import SupervisorView

from .factories import chat_task, instance

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).isoformat()


@dataclass
class FakeSupervisor:
    spec: RunnerSpec
    view: SupervisorView = field(default_factory=SupervisorView)
    pid: int | None = 4242
    alive: bool = True
    restart_count: int = 0
    cancel_calls: list[TaskId] = field(default_factory=list)

    def cancel(self, task_id: TaskId) -> None:
        self.cancel_calls.append(task_id)


def spec_for(inst: MlxRingInstance, node: str) -> RunnerSpec:
    runner_id = inst.shard_assignments.node_to_runner[NodeId(node)]
    return RunnerSpec(
        node_id=NodeId(node),
        runner_id=runner_id,
        instance_id=inst.instance_id,
        shard=inst.shard_assignments.runner_to_shard[runner_id],  # type: ignore[arg-type]
        sharding=Sharding.Pipeline,
        model_dir=Path("/nonexistent"),
    )


def busy_supervisor(inst: MlxRingInstance, node: str, phase: RunnerPhase, seconds: float) -> FakeSupervisor:
    """A runner in `phase` for `seconds`, working on task t1, with a flight recorder and a memory snapshot."""
    sup = FakeSupervisor(spec_for(inst, node), pid=1000 + len(node))
    task = chat_task("t1", inst.instance_id)
    ctx = sup.spec.context(sup.pid)
    snapshot = MlxMemorySnapshot(generated_at=ago(seconds), active=Memory.from_bytes(1), source="psutil")
    view = sup.view
    view.status, view.status_since = RunnerRunning(), ago(seconds + 5)
    view.phase, view.phase_started_at, view.last_progress_at = phase, ago(seconds), ago(seconds)
    view.phase_detail = f"{phase} detail"
    view.in_progress[task.task_id] = task
    view.last_task_sent_at = ago(seconds + 6)
    view.last_event_received_at, view.last_event_type = ago(seconds), "Records"
    view.milestones.append(Milestone(at=ago(60), name="spawned", detail="pid 1"))
    for i, p in enumerate(("task_submission", phase)):
        view.flight_recorder.append(
            FlightRecorderEntry(
                at=ago(seconds + 1 - i),
                phase=p,  # type: ignore[arg-type]
                event=f"enter_{p}",
                attrs={"step": i},
                context=ctx,
                task_id=task.task_id,
                command_id=task.command_id,
                mlx_memory=snapshot if i else None,
            )
        )
    return sup


def cluster_state(nodes: tuple[str, ...] = ("n1", "n2"), master: str = "n1") -> State:
    inst = instance("inst", nodes)
    task = chat_task("t1", "inst").model_copy(update={"task_status": TaskStatus.Running})
    mem = MemoryUsage(ram_total=Memory.from_gb(16), ram_available=Memory.from_gb(8))
    net = {
        NodeId(n): NetworkInfo(interfaces=[NetworkInterface(name="eth0", ip_address=f"10.0.0.{i + 1}")])
        for i, n in enumerate(nodes)
    }
    return State(
        instances={InstanceId("inst"): inst},
        runners={r: RunnerRunning() for r in inst.shard_assignments.runner_to_shard},
        tasks={task.task_id: task},
        last_seen={NodeId(n): NOW for n in nodes},
        node_identities={NodeId(n): NodeIdentity(friendly_name=n, skulk_version="0.1.0") for n in nodes},
        node_memory={NodeId(n): mem for n in nodes},
        node_disk={
            NodeId(n): DiskUsage(total=Memory.from_gb(100), available=Memory.from_gb(50)) for n in nodes
        },
        node_system={NodeId(n): SystemPerformance(pcpu_usage=3.0) for n in nodes},
        node_accelerator={NodeId(n): AcceleratorInfo(vendor="cpu", name="cpu") for n in nodes},
        node_network=net,
        node_api_ports={NodeId(n): 52415 for n in nodes},
        master_node_id=NodeId(master),
    )


@dataclass
class FakeNode:
    """Satisfies diagnostics.node_bundle.BundleSource for the parts the diagnostics code touches."""

    node_id: NodeId
    state: State
    master_id: NodeId | None
    supervisors: dict[RunnerId, Any] = field(default_factory=dict)
    settings: Settings = field(default_factory=lambda: Settings(config=Path("/nonexistent/skulk.yaml")))
    tracing_enabled: bool = False
    departed_peers: dict[NodeId, Any] = field(default_factory=dict)
    event_log: Any = None
    desired_skipped: Callable[[], Sequence[SkippedDesiredEntry]] = tuple


def timeline_runner(
    node: str, rank: int, phase: RunnerPhase, seconds: float, **extra: Any
) -> ClusterTimelineRunner:
    fields: dict[str, Any] = {
        "node_id": node,
        "runner_id": f"r-{node}",
        "instance_id": "inst",
        "model_id": "test/model",
        "device_rank": rank,
        "world_size": 2,
        "pid": 100 + rank,
        "process_alive": True,
        "status_kind": "RunnerRunning",
        "phase": phase,
        "seconds_in_phase": seconds,
        "active_task_id": "t1",
    }
    return ClusterTimelineRunner(**{**fields, **extra})
