"""The diagnostics router against a fake node: bundles, one peer, 404s, cooperative cancel."""

from __future__ import annotations

import socket

from fastapi import FastAPI
from fastapi.testclient import TestClient

from skulk.api.diagnostics import diagnostics_router
from skulk.api.errors import install_error_handlers
from skulk.api.services import ApiServices
from skulk.types.ids import NodeId, RunnerId
from skulk.types.node_info import Connection, Topology

from . import seed_fields as seeds
from .diagnostics_fakes import busy_supervisor, cluster_state
from .factories import api_services, instance


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _client() -> tuple[TestClient, ApiServices]:
    state = cluster_state()
    edge = Connection(source=NodeId("n1"), sink=NodeId("n2"), sink_address="127.0.0.1")
    ports = {NodeId("n1"): 52415, NodeId("n2"): _closed_port()}
    state = state.model_copy(
        update={
            "topology": Topology(nodes=[NodeId("n1"), NodeId("n2")], connections=[edge]),
            "node_api_ports": ports,
        }
    )
    sup = busy_supervisor(instance("inst", ("n1", "n2")), "n1", "decode_stream", 2.0)
    node = api_services(state, node_id="n1", master="n1", runners={sup.spec.runner_id: sup})
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(diagnostics_router(node, peer_timeout_s=1.0))
    return TestClient(app), node


def test_node_bundle_endpoint() -> None:
    client, _ = _client()
    body = client.get("/v1/diagnostics/node").json()
    assert seeds.problems(body, seeds.NODE_DIAGNOSTICS, all_keys=True) == []
    assert body["supervisorRunners"][0]["runnerId"] == "r-n1"


def test_cluster_and_timeline_survive_a_dead_peer() -> None:
    client, _ = _client()
    cluster = client.get("/v1/diagnostics/cluster")
    assert cluster.status_code == 200
    assert seeds.problems(cluster.json(), seeds.CLUSTER_DIAGNOSTICS) == []
    assert [n["ok"] for n in cluster.json()["nodes"]] == [True, False]
    timeline = client.get("/v1/diagnostics/cluster/timeline").json()
    assert timeline["unreachableNodes"] == ["n2"]
    assert [r["runnerId"] for r in timeline["runners"]] == ["r-n1"]
    for runner in timeline["runners"]:
        assert seeds.problems(runner, seeds.CLUSTER_TIMELINE_RUNNER, all_keys=True) == []


def test_one_node_through_any_node() -> None:
    client, _ = _client()
    local = client.get("/v1/diagnostics/cluster/n1").json()
    assert local["ok"] is True and local["diagnostics"]["runtime"]["nodeId"] == "n1"
    peer = client.get("/v1/diagnostics/cluster/n2").json()
    assert peer["ok"] is False and peer["error"]
    missing = client.get("/v1/diagnostics/cluster/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "node_not_found"


def test_cancel_asks_the_runner_to_cancel_its_tasks() -> None:
    client, node = _client()
    response = client.post("/v1/diagnostics/node/runners/r-n1/cancel")
    assert response.status_code == 200
    assert response.json()["cancelRequestedTaskIds"] == ["t1"]
    assert node.supervisors[RunnerId("r-n1")].cancel_calls == ["t1"]
    assert client.post("/v1/diagnostics/node/runners/nope/cancel").status_code == 404
