"""The cluster state every node holds. Changed only by state.apply."""

from __future__ import annotations

from datetime import datetime

from .base import CamelModel
from .ids import InstanceId, NodeId, RunnerId, TaskId
from .instances import Instance
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


class State(CamelModel):
    instances: dict[InstanceId, Instance] = {}
    runners: dict[RunnerId, RunnerStatus] = {}
    tasks: dict[TaskId, Task] = {}
    last_seen: dict[NodeId, datetime] = {}
    node_identities: dict[NodeId, NodeIdentity] = {}
    node_memory: dict[NodeId, MemoryUsage] = {}
    node_disk: dict[NodeId, DiskUsage] = {}
    node_system: dict[NodeId, SystemPerformance] = {}
    node_accelerator: dict[NodeId, AcceleratorInfo] = {}
    node_network: dict[NodeId, NetworkInfo] = {}
    node_api_ports: dict[NodeId, int] = {}
    topology: Topology = Topology()
    master_node_id: NodeId | None = None
    term: int = 0
    last_event_applied_idx: int = -1
