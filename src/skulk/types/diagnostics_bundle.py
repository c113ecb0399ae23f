"""Diagnostics bundles on the wire (seeds 000, 001, 002): node bundle, cluster bundle, timeline, node health.

Every field name, type and default here is contract: camelCase on the wire, snake_case in Python. The models
are read-only views built on demand from live supervisor state and the event-sourced `State`; none of them
is ever gossiped or stored. Extra fields beyond the seeds (`warningDetails`, `resources.accelerator`) are
additive, so clients written against the seeds keep working.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field

from .diagnostics import DiagModel, FlightRecorderEntry, Milestone, MlxMemorySnapshot
from .memory import Memory
from .node_info import (
    AcceleratorInfo,
    DiskUsage,
    MemoryUsage,
    NetworkInfo,
    NodeIdentity,
    SystemPerformance,
)
from .runners import RunnerPhase

# -- seed 001: one runner as its supervisor sees it -------------------------------------------------------


class TaskDiagnostics(DiagModel):
    """A task as the supervisor (inProgressTasks) or the event-sourced state (placement tasks) knows it."""

    task_id: str
    task_kind: str
    task_status: str
    instance_id: str
    command_id: str | None = None
    runner_id: str | None = None
    model_id: str | None = None


class RunnerSupervisorDiagnostics(DiagModel):
    """Live runner-supervisor state that is not event-sourced."""

    runner_id: str
    instance_id: str
    node_id: str
    model_id: str
    device_rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int
    pid: int | None = None
    process_alive: bool
    exit_code: int | None = None
    status_kind: str
    status_since: str
    seconds_in_status: float
    phase: RunnerPhase
    phase_started_at: str
    seconds_in_phase: float
    last_progress_at: str | None = None
    active_task_id: str | None = None
    active_command_id: str | None = None
    phase_detail: str | None = None
    last_mlx_memory: MlxMemorySnapshot | None = None
    flight_recorder: list[FlightRecorderEntry] = []
    pending_task_ids: list[str] = []
    in_progress_tasks: list[TaskDiagnostics] = []
    completed_task_count: int
    cancelled_task_ids: list[str] = []
    last_task_sent_at: str | None = None
    last_event_received_at: str | None = None
    last_event_type: str | None = None
    milestones: list[Milestone] = []


# -- seed 000: one runner in the cluster timeline ---------------------------------------------------------


class ClusterTimelineRunner(DiagModel):
    """Compact current-state synopsis of one runner: rank, phase and time stuck in it, side by side."""

    node_id: str
    runner_id: str
    instance_id: str
    model_id: str
    device_rank: int
    world_size: int
    pid: int | None = None
    process_alive: bool
    status_kind: str
    phase: RunnerPhase
    phase_detail: str | None = None
    seconds_in_phase: float
    last_progress_at: str | None = None
    active_task_id: str | None = None
    active_command_id: str | None = None
    last_mlx_memory: MlxMemorySnapshot | None = None


# -- seed 002: the node bundle ----------------------------------------------------------------------------


class RuntimeDiagnostics(DiagModel):
    node_id: str
    hostname: str
    friendly_name: str | None = None
    is_master: bool
    master_node_id: str | None = None
    cwd: str
    config_path: str
    config_file_exists: bool
    skulk_version: str
    skulk_commit: str
    # to_camel would write "libp2pNamespace"; the seed spells it "libp2PNamespace".
    libp2p_namespace: str | None = Field(
        default=None,
        serialization_alias="libp2PNamespace",
        validation_alias=AliasChoices("libp2PNamespace", "libp2p_namespace"),
    )
    python_unbuffered: bool
    tracing_enabled: bool
    structured_logging_configured: bool
    logging_ingest_url: str | None = None
    data_ports: str | None = None
    """The range this node's master draws multi-rank rendezvous ports from (Settings.data_ports), FIRST-LAST."""


class SystemDiagnostics(SystemPerformance):
    """The seed nests the accelerator reading inside `system`."""

    accelerator: AcceleratorInfo | None = None


