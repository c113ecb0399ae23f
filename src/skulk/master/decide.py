"""Pure decisions of the master: which events answer a command, a lost node, a new session."""

from __future__ import annotations

from datetime import datetime

from skulk.config import Settings
from skulk.state.queries import is_serving
from skulk.types.commands import (
    AddModelCard,
    CancelCommand,
    Command,
    DeleteInstance,
    RestartNode,
    SetTracingEnabled,
    StartChatCompletion,
    StartEmbedding,
)
from skulk.types.events import (
    Event,
    InstanceDeleted,
    InstanceFailed,
    InstanceRetrying,
    ModelCardAdded,
    NodeRestartRequested,
    NodeTimedOut,
    SessionStarted,
    TaskCreated,
    TaskFailed,
    TaskStatusUpdated,
    TracingStateChanged,
)
from skulk.types.ids import InstanceId, ModelId, NodeId, TaskId
from skulk.types.instances import MlxRingInstance
from skulk.types.runners import RunnerFailed
from skulk.types.state import InstanceRetries, State
from skulk.types.tasks import ChatCompletion, TaskStatus, TextEmbedding

RESTART_BUDGET: int = Settings.model_fields["runner_restart_budget"].default
"""The defaults are Settings' own (not a Settings built at import, which would read the environment)."""
RESTART_WINDOW_S: float = Settings.model_fields["runner_restart_window_seconds"].default


def events_for_command(state: State, command: Command, new_task_id: TaskId) -> list[Event]:
    """The commands decided against state alone (creating and placing instances, with their checks, are
    master/commands.py's: the master routes them there first)."""
    match command:
        case DeleteInstance(instance_id=instance_id):
            if instance_id not in state.instances:
                return []
            return [
                *fail_open_tasks(state, {instance_id}, "the instance serving this request was deleted"),
                InstanceDeleted(instance_id=instance_id),
            ]
        case StartChatCompletion() | StartEmbedding():
            return _start_chat(state, command, new_task_id)
        case AddModelCard(card=card):
            return [] if state.model_cards.get(card.model_id) == card else [ModelCardAdded(card=card)]
        case SetTracingEnabled(enabled=enabled):
            return [] if state.tracing_enabled is enabled else [TracingStateChanged(enabled=enabled)]
        case RestartNode(node_id=node_id):
            return [NodeRestartRequested(node_id=node_id)]
        case CancelCommand(target_command_id=target):
            return [
                TaskStatusUpdated(task_id=task.task_id, task_status=TaskStatus.Cancelled)
                for task in state.tasks.values()
                if task.command_id == target and task.task_status.is_open
            ]
    return []


def _start_chat(state: State, command: StartChatCompletion | StartEmbedding, task_id: TaskId) -> list[Event]:
    """A task of the command's kind (a chat or an embedding) on the least-loaded instance of the model."""
    instance_id = command.instance_id or pick_instance(state, command.model)
    kind = TextEmbedding if isinstance(command, StartEmbedding) else ChatCompletion
    task = kind(
        task_id=task_id,
        command_id=command.command_id,
        instance_id=instance_id or InstanceId(""),
        model=command.model,
        origin_node_id=command.origin_node_id,
        traced=state.tracing_enabled is True,
    )
    if instance_id is None or instance_id not in state.instances:
        message = f"No instance found for model {command.model}; place it first, then retry"
        return [TaskCreated(task=task), TaskFailed(task_id=task_id, error_message=message, retryable=True)]
    failed = failed_for_good(state, instance_id)
    if failed is not None:
        message = instance_failed_message(instance_id, failed)
        return [TaskCreated(task=task), TaskFailed(task_id=task_id, error_message=message, retryable=True)]
    return [TaskCreated(task=task)]


def failed_for_good(state: State, instance_id: InstanceId) -> str | None:
    """Why the instance spent its restart budget, or None while it may still serve."""
    retries = state.instance_retries.get(instance_id)
    return retries.failed if retries is not None else None


def instance_failed_message(instance_id: InstanceId, why: str) -> str:
    return (
        f"instance {instance_id} failed and is not restarted again ({why}). Delete it "
        f"(DELETE /instance/{instance_id}) and place it again (POST /place_instance)"
    )


def pick_instance(state: State, model: ModelId) -> InstanceId | None:
    """The serving instance of the model with the fewest open tasks; ties go to the oldest instance. Else one
    that may still serve (loading, restarting); a failed-for-good one only when nothing else is left."""
    of_model = [i for i in state.instances.values() if i.model_id == model]
    alive = [i for i in of_model if failed_for_good(state, i.instance_id) is None]
    candidates = [i for i in alive if is_serving(state, i)] or alive or of_model
    if not candidates:
        return None
    load = {i.instance_id: 0 for i in candidates}
    for task in state.tasks.values():
        if task.task_status.is_open and task.instance_id in load:
            load[task.instance_id] += 1
    return min(candidates, key=lambda i: load[i.instance_id]).instance_id


