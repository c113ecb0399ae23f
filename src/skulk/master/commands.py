"""Pure decisions of the master for placement commands and for what workers may report.

Placement is a decision, so the master (the single writer) makes it, against its own state and the instances
it has already committed: two requests can never double-book a node's memory or reuse a runner id.
"""

from __future__ import annotations

from collections.abc import Callable

from skulk.master.placement import place
from skulk.master.reconcile import Ids, backing, with_committed
from skulk.types.commands import CreateInstance, DeleteMetaInstance, PlaceInstance
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceFailed,
    LocalEvent,
    MetaInstanceDeleted,
    NodeDownloadProgress,
    NodeGatheredInfo,
    RunnerStatusUpdated,
    TaskFailed,
    TaskStatusUpdated,
    TopologyEdgeCreated,
    TopologyEdgeDeleted,
)
from skulk.types.ids import ModelId, NodeId
from skulk.types.models import ModelCard
from skulk.types.placement import PlacementError
from skulk.types.state import State
from skulk.types.tasks import TaskStatus


class Refused(ApiError):
    """A command the master will not carry out; the message says why (and what to do)."""


def delete_meta_instance(state: State, command: DeleteMetaInstance) -> list[Event]:
    """The cascade, in one batch: cancel the backing instances' open tasks (never finished ones), delete the
    instances, then the MetaInstance. Deleting an unknown one is a no-op (a repeated DELETE is harmless)."""
    meta = state.meta_instances.get(command.meta_instance_id)
    if meta is None:
        return []
    bound = {i.instance_id for i in backing(state, meta)}
    cancels: list[Event] = [
        TaskStatusUpdated(task_id=t.task_id, task_status=TaskStatus.Cancelled)
        for t in state.tasks.values()
        if t.instance_id in bound and t.task_status in (TaskStatus.Pending, TaskStatus.Running)
    ]
    deletions: list[Event] = [InstanceDeleted(instance_id=i) for i in sorted(bound)]
    return [*cancels, *deletions, MetaInstanceDeleted(meta_instance_id=meta.meta_instance_id)]


def create_instance(state: State, command: CreateInstance) -> list[Event]:
    """An instance planned elsewhere: refused if its id or any runner id is already taken."""
    instance = command.instance
    if instance.instance_id in state.instances:
        raise Refused(ErrorCode.invalid_request, f"instance id {instance.instance_id} is already in use")
    taken = {r for i in state.instances.values() for r in i.shard_assignments.runner_to_shard}
    clash = taken & set(instance.shard_assignments.runner_to_shard)
    if clash:
        raise Refused(ErrorCode.invalid_request, f"runner ids already in use: {sorted(clash)}")
    return [InstanceCreated(instance=instance)]


def place_instance(
    state: State, command: PlaceInstance, card_of: Callable[[ModelId], ModelCard | None], ids: Ids
) -> list[Event]:
    """Place on the master's own view, memory already committed to other instances subtracted; raises
    Refused with the typed placement error (and its GB arithmetic) when it does not fit."""
    if command.instance_id in state.instances:
        return []
    card = card_of(command.model_id)
    if card is None:
        raise Refused(ErrorCode.model_not_found, f"unknown model {command.model_id}; GET /models lists the models")
    outcome = place(
        with_committed(state),
        card,
        command.sharding,
        command.instance_meta,
        instance_id=command.instance_id,
        new_runner_id=ids.runner,
        rendezvous_port=ids.port(),
        min_nodes=command.min_nodes,
        excluded_nodes=command.excluded_nodes,
        engine=command.engine,
        sizing=command.sizing,
    )
    if isinstance(outcome, PlacementError):
        raise Refused(outcome.code, outcome.message)
    return [InstanceCreated(instance=outcome)]


def _runs_on(state: State, node: NodeId, runner_id: str) -> bool:
    return any(i.shard_assignments.node_to_runner.get(node) == runner_id for i in state.instances.values())


def _task_on(state: State, node: NodeId, task_id: str) -> bool:
    task = state.tasks.get(task_id)  # type: ignore[call-overload]
    instance = state.instances.get(task.instance_id) if task is not None else None
    return instance is not None and node in instance.shard_assignments.node_to_runner


def accepts_local(state: State, local: LocalEvent) -> bool:
    """A worker may report only about itself: its own node, its own runners, tasks on its instances."""
    origin = local.origin
    match local.event:
        case NodeGatheredInfo(node_id=node) | NodeDownloadProgress(node_id=node):
            return node == origin
        case TopologyEdgeCreated(connection=c) | TopologyEdgeDeleted(connection=c):
            return c.source == origin
        case RunnerStatusUpdated(runner_id=runner_id):
            return _runs_on(state, origin, runner_id)
        case TaskStatusUpdated(task_id=task_id) | TaskFailed(task_id=task_id):
            return _task_on(state, origin, task_id)
        case InstanceFailed(instance_id=instance_id):
            instance = state.instances.get(instance_id)
            return instance is not None and origin in instance.shard_assignments.node_to_runner
    return False