class ResourceDiagnostics(DiagModel):
    """Gathered (event-sourced, what placement saw) beside current (read now by this process)."""

    gathered_memory: MemoryUsage | None = None
    current_memory: MemoryUsage | None = None
    current_wired: Memory | None = None
    disk: DiskUsage | None = None
    system: SystemDiagnostics | None = None
    accelerator: AcceleratorInfo | None = None
    network: NetworkInfo | None = None


ProcessRole = Literal["skulk", "runner", "vector", "python", "other"]


class ProcessDiagnostics(DiagModel):
    pid: int
    parent_pid: int | None = None
    role: ProcessRole
    command: str
    status: str | None = None
    cpu_percent: float | None = None
    memory_percent: float | None = None
    rss: Memory | None = None
    elapsed_seconds: float | None = None
    is_child_of_skulk: bool = False


class PlacementRunnerDiagnostics(DiagModel):
    runner_id: str
    node_id: str
    friendly_name: str | None = None
    status_kind: str | None = None
    device_rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int
    is_local: bool
    is_master: bool
    tasks: list[TaskDiagnostics] = []


class PlacementDiagnostics(DiagModel):
    instance_id: str
    model_id: str
    master_node_id: str | None = None
    master_is_placement_node: bool
    local_node_is_placement_node: bool
    placement_node_ids: list[str] = []
    runners: list[PlacementRunnerDiagnostics] = []
    warnings: list[str] = []
    meta_instance_id: str | None = None
    """Beyond seed 002: the MetaInstance this instance backs, and how that MetaInstance stands."""
    meta_instance_status: str | None = None


WarningSeverity = Literal["info", "warning", "critical"]


class DiagnosticWarning(DiagModel):
    """One heuristic finding; the seed's `warnings: string[]` carry `str(warning)`."""

    code: str
    severity: WarningSeverity
    message: str
    node_id: str | None = None
    instance_id: str | None = None
    runner_id: str | None = None

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.message}"


class SkippedDesiredEntry(DiagModel):
    """One part of `<home>/desired.json` the node could not restore (state/desired.py), and where the file it
    read was kept aside (`desired.json.corrupt-<time>`), so the operator can mend it by hand."""

    entry: str
    """`metaInstances.<id>`, `modelCards.<id>`, `tracingEnabled`, or `file` when the whole file was unreadable."""
    reason: str
    kept_at: str | None = None


class NodeDiagnostics(DiagModel):
    generated_at: str
    runtime: RuntimeDiagnostics
    identity: NodeIdentity | None = None
    resources: ResourceDiagnostics
    processes: list[ProcessDiagnostics] = []
    supervisor_runners: list[RunnerSupervisorDiagnostics] = []
    placements: list[PlacementDiagnostics] = []
    warnings: list[str] = []
    warning_details: list[DiagnosticWarning] = []
    desired_state_skipped: list[SkippedDesiredEntry] = []
    """Not in seed 002: entries of this node's saved desired state it skipped at start (empty when all came back)."""


class ClusterNodeDiagnostics(DiagModel):
    node_id: str
    url: str | None = None
    ok: bool
    diagnostics: NodeDiagnostics | None = None
    error: str | None = None


class ClusterDiagnostics(DiagModel):
    generated_at: str
    local_node_id: str
    master_node_id: str | None = None
    nodes: list[ClusterNodeDiagnostics] = []


# -- the cluster timeline response ------------------------------------------------------------------------


class TimelineEntry(FlightRecorderEntry):
    """A flight-recorder entry merged across nodes; `nodeId` says whose supervisor kept it."""

    node_id: str


class ClusterTimeline(DiagModel):
    generated_at: str
    runners: list[ClusterTimelineRunner] = []
    entries: list[TimelineEntry] = []
    unreachable_nodes: list[str] = []
    warnings: list[DiagnosticWarning] = []


# -- /state nodeHealth ------------------------------------------------------------------------------------

HealthLevel = Literal["healthy", "degraded", "unhealthy"]
HealthCode = Literal["download_failed", "disk_full", "disk_low", "unreachable", "event_log_counting_only", "memory_oom",
                     "memory_paging"]


class HealthReason(DiagModel):
    code: HealthCode
    message: str
    remediation: str


class NodeHealth(DiagModel):
    level: HealthLevel = "healthy"
    reasons: list[HealthReason] = []