def fail_open_tasks(state: State, instance_ids: set[InstanceId], why: str) -> list[Event]:
    return [
        TaskFailed(task_id=task.task_id, error_message=f"{why}; retry the request", retryable=True)
        for task in state.tasks.values()
        if task.task_status.is_open and task.instance_id in instance_ids
    ]


def events_for_lost_node(state: State, node: NodeId) -> list[Event]:
    """A node is gone: its instances cannot serve, so their requests fail now and the instances go."""
    lost = {i.instance_id for i in state.instances.values() if node in i.shard_assignments.node_to_runner}
    why = f"node {node} left the cluster"
    events: list[Event] = fail_open_tasks(state, lost, why)
    events += [InstanceDeleted(instance_id=i, failure_error=why) for i in sorted(lost)]
    if node in state.topology.nodes or node in state.last_seen:
        events.append(NodeTimedOut(node_id=node))
    return events


def session_changed_message(master: NodeId, term: int) -> str:
    return f"the cluster session changed (new master {master}, term {term}); retry the request"


def events_for_new_session(state: State, master: NodeId, term: int) -> list[Event]:
    """A new term cannot carry the old session's requests: fail them; placements carry over."""
    failed: list[Event] = [
        TaskFailed(
            task_id=task.task_id,
            error_message=session_changed_message(master, term),
            retryable=True,
        )
        for task in state.tasks.values()
        if task.task_status.is_open
    ]
    return [SessionStarted(master_node_id=master, term=term), *failed]


def node_name(state: State, node: NodeId) -> str:
    """What operators call a node: its friendly name, else the start of its id."""
    identity = state.node_identities.get(node)
    if identity is not None and identity.friendly_name and identity.friendly_name != "Unknown":
        return identity.friendly_name
    return node[:8]


def named_failures(state: State, instance: MlxRingInstance) -> list[str]:
    """Each failed runner's error prefixed with its node's name, in rank order ("MacBook Pro: OOM"), so a
    joined message shows which node the root cause is on (seed 003)."""
    a = instance.shard_assignments
    node_of = {r: n for n, r in a.node_to_runner.items()}
    named = []
    for runner in sorted(a.runner_to_shard, key=lambda r: a.runner_to_shard[r].device_rank):
        status = state.runners.get(runner)
        if isinstance(status, RunnerFailed):
            named.append(f"{node_name(state, node_of[runner])}: {status.error_message or 'runner failed'}")
    return named


def events_for_unhealthy_instances(
    state: State,
    *,
    budget: int = RESTART_BUDGET,
    window_s: float = RESTART_WINDOW_S,
    now: datetime | None = None,
) -> list[Event]:
    """A multi-rank instance with a failed rank cannot serve: fail its requests and restart it as a whole
    (every rank, re-forming the group) while its restart budget lasts, else mark it failed for good. A failed
    instance's requests fail at once. now: the failure's own time when not given (budgets count event time)."""
    events: list[Event] = []
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if instance.meta_instance_id in state.meta_instances:
            continue  # its MetaInstance's health rule retries it (n/3), then places a new one
        why = failed_for_good(state, instance.instance_id)
        if why is not None:
            # retryable only so that the API node injects it into the open stream; the message says what to do
            events += fail_open_tasks(state, {instance.instance_id}, instance_failed_message(instance.instance_id, why))
            continue
        failures = [
            status
            for r in instance.shard_assignments.runner_to_shard
            if isinstance(status := state.runners.get(r), RunnerFailed)
        ]
        if instance.world_size > 1 and failures:
            retries = state.instance_retries.get(instance.instance_id, InstanceRetries())
            events += _retry_or_fail(state, instance, retries, failures, budget, window_s, now)
    return events


def _retry_or_fail(
    state: State,
    instance: MlxRingInstance,
    retries: InstanceRetries,
    failures: list[RunnerFailed],
    budget: int,
    window_s: float,
    now: datetime | None,
) -> list[Event]:
    iid = instance.instance_id
    error = "; ".join(named_failures(state, instance)) or "a rank of the instance failed"
    at = now or max((f.at for f in failures if f.at is not None), default=None)
    recent = len(retries.within(at, window_s))
    if recent >= budget:
        why = f"{recent + 1} failures within {window_s:.0f} s, the last: {error}"
        return [*fail_open_tasks(state, {iid}, f"the instance failed ({error})"),
                InstanceFailed(instance_id=iid, failure_error=why)]
    return [
        *fail_open_tasks(state, {iid}, f"a rank of the instance failed ({error}); the instance is restarting"),
        InstanceRetrying(instance_id=iid, failure_error=error, at=at),
    ]
