"""The cluster state every node holds. Changed only by state.apply."""

from __future__ import annotations

from datetime import datetime

from .backends import BackendTag
from .base import CamelModel
from .desired import RestoredCopy
from .downloads import DownloadProgress
from .ids import InstanceId, MetaInstanceId, ModelId, NodeId, RunnerId, TaskId
from .instances import Instance
from .links import DecodeCompute, LinkMeasurement
from .meta_instances import MetaInstance
from .models import ModelCard
from .node_info import (
    AcceleratorInfo,
    DiskUsage,
    MemoryUsage,
    NetworkInfo,
    NodeIdentity,
    SystemPerformance,
    Topology,
)
from .runners import RunnerStatus
from .tasks import Task

RETRY_TIMES_KEPT = 16


class InstanceRetries(CamelModel):
    """Restarts of one instance as a whole, event-sourced: times come from the events, never from a clock."""

    attempt: int = 0
    """Restarts so far; a runner started for an older attempt is stale and is restarted by its worker."""
    recent: list[datetime] = []
    """When the last RETRY_TIMES_KEPT restarts happened (the budget counts those inside its window)."""
    last_error: str | None = None
    failed: str | None = None
    """Set once the budget is spent: the instance stays, with its failed runners, until it is deleted."""

    def within(self, now: datetime | None, window_s: float) -> list[datetime]:
        """The restarts inside the window ending at now (all of them when now is unknown)."""
        return [t for t in self.recent if now is None or (now - t).total_seconds() < window_s]


class State(CamelModel):
    instances: dict[InstanceId, Instance] = {}
    meta_instances: dict[MetaInstanceId, MetaInstance] = {}
    model_cards: dict[ModelId, ModelCard] = {}
    """Custom cards added on any node (POST /models/add): every node, the master included, can place them."""
    runners: dict[RunnerId, RunnerStatus] = {}
    tasks: dict[TaskId, Task] = {}
    instance_retries: dict[InstanceId, InstanceRetries] = {}
    last_seen: dict[NodeId, datetime] = {}
    node_identities: dict[NodeId, NodeIdentity] = {}
    node_memory: dict[NodeId, MemoryUsage] = {}
    node_disk: dict[NodeId, DiskUsage] = {}
    node_system: dict[NodeId, SystemPerformance] = {}
    node_accelerator: dict[NodeId, AcceleratorInfo] = {}
    node_network: dict[NodeId, NetworkInfo] = {}
    node_api_ports: dict[NodeId, int] = {}
    node_backends: dict[NodeId, list[BackendTag]] = {}
    """Skulk's nodeResources[node].backends: the engines each node runs (none said: torch only)."""
    topology: Topology = Topology()
    node_links: dict[NodeId, dict[NodeId, LinkMeasurement]] = {}
    """The topology's measured links: node_links[source][sink] is what source measured to sink (node info)."""
    node_compute: dict[NodeId, DecodeCompute] = {}
    """Each node's learned decode speed (node info): with node_links, what previews predict tok/s from."""
    master_node_id: NodeId | None = None
    term: int = 0
    last_event_applied_idx: int = -1
    tracing_enabled: bool | None = None
    """Runtime tracing for new tasks; None until someone set it (a node then applies its tracing.enabled)."""
    desired_restored: RestoredCopy | None = None
    """The best saved copy of the desired state this cluster life restored from (None: none yet); a follower
    keeps its own file unwritten while its copy ranks above it (state/desired_offer.py)."""
    downloads: dict[NodeId, dict[ModelId, DownloadProgress]] = {}
    """Per node, where each model's files stand (store.service reports them; an instance is ready to start only
    when every node of it has its files)."""
