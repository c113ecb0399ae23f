"""Three real node processes on loopback with explicit zenoh endpoints."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, instance_ready, place, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
pytestmark = pytest.mark.timeout(240)


def state_of(node: LocalNode) -> dict[str, Any]:
    return httpx.get(f"{node.url}/state", timeout=10).json()


def master_of(node: LocalNode) -> str | None:
    return state_of(node).get("masterNodeId")


def formed(nodes: list[LocalNode]) -> bool:
    """Every node knows every node and every link between them, and all agree on one master."""
    states = [state_of(n) for n in nodes]
    ids = {n.node_id for n in nodes}
    links = len(ids) * (len(ids) - 1)
    return (
        all(set(s["nodeMemory"]) == ids and len(s["topology"]["connections"]) == links for s in states)
        and len({s["masterNodeId"] for s in states}) == 1
    )


def describe(nodes: list[LocalNode]) -> str:
    lines = []
    for node in nodes:
        s = state_of(node)
        edges = sorted(f"{c['source'][:6]}>{c['sink'][:6]}" for c in s["topology"]["connections"])
        known = [k[:6] for k in s["nodeMemory"]]
        lines.append(f"{node.node_id[:6]} master={str(s['masterNodeId'])[:6]} idx={s['lastEventAppliedIdx']} "
                     f"known={known} edges={edges}")
        lines.append(node.log_tail(15))
    return "\n".join(lines)


def comparable(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "nodeHealth"}


def identical_states(nodes: list[LocalNode]) -> bool:
    states = [comparable(state_of(n)) for n in nodes]
    return all(s == states[0] for s in states)


def greedy(node: LocalNode, prompt: str = "hello there", tokens: int = 16) -> list[int]:
    """Token ids of a greedy completion, read from the stream (text can be partial UTF-8)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    texts = []
    with (
        httpx.Client(base_url=node.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                if payload["choices"]:
                    texts.append(payload["choices"][0]["delta"].get("content", ""))
    return [ord(c) for c in "".join(texts)]


@pytest.fixture
def three(cluster: Cluster) -> list[LocalNode]:
    nodes = cluster.start(3)
    wait_until(lambda: formed(nodes), 30, "three nodes to form one cluster", lambda: describe(nodes))
    return nodes


def test_cluster_forms_with_one_master_and_identical_state(three: list[LocalNode]) -> None:
    masters = {master_of(n) for n in three}
    assert len(masters) == 1 and masters <= {n.node_id for n in three}
    wait_until(lambda: identical_states(three), 20, "identical /state on all nodes")
    state = state_of(three[0])
    assert len(state["nodeIdentities"]) == 3
    assert len(state["topology"]["connections"]) == 6, state["topology"]


def test_request_through_a_node_outside_the_placement(three: list[LocalNode]) -> None:
    a, b, c = three
    place_and_wait(a, excluded_nodes=[b.node_id, c.node_id])
    assert greedy(c) == greedy(a)
    with httpx.Client(base_url=b.url, timeout=60) as client:
        reply = client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert reply.status_code == 200, reply.text


def test_late_joiner_catches_up(cluster: Cluster) -> None:
    first = cluster.start(2)
    wait_until(lambda: formed(first), 30, "two nodes to form")
    instance_id = place_and_wait(first[0])
    (late,) = cluster.start(1)
    wait_until(lambda: instance_id in state_of(late)["instances"], 20, "the late joiner to learn the instance")
    wait_until(lambda: identical_states([*first, late]), 20, "the late joiner to converge")
    assert greedy(late) == greedy(first[0])


def test_kill_9_of_the_master_elects_a_new_one_and_keeps_placements(three: list[LocalNode]) -> None:
    master_id = master_of(three[0])
    master = next(n for n in three if n.node_id == master_id)
    rest = [n for n in three if n is not master]
    instance_id = place_and_wait(rest[0], excluded_nodes=[master.node_id, rest[1].node_id])
    before = greedy(rest[1])
    killed_at = time.monotonic()
    master.kill()
    new_master = wait_until(
        lambda: (m := master_of(rest[0])) not in (None, master_id) and m == master_of(rest[1]) and m,
        10,
        "a new master",
    )
    assert time.monotonic() - killed_at < 6
    assert new_master in {n.node_id for n in rest}
    assert instance_id in state_of(rest[1])["instances"]
    wait_until(lambda: instance_ready(rest[1], instance_id), 30, "the instance to serve again")
    assert greedy(rest[1]) == before


def test_kill_9_of_a_worker_fails_the_in_flight_stream(three: list[LocalNode]) -> None:
    api, worker, other = three
    if master_of(api) == worker.node_id:
        worker, other = other, worker
    place_and_wait(api, excluded_nodes=[api.node_id, other.node_id])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "stream": True}
    body["temperature"] = 0.0  # greedy from "go" runs to the context limit: the stream cannot end before the kill
    with (
        httpx.Client(base_url=api.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        worker.kill()
        killed_at = time.monotonic()
        errors = []
        for line in lines:
            if line.startswith("data: {") and '"error"' in line:
                errors.append(json.loads(line[6:])["error"])
            if line == "data: [DONE]":
                break
        elapsed = time.monotonic() - killed_at
    assert errors and "retry" in errors[0]["message"], errors
    assert elapsed < 6, f"error arrived {elapsed:.1f} s after the kill"


PLACEMENT_FAILURES = [
    ({"min_nodes": 4}, 400, "NoConnectedCycle"),
    ({"sharding": "Tensor", "min_nodes": 3}, 400, "TensorNotSupported"),
    ({"model_id": "meta-llama/Llama-3.3-70B-Instruct", "min_nodes": 3}, 400, "InsufficientMemory"),
    ({"model_id": "meta-llama/Llama-3.3-70B-Instruct", "instance_meta": "MlxJaccl"}, 400, "InstanceKindUnsupported"),
]


def test_typed_placement_failures(three: list[LocalNode]) -> None:
    with three[0].client() as client:
        for extra, status, code in PLACEMENT_FAILURES:
            reply = client.post("/place_instance", json={"model_id": MODEL, **extra})
            assert reply.status_code == status and reply.json()["error"]["code"] == code, (extra, reply.text)
        everyone = [n.node_id for n in three]
        reply = client.post("/place_instance", json={"model_id": MODEL, "excluded_nodes": everyone})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "AllCandidatesExcluded"
        previews = client.get("/instance/previews", params={"model_id": MODEL}).json()["previews"]
        assert len([p for p in previews if p["sharding"] == "Pipeline"]) >= 7


def test_place_across_nodes_and_delete(three: list[LocalNode]) -> None:
    reply = place(three[0], min_nodes=2)
    shards = reply["instance"]["MlxRingInstance"]["shardAssignments"]["runnerToShard"]
    layers = sorted(
        (s["PipelineShardMetadata"]["startLayer"], s["PipelineShardMetadata"]["endLayer"]) for s in shards.values()
    )
    assert len(layers) == 2 and layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == 8


def _replace_instance(node: LocalNode, old: str | None, **body: Any) -> str:
    if old is not None:
        with node.client() as client:
            assert client.delete(f"/instance/{old}").status_code == 200
    return place_and_wait(node, **body)


def test_pipeline_and_tensor_across_nodes_match_one_node(three: list[LocalNode]) -> None:
    a, b, c = three
    prompts = ("hello there", "a different prompt")
    instance = _replace_instance(a, None, excluded_nodes=[b.node_id, c.node_id])
    single = [greedy(a, p) for p in prompts]
    bodies: list[dict[str, Any]] = [{"min_nodes": 2}, {"min_nodes": 3}, {"min_nodes": 2, "sharding": "Tensor"}]
    for body in bodies:
        instance = _replace_instance(a, instance, **body)
        world = len(next(iter(state_of(a)["instances"][instance].values()))["shardAssignments"]["nodeToRunner"])
        assert world == body["min_nodes"]
        assert [greedy(a, p) for p in prompts] == single, body
    outside = next(n for n in three if n.node_id not in _members(a, instance))
    assert greedy(outside, prompts[0]) == single[0]


def _members(node: LocalNode, instance_id: str) -> set[str]:
    instance = next(iter(state_of(node)["instances"][instance_id].values()))
    return set(instance["shardAssignments"]["nodeToRunner"])
