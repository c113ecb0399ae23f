"""The info-pending path of POST /place_instance: wait for node info, then answer 503, never a false 400."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skulk.api import control
from skulk.api.errors import install_error_handlers
from skulk.master import commands
from skulk.master.reconcile import Ids
from skulk.models.cards import get_card
from skulk.types.commands import Command, PlaceInstance
from skulk.types.events import IndexedEvent, NodeGatheredInfo, TopologyEdgeCreated
from skulk.types.ids import NodeId
from skulk.types.memory import Memory
from skulk.types.node_info import Connection, MemoryUsage, NodeInfo
from skulk.types.state import State

from .factories import api_services, applied

ME, PEER = NodeId("me"), NodeId("peer")


class FakeNode:
    """A one-node cluster's API: the master's own decision on a placement is applied at once."""

    def __init__(self, state: State) -> None:
        self.sent: list[Command] = []
        self.services = api_services(state, node_id=ME, master=ME, commands=self._send)

    def _send(self, command: Command) -> None:
        self.sent.append(command)
        if isinstance(command, PlaceInstance):
            store = self.services.store
            for event in commands.place_instance(store.state, command, get_card, Ids()):
                store.apply(IndexedEvent(idx=store.next_idx, event=event))


def _info(node: NodeId, memory: bool) -> NodeGatheredInfo:
    usage = MemoryUsage(ram_total=Memory.from_gb(16), ram_available=Memory.from_gb(8)) if memory else None
    return NodeGatheredInfo(node_id=node, info=NodeInfo(memory=usage, api_port=1), when=datetime.now(UTC))


def _client(node: FakeNode) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(control.control_router(node.services))
    return TestClient(app)


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "INFO_GRACE_S", 0.3)
    monkeypatch.setattr(control, "PLACED_WAIT_S", 0.1)


def test_missing_node_info_answers_503_after_the_grace() -> None:
    node = FakeNode(applied(_info(ME, memory=False)))
    reply = _client(node).post("/place_instance", json={"model_id": "skulk/tiny-random-llama"})
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "InfoPending" and node.sent == []


def test_present_info_places_at_once() -> None:
    node = FakeNode(applied(_info(ME, memory=True)))
    reply = _client(node).post("/place_instance", json={"model_id": "skulk/tiny-random-llama"})
    assert reply.status_code == 200 and len(node.sent) == 1


def test_a_peer_without_memory_info_is_pending_not_insufficient() -> None:
    links = [
        TopologyEdgeCreated(connection=Connection(source=a, sink=b, sink_address="127.0.0.1"))
        for a, b in ((ME, PEER), (PEER, ME))
    ]
    node = FakeNode(applied(_info(ME, memory=True), _info(PEER, memory=False), *links))
    reply = _client(node).post("/place_instance", json={"model_id": "skulk/tiny-random-llama", "min_nodes": 2})
    assert reply.status_code == 503, reply.text
    assert PEER in reply.json()["error"]["message"]
