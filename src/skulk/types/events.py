"""Events: past-tense facts. The master alone orders them; every node applies them with state.apply."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Discriminator, Field, Tag

from .base import CamelModel, TaggedModel, tag_of
from .desired import RestoredCopy
from .downloads import DownloadProgress
from .ids import InstanceId, MetaInstanceId, ModelId, NodeId, RunnerId, TaskId
from .instances import Instance
from .meta_instances import MetaInstance
from .models import ModelCard
from .node_info import Connection, NodeInfo
from .runners import RunnerStatus
from .tasks import Task, TaskStatus


class InstanceCreated(TaggedModel):
    instance: Instance


class InstanceDeleted(TaggedModel):
    instance_id: InstanceId
    failure_error: str | None = None
    """Why, when the instance is deleted because it failed (a bound MetaInstance counts the failure)."""


class RunnerStatusUpdated(TaggedModel):
    runner_id: RunnerId
    runner_status: RunnerStatus


class RunnerDeleted(TaggedModel):
    runner_id: RunnerId


class TaskCreated(TaggedModel):
    task: Task


class TaskStatusUpdated(TaggedModel):
    task_id: TaskId
    task_status: TaskStatus


class TaskFailed(TaggedModel):
    """A task ended in error. retryable: the same request may succeed if the client sends it again."""

    task_id: TaskId
    error_message: str
    retryable: bool = True


class NodeGatheredInfo(TaggedModel):
    node_id: NodeId
    info: NodeInfo
    when: datetime


class NodeTimedOut(TaggedModel):
    node_id: NodeId


class TopologyEdgeCreated(TaggedModel):
    connection: Connection


class TopologyEdgeDeleted(TaggedModel):
    connection: Connection


class SessionStarted(TaggedModel):
    """A master began a term; tasks open before it are failed by the master that emits this."""

    master_node_id: NodeId
    term: int


class InstanceRetrying(TaggedModel):
    """A multi-rank instance lost a rank and restarts as a whole: its runners leave state (every rank's worker
    then starts its rank afresh, re-forming the group), the instance stays. Retrying a missing instance is a
    no-op. at: the failure's time, which the restart budget counts."""

    instance_id: InstanceId
    meta_instance_id: MetaInstanceId | None = None
    failure_error: str
    at: datetime | None = None


class InstanceFailed(TaggedModel):
    """The instance spent its restart budget: it stays, failed, visible in /state, until deleted."""

    instance_id: InstanceId
    failure_error: str


class NodeDownloadProgress(TaggedModel):
    """Where one model's files stand on one node (downloading, staging, ready, failed); progress None: the node
    no longer holds a copy (evicted or deleted)."""

    node_id: NodeId
    model_id: ModelId
    progress: DownloadProgress | None = None


class ModelCardAdded(TaggedModel):
    """A custom model card, known cluster-wide from now on (built from a model's config.json on one node)."""

    card: ModelCard


class MetaInstanceCreated(TaggedModel):
    meta_instance: MetaInstance


class MetaInstanceDeleted(TaggedModel):
    meta_instance_id: MetaInstanceId


class MetaInstancePlacementFailed(TaggedModel):
    meta_instance_id: MetaInstanceId
    reason: str


class TracingStateChanged(TaggedModel):
    """Runtime tracing is now on or off for new tasks."""

    enabled: bool


class NodeRestartRequested(TaggedModel):
    """An operator asked this node to restart in place (os.execv); state does not change."""

    node_id: NodeId


class DesiredStateRestored(TaggedModel):
    """The first master of a restarted cluster restored (what was missing of) this saved copy of the desired
    state, its own or a follower's: later offers must rank above it to add anything (state/desired_offer.py)."""

    restored: RestoredCopy


Event = Annotated[
    Annotated[InstanceCreated, Tag("InstanceCreated")]
    | Annotated[InstanceDeleted, Tag("InstanceDeleted")]
    | Annotated[RunnerStatusUpdated, Tag("RunnerStatusUpdated")]
    | Annotated[RunnerDeleted, Tag("RunnerDeleted")]
    | Annotated[TaskCreated, Tag("TaskCreated")]
    | Annotated[TaskStatusUpdated, Tag("TaskStatusUpdated")]
    | Annotated[TaskFailed, Tag("TaskFailed")]
    | Annotated[NodeGatheredInfo, Tag("NodeGatheredInfo")]
    | Annotated[NodeTimedOut, Tag("NodeTimedOut")]
    | Annotated[TopologyEdgeCreated, Tag("TopologyEdgeCreated")]
    | Annotated[TopologyEdgeDeleted, Tag("TopologyEdgeDeleted")]
    | Annotated[SessionStarted, Tag("SessionStarted")]
    | Annotated[InstanceRetrying, Tag("InstanceRetrying")]
    | Annotated[InstanceFailed, Tag("InstanceFailed")]
    | Annotated[MetaInstanceCreated, Tag("MetaInstanceCreated")]
    | Annotated[MetaInstanceDeleted, Tag("MetaInstanceDeleted")]
    | Annotated[MetaInstancePlacementFailed, Tag("MetaInstancePlacementFailed")]
    | Annotated[ModelCardAdded, Tag("ModelCardAdded")]
    | Annotated[NodeDownloadProgress, Tag("NodeDownloadProgress")]
    | Annotated[TracingStateChanged, Tag("TracingStateChanged")]
    | Annotated[NodeRestartRequested, Tag("NodeRestartRequested")]
    | Annotated[DesiredStateRestored, Tag("DesiredStateRestored")],
    Discriminator(tag_of),
]


class IndexedEvent(CamelModel):
    """An event in the master's order. idx values are consecutive from 0 within the cluster's history."""

    idx: int = Field(ge=0)
    event: Event
    term: int = 0
    master: NodeId | None = None
    """The master (and its term) that emitted it: a follower applies only the events of the one (master, term)
    it follows, so two masters of one term (either side of a partition) can never interleave in its state."""


class LocalEvent(CamelModel):
    """An event a node proposes to the master; (origin, seq) lets the master drop duplicates, and (master,
    term) binds it to the master it was sent to: a later master refuses it, so a sealed copy captured in one
    term cannot be replayed into the next (issue 27)."""

    origin: NodeId
    seq: int
    event: Event
    term: int = 0
    master: NodeId | None = None
