"""This node's facts, gathered and reported: its info (memory, backends, links, compute) and its topology edges.

The loops that observe what only this node can see live here, one component the node runs, so the composition
root composes and the worker floor observes: `info_forever` reports `NodeGatheredInfo` when it changed (or as a
heartbeat), `topology_forever` probes the peers, reports the edges and samples round trips and bandwidths into
the node's LinkMeter, and `calibrate` measures decode compute once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from skulk import peer_tls
from skulk.config import Settings
from skulk.memory_limit import MemoryWatch
from skulk.types.events import Event, NodeGatheredInfo, TopologyEdgeDeleted
from skulk.types.ids import NodeId
from skulk.types.node_info import Connection
from skulk.types.state import State
from skulk.worker import calibrate, links, node_info, topology
from skulk.worker.links import LinkMeter
from skulk.worker.worker import Worker

log = logging.getLogger("skulk.node")  # the node's facts, logged under the node's name as before

INFO_EVERY_S = 2.0
INFO_HEARTBEAT_S = 10.0
TOPOLOGY_EVERY_S = 1.0


class NodeFacts:
    """The fact loops of one node, over what they read (settings, state, the worker's spare and compute) and
    where they report (the node's local events)."""

    def __init__(self, settings: Settings, node_id: NodeId, *, state: Callable[[], State],
                 emit: Callable[[Event], None], worker: Worker, api_port: Callable[[], int]) -> None:
        self.settings = settings
        self.node_id = node_id
        self._state = state
        self._emit = emit
        self._worker = worker
        self._api_port = api_port
        """The port the API listens on: known once it serves (port 0 picks one)."""
        self.links = LinkMeter(settings.link_bandwidth_seconds)
        """Round trip and bandwidth to each peer, sampled by the topology probes (node info reports them)."""
        self.memory_watch = MemoryWatch()

    async def info_forever(self, probing: asyncio.Future[Any]) -> None:
        await probing  # the first gather reads its (cached) answer
        last: node_info.NodeInfo | None = None
        last_sent = 0.0
        while True:
            info = await asyncio.to_thread(
                node_info.gather,
                friendly_name=self.settings.node_name,
                home=self.settings.home,
                api_port=self._api_port(),
                engines=tuple(self.settings.engines),
                limit=self.settings.memory_limit,
                reserve=self.settings.memory_reserve,
                watch=self.memory_watch,
                standby=self._worker.spare.resident() if self._worker.spare is not None else 0,
                overheads=self._worker.overheads.snapshot(),
            )
            info = info.model_copy(update={"links": self.links.snapshot(), "compute": self._worker.compute.snapshot()})
            if worth_sending(last, info) or time.monotonic() - last_sent > INFO_HEARTBEAT_S:
                self._emit(NodeGatheredInfo(node_id=self.node_id, info=info, when=datetime.now(UTC)))
                last, last_sent = info, time.monotonic()
            self._worker.warm_spare()  # once the start is behind the node (worker/spare.py), and none is loading
            await asyncio.sleep(INFO_EVERY_S)

    async def calibrate(self) -> None:
        """Once, after the API serves: this node's decode compute and a runner's runtime overhead, so the first
        preview predicts and counts this machine's runtime."""
        if (found := await calibrate.calibrate()) is not None:
            self._worker.compute.calibrated(found.steps)
            self._worker.overheads.calibrated("torch", "first", found.overhead)

    async def topology_forever(self) -> None:
        misses: dict[NodeId, int] = {}
        unreached: dict[NodeId, str] = {}  # why each peer without an answer had none, logged when it changes
        async with httpx.AsyncClient(verify=peer_tls.verify()) as client:
            while True:
                answers = await topology.probe(client, self._state(), self.node_id, self.links)
                reachable, misses = topology.debounced(self._state(), self.node_id, answers, misses)
                for peer, why in answers.items():
                    if isinstance(why, str) and unreached.get(peer) != why:
                        log.info("peer %s did not answer its probe: %s", peer[:8], why)
                unreached = {p: why for p, why in answers.items() if isinstance(why, str)}
                for event in topology.edge_events(self._state(), self.node_id, reachable):
                    if isinstance(event, TopologyEdgeDeleted):
                        log.info("withdrawing the edge to %s: %s", event.connection.sink[:8],
                                 answers.get(event.connection.sink))
                    self._emit(event)
                self.links.forget_except({n for n, c in reachable.items() if c is not None})
                if reachable and (own := await links.time_self(client, self._own_host(), self._api_port(),
                                                               self.node_id)) is not None:
                    self.links.add_self_rtt(own)
                await self._read_bandwidths(client, reachable)
                await asyncio.sleep(TOPOLOGY_EVERY_S)

    def _own_host(self) -> str:
        host = self.settings.api_host
        if host in ("0.0.0.0", "", "::"):
            return "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    async def _read_bandwidths(self, client: httpx.AsyncClient, reachable: dict[NodeId, Connection | None]) -> None:
        """The peers whose bulk read is due, one at a time (reads in parallel would share the node's link)."""
        now = time.time()
        for peer, connection in reachable.items():
            rtt = self.links.median_rtt_s(peer)
            port = self._state().node_api_ports.get(peer)
            if connection is None or rtt is None or port is None or not self.links.bandwidth_due(peer, now):
                continue
            self.links.bandwidth_tried(peer, now)  # a peer that cannot answer is asked again only when due
            mbps = await links.read_bandwidth(client, connection.sink_address, port, rtt, peer)
            if mbps is not None:
                self.links.add_bandwidth(peer, mbps)


def worth_sending(last: node_info.NodeInfo | None, info: node_info.NodeInfo) -> bool:
    """Links and compute jitter every probe: they count only when they moved (links.worth_reporting)."""
    if last is None or links.worth_reporting(last.links, info.links) or (last.compute != info.compute and (
            last.compute is None or info.compute is None
            or set(last.compute.step_s_per_gb) != set(info.compute.step_s_per_gb))):
        return True
    strip = {"links": None, "compute": None}
    return node_info.differs(last.model_copy(update=strip), info.model_copy(update=strip))
