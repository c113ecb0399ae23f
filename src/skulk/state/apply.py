"""The one place state changes: apply(state, indexed_event) -> state. Pure; no I/O, no clocks."""

from __future__ import annotations

from typing import Any

from skulk.state import meta
from skulk.types.downloads import DownloadProgress
from skulk.types.events import (
    DesiredStateRestored,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceFailed,
    InstanceRetrying,
    MetaInstanceCreated,
    MetaInstanceDeleted,
    MetaInstancePlacementFailed,
    ModelCardAdded,
    NodeDownloadProgress,
    NodeGatheredInfo,
    NodeRestartRequested,
    NodeTimedOut,
    RunnerDeleted,
    RunnerStatusUpdated,
    SessionStarted,
    TaskCreated,
    TaskFailed,
    TaskStatusUpdated,
    TopologyEdgeCreated,
    TopologyEdgeDeleted,
    TracingStateChanged,
)
from skulk.types.ids import InstanceId, ModelId, NodeId, RunnerId
from skulk.types.instances import Instance
from skulk.types.node_info import Topology
from skulk.types.runners import RunnerFailed, RunnerStatus
from skulk.types.state import RETRY_TIMES_KEPT, InstanceRetries, State
from skulk.types.tasks import TaskStatus

FINISHED_TASKS_KEPT = 64
"""Finished tasks stay visible in /state for a while; older ones are dropped so state stays bounded."""


def apply(state: State, indexed: IndexedEvent) -> State:
    if indexed.idx != state.last_event_applied_idx + 1:
        raise ValueError(f"event {indexed.idx} applied to state at {state.last_event_applied_idx}")
    changes = _changes(state, indexed.event)
    changes["last_event_applied_idx"] = indexed.idx
    return state.model_copy(update=changes)


def _changes(state: State, event: Event) -> dict[str, Any]:
    match event:
        case InstanceCreated(instance=instance):
            created = {"instances": {**state.instances, instance.instance_id: instance}}
            return {**created, **meta.backing_created(state, instance)}
        case InstanceDeleted(instance_id=instance_id, failure_error=error):
            return {**meta.backing_failed(state, instance_id, error), **_delete_instance(state, instance_id)}
        case RunnerStatusUpdated(runner_id=runner_id, runner_status=status):
            return _runner_status(state, runner_id, status)
        case RunnerDeleted(runner_id=runner_id):
            return {"runners": _without(state.runners, runner_id)}
        case TaskCreated(task=task):
            return {"tasks": {**state.tasks, task.task_id: task}}
        case TaskStatusUpdated(task_id=task_id, task_status=status):
            return _task_update(state, task_id, task_status=status)
        case TaskFailed(task_id=task_id, error_message=message):
            return _task_update(state, task_id, task_status=TaskStatus.Failed, error_message=message)
        case NodeGatheredInfo():
            return _node_info(state, event)
        case NodeTimedOut(node_id=node_id):
            return _forget_node(state, node_id)
        case TopologyEdgeCreated(connection=conn):
            topo = state.topology
            if conn in topo.connections or conn.source not in topo.nodes or conn.sink not in topo.nodes:
                return {}  # an edge to or from a forgotten node (probed before NodeTimedOut) would never go
            return {"topology": topo.model_copy(update={"connections": [*topo.connections, conn]})}
        case TopologyEdgeDeleted(connection=conn):
            topo = state.topology
            kept = [c for c in topo.connections if c != conn]
            return {"topology": topo.model_copy(update={"connections": kept})}
        case SessionStarted(master_node_id=master, term=term):
            return {"master_node_id": master, "term": term}
        case InstanceRetrying(instance_id=instance_id, failure_error=error):
            return {**meta.backing_failed(state, instance_id, error), **_retry_instance(state, event)}
        case MetaInstanceCreated(meta_instance=created):
            return meta.meta_created(state, created)
        case MetaInstanceDeleted(meta_instance_id=meta_instance_id):
            return meta.meta_deleted(state, meta_instance_id)
        case MetaInstancePlacementFailed(meta_instance_id=meta_instance_id, reason=reason):
            return meta.placement_failed(state, meta_instance_id, reason)
        case ModelCardAdded(card=card):
            return {"model_cards": {**state.model_cards, card.model_id: card}}
        case InstanceFailed(instance_id=instance_id, failure_error=error):
            if instance_id not in state.instances:
                return {}
            retries = state.instance_retries.get(instance_id, InstanceRetries())
            return _with_retries(state, instance_id, retries.model_copy(update={"failed": error}))
        case NodeDownloadProgress(node_id=node_id, model_id=model_id, progress=progress):
            return _download_progress(state, node_id, model_id, progress)
        case TracingStateChanged(enabled=enabled):
            return {"tracing_enabled": enabled}
        case NodeRestartRequested():
            return {}
        case DesiredStateRestored(restored=restored):
            return {"desired_restored": restored}
    raise TypeError(f"no rule to apply {type(event).__name__}")


