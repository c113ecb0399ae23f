"""Everything the HTTP API reaches on its node, as one typed object the node builds once and hands to create_app.

The API sees the node only through these components (no probing of the node for what it happens to have): the
state and the commands that change it, this node's open requests, its model files, traces, event log, restart
gate and runners. Tests build the same object (tests/unit/factories.py), with their own components."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from skulk.api.requests import Requests
from skulk.api.serving_metrics import ServingMetrics
from skulk.cluster.seal import Sealer
from skulk.config import Settings
from skulk.diagnostics.cluster import DepartedPeer
from skulk.diagnostics.supervisor_view import SupervisorLike
from skulk.eventlog import EventLog
from skulk.restart import RestartGate
from skulk.state.store import StateStore
from skulk.store.service import ModelFiles
from skulk.tracing.store import TraceStore
from skulk.types.commands import Command
from skulk.types.diagnostics_bundle import SkippedDesiredEntry
from skulk.types.ids import NodeId, RunnerId
from skulk.types.state import State


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiServices:
    node_id: NodeId
    settings: Settings
    store: StateStore
    """The cluster's state as this node has applied it."""
    commands: Callable[[Command], None]
    """Sends a command to the master."""
    requests: Requests
    files: ModelFiles
    traces: TraceStore
    event_log: EventLog | None
    """None when event_log.enabled is off."""
    restart: RestartGate
    master: Callable[[], NodeId | None]
    runners: Callable[[], Mapping[RunnerId, SupervisorLike]]
    """This node's runner supervisors (node-local, never gossiped)."""
    departed: Callable[[], Mapping[NodeId, DepartedPeer]]
    """Peers that left recently, where diagnostics last reached them."""
    sealer: Callable[[], Sealer | None]
    members: Callable[[], tuple[frozenset[str], frozenset[str]]]
    """The zenoh ids alive in the cluster and those holding its liveliness tokens (the security diagnostics)."""
    desired_skipped: Callable[[], Sequence[SkippedDesiredEntry]] = tuple
    """What this node's start skipped of its saved desired state (state/desired.py), for its diagnostics."""
    serving: ServingMetrics = field(default_factory=ServingMetrics)
    """The request path's metrics (api/serving_metrics.py), which GET /metrics serves."""

    @property
    def state(self) -> State:
        return self.store.state

    @property
    def master_id(self) -> NodeId | None:
        return self.master()

    def send_command(self, command: Command) -> None:
        self.commands(command)

    async def wait_for_state(self, predicate: Callable[[State], bool], timeout: float) -> bool:
        return await self.store.wait_until(predicate, timeout)

    @property
    def supervisors(self) -> Mapping[RunnerId, SupervisorLike]:
        return self.runners()

    @property
    def tracing_enabled(self) -> bool:
        return self.store.state.tracing_enabled is True

    @property
    def departed_peers(self) -> Mapping[NodeId, DepartedPeer]:
        return self.departed()
