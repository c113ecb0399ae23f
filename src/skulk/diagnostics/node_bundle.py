"""This node's diagnostics bundle (seed 002's NodeDiagnostics), built from a handle onto the running node.

Supervisor views are copied on the event loop (they change there); the slow OS reads (process scan, live
memory, NVML) then run in a worker thread, and assembly is pure so tests can build a bundle from fakes.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

from skulk import __version__, structured_log
from skulk.config import Settings
from skulk.diagnostics.clock import iso, utc_now
from skulk.diagnostics.meta import meta_status
from skulk.diagnostics.processes import scan_processes
from skulk.diagnostics.resources import gather_resources
from skulk.diagnostics.supervisor_view import SupervisorLike, supervisor_diagnostics
from skulk.diagnostics.warnings import DEFAULT_THRESHOLDS, Thresholds, all_warnings
from skulk.types.diagnostics_bundle import (
    DiagnosticWarning,
    NodeDiagnostics,
    PlacementDiagnostics,
    PlacementRunnerDiagnostics,
    ProcessDiagnostics,
    ResourceDiagnostics,
    RunnerSupervisorDiagnostics,
    RuntimeDiagnostics,
    SkippedDesiredEntry,
    TaskDiagnostics,
)
from skulk.types.ids import NodeId, RunnerId
from skulk.types.instances import MlxRingInstance
from skulk.types.state import State
from skulk.worker import node_info


class CountingLog(Protocol):
    """What the bundle reads of the node's event log (eventlog.EventLog): whether it only counts, and why."""

    @property
    def counting_only(self) -> bool: ...
    @property
    def counting_reason(self) -> str | None: ...
    @property
    def counted_only(self) -> int: ...


class BundleSource(Protocol):
    """What the bundle needs from the node (api.services.ApiServices gives it): typed, never probed for."""

    @property
    def node_id(self) -> NodeId: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def state(self) -> State: ...
    @property
    def master_id(self) -> NodeId | None: ...
    @property
    def supervisors(self) -> Mapping[RunnerId, SupervisorLike]: ...
    @property
    def tracing_enabled(self) -> bool: ...
    @property
    def event_log(self) -> CountingLog | None:
        """None when the node keeps no event log (event_log.enabled off)."""
        ...
    @property
    def desired_skipped(self) -> Callable[[], Sequence[SkippedDesiredEntry]]: ...


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def runtime_diagnostics(source: BundleSource) -> RuntimeDiagnostics:
    """The process's view of itself: the first thing to compare when two nodes behave differently."""
    state, settings, master = source.state, source.settings, source.master_id
    ident = state.node_identities.get(source.node_id)
    logging_config = structured_log.live_config() or settings.logging  # what PUT /config turned on or off
    return RuntimeDiagnostics(
        node_id=source.node_id,
        hostname=socket.gethostname(),
        friendly_name=ident.friendly_name if ident else settings.node_name,
        is_master=master is not None and master == source.node_id,
        master_node_id=master,
        cwd=os.getcwd(),
        config_path=str(settings.config),
        config_file_exists=settings.config_exists,
        skulk_version=__version__,
        skulk_commit=node_info.skulk_commit(),
        libp2p_namespace=settings.libp2p_namespace,  # the variable's value or null, as the seed says
        python_unbuffered=_env_flag("PYTHONUNBUFFERED"),
        tracing_enabled=source.tracing_enabled,
        structured_logging_configured=logging_config.enabled,
        logging_ingest_url=logging_config.ingest_url,
        data_ports=f"{settings.data_port_range.start}-{settings.data_port_range.stop - 1}",
    )


def _instance_tasks(state: State, instance: MlxRingInstance, runner_id: str) -> list[TaskDiagnostics]:
    """Open tasks only: finished ones explain nothing about a hang and would grow without bound."""
    return [
        TaskDiagnostics(
            task_id=task.task_id,
            task_kind=type(task).__name__,
            task_status=task.task_status.value,
            instance_id=task.instance_id,
            command_id=task.command_id,
            runner_id=runner_id,
            model_id=task.model,
        )
        for task in state.tasks.values()
        if task.instance_id == instance.instance_id and task.task_status.is_open
    ]