def _without(mapping: dict[Any, Any], key: Any) -> dict[Any, Any]:
    return {k: v for k, v in mapping.items() if k != key}


def _instance_of(state: State, runner_id: RunnerId) -> Instance | None:
    return next((i for i in state.instances.values() if runner_id in i.shard_assignments.runner_to_shard), None)


def _runner_status(state: State, runner_id: RunnerId, status: RunnerStatus) -> dict[str, Any]:
    """Statuses of runners no instance holds are late reports: ignored. So is a failure of a runner started for
    an older attempt of a retrying instance: that failure has been answered already."""
    instance = _instance_of(state, runner_id)
    if instance is None:
        return {}
    retries = state.instance_retries.get(instance.instance_id)
    if isinstance(status, RunnerFailed) and retries is not None and status.attempt < retries.attempt:
        return {}
    return {"runners": {**state.runners, runner_id: status}}


def _with_retries(state: State, instance_id: InstanceId, retries: InstanceRetries) -> dict[str, Any]:
    return {"instance_retries": {**state.instance_retries, instance_id: retries}}


def _retry_instance(state: State, event: InstanceRetrying) -> dict[str, Any]:
    """Removes the instance's runners, keeps the instance, counts the attempt; a missing instance: no-op."""
    instance = state.instances.get(event.instance_id)
    if instance is None:
        return {}
    gone = instance.shard_assignments.runner_to_shard.keys()
    old = state.instance_retries.get(event.instance_id, InstanceRetries())
    recent = [*old.recent, event.at] if event.at is not None else old.recent
    retries = InstanceRetries(
        attempt=old.attempt + 1, recent=recent[-RETRY_TIMES_KEPT:], last_error=event.failure_error
    )
    return {
        "runners": {r: s for r, s in state.runners.items() if r not in gone},
        **_with_retries(state, event.instance_id, retries),
    }


def _delete_instance(state: State, instance_id: str) -> dict[str, Any]:
    """An instance takes its runners' statuses with it; late reports about them are ignored above."""
    instance = state.instances.get(instance_id)  # type: ignore[call-overload]
    if instance is None:
        return {}
    gone = instance.shard_assignments.runner_to_shard.keys()
    return {
        "instances": _without(state.instances, instance_id),
        "runners": {r: s for r, s in state.runners.items() if r not in gone},
        "instance_retries": _without(state.instance_retries, instance_id),
    }


def _task_update(state: State, task_id: str, **fields: Any) -> dict[str, Any]:
    task = state.tasks.get(task_id)  # type: ignore[call-overload]
    if task is None or not task.task_status.is_open:
        return {}
    tasks = {**state.tasks, task.task_id: task.model_copy(update=fields)}
    finished = [tid for tid, t in tasks.items() if not t.task_status.is_open]
    for tid in finished[:-FINISHED_TASKS_KEPT]:
        del tasks[tid]
    return {"tasks": tasks}


def _node_info(state: State, event: NodeGatheredInfo) -> dict[str, Any]:
    node, info = event.node_id, event.info
    changes: dict[str, Any] = {"last_seen": {**state.last_seen, node: event.when}}
    for field, value in (
        ("node_identities", info.identity),
        ("node_memory", info.memory),
        ("node_disk", info.disk),
        ("node_system", info.system),
        ("node_accelerator", info.accelerator),
        ("node_network", info.network),
        ("node_api_ports", info.api_port),
        ("node_backends", info.backends),
        ("node_links", info.links),
        ("node_compute", info.compute),
    ):
        if value is not None:
            changes[field] = {**getattr(state, field), node: value}
    if node not in state.topology.nodes:
        topo = state.topology
        changes["topology"] = topo.model_copy(update={"nodes": [*topo.nodes, node]})
    return changes


def _forget_node(state: State, node: NodeId) -> dict[str, Any]:
    per_node = (
        "last_seen",
        "node_identities",
        "node_memory",
        "node_disk",
        "node_system",
        "node_accelerator",
        "node_network",
        "node_api_ports",
        "node_backends",
        "node_compute",
        "downloads",
    )
    changes: dict[str, Any] = {field: _without(getattr(state, field), node) for field in per_node}
    changes["node_links"] = {
        source: {sink: link for sink, link in links.items() if sink != node}
        for source, links in state.node_links.items() if source != node
    }
    topo = state.topology
    changes["topology"] = Topology(
        nodes=[n for n in topo.nodes if n != node],
        connections=[c for c in topo.connections if node not in (c.source, c.sink)],
    )
    return changes


def _download_progress(
    state: State, node_id: NodeId, model_id: ModelId, progress: DownloadProgress | None
) -> dict[str, Any]:
    mine = {k: v for k, v in state.downloads.get(node_id, {}).items() if k != model_id}
    if progress is not None:
        mine[model_id] = progress
    return {"downloads": {**state.downloads, node_id: mine}}