def _placement(
    state: State, instance: MlxRingInstance, local: NodeId, master: NodeId | None, notes: list[str]
) -> PlacementDiagnostics:
    assignments = instance.shard_assignments
    meta = state.meta_instances.get(instance.meta_instance_id) if instance.meta_instance_id else None
    runners: list[PlacementRunnerDiagnostics] = []
    for node_id, runner_id in assignments.node_to_runner.items():
        shard = assignments.runner_to_shard[runner_id]
        status = state.runners.get(runner_id)
        ident = state.node_identities.get(node_id)
        runners.append(
            PlacementRunnerDiagnostics(
                runner_id=runner_id,
                node_id=node_id,
                friendly_name=ident.friendly_name if ident else None,
                status_kind=type(status).__name__ if status is not None else None,
                device_rank=shard.device_rank,
                world_size=shard.world_size,
                start_layer=shard.start_layer,
                end_layer=shard.end_layer,
                n_layers=shard.n_layers,
                is_local=node_id == local,
                is_master=node_id == master,
                tasks=_instance_tasks(state, instance, runner_id),
            )
        )
    runners.sort(key=lambda r: r.device_rank)
    nodes: list[str] = list(assignments.node_to_runner)
    return PlacementDiagnostics(
        instance_id=instance.instance_id,
        model_id=instance.model_id,
        master_node_id=master,
        master_is_placement_node=master in nodes,
        local_node_is_placement_node=local in nodes,
        placement_node_ids=nodes,
        runners=runners,
        warnings=notes,
        meta_instance_id=instance.meta_instance_id,
        meta_instance_status=meta_status(state, meta) if meta is not None else None,
    )


def placements(
    state: State, local: NodeId, master: NodeId | None, found: Sequence[DiagnosticWarning]
) -> list[PlacementDiagnostics]:
    return [
        _placement(state, inst, local, master, [str(w) for w in found if w.instance_id == iid])
        for iid, inst in sorted(state.instances.items())
    ]


def event_log_warnings(source: BundleSource) -> list[DiagnosticWarning]:
    """The event log's counting-only mode (runbook 004) is node-local: only the node's own bundle can say it."""
    event_log = source.event_log
    if event_log is None or not event_log.counting_only:
        return []
    message = (f"event log counting-only ({event_log.counting_reason}): {event_log.counted_only} events counted, "
               "not written; inference goes on. Free disk on this node.")
    return [DiagnosticWarning(code="event_log_counting_only", severity="critical", message=message,
                              node_id=source.node_id)]


def assemble(
    source: BundleSource,
    now: datetime,
    runners: list[RunnerSupervisorDiagnostics],
    processes: list[ProcessDiagnostics],
    resources: ResourceDiagnostics,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> NodeDiagnostics:
    """Pure once its inputs are read: warnings, placements and runtime from state and the runner copies."""
    state, master = source.state, source.master_id or source.state.master_node_id
    found = [*all_warnings(state, runners, now, thresholds), *event_log_warnings(source)]
    return NodeDiagnostics(
        generated_at=iso(now),
        runtime=runtime_diagnostics(source),
        identity=state.node_identities.get(source.node_id),
        resources=resources,
        processes=processes,
        supervisor_runners=runners,
        placements=placements(state, source.node_id, master, found),
        warnings=[str(w) for w in found if w.instance_id is None],
        warning_details=found,
        desired_state_skipped=list(source.desired_skipped()),
    )


def snapshot_runners(source: BundleSource, now: datetime) -> list[RunnerSupervisorDiagnostics]:
    """Call on the event loop that owns the supervisors."""
    state = source.state
    found = [supervisor_diagnostics(s, now, state) for s in list(source.supervisors.values())]
    return sorted(found, key=lambda r: (r.model_id, r.device_rank, r.runner_id))


def _os_reads(
    source: BundleSource, runners: list[RunnerSupervisorDiagnostics]
) -> tuple[list[ProcessDiagnostics], ResourceDiagnostics]:
    pids = {r.pid for r in runners if r.pid is not None}
    settings = source.settings
    return scan_processes(runner_pids=pids), gather_resources(source.state, source.node_id, settings.memory_limit,
                                                              settings.memory_reserve)


def build_node_bundle(source: BundleSource, now: datetime | None = None) -> NodeDiagnostics:
    """Synchronous variant for tests and scripts; blocks on OS reads."""
    now = now or utc_now()
    runners = snapshot_runners(source, now)
    processes, resources = _os_reads(source, runners)
    return assemble(source, now, runners, processes, resources)


async def collect_node_bundle(source: BundleSource) -> NodeDiagnostics:
    """For the API: supervisor copies on the loop, OS reads in a thread, so the loop never stalls."""
    now = utc_now()
    runners = snapshot_runners(source, now)
    processes, resources = await asyncio.to_thread(_os_reads, source, runners)
    return assemble(source, now, runners, processes, resources)
