"""Trust through a failover (issue 27): what a host without the cluster key can still try once the master dies.

Three real nodes with a cluster key and API keys; an attacker is a plain zenoh peer on their endpoints. It
replays a sealed command it captured to the master that follows a `kill -9`, and it holds the liveliness token
`alive/<master id>` so that the dead master would look alive. Neither may work: the new master refuses a command
addressed to the old term (and counts it), and a failover happens within the normal lease while the phantom
token is held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import zenoh

from skulk.cluster.intake import COMMANDS_KEY
from skulk.cluster.seal import generate_key
from skulk.cluster.transport import LEASE_MS
from skulk.testing.convergence import master_of, one_master
from skulk.testing.nodes import LocalNode

from .harness import Cluster, wait_until

MODEL = "skulk/tiny-random-llama"
ADMIN = "admin-key-trust"
CLUSTER_KEY = generate_key()
ENV = {"SKULK_ADMIN_KEYS": ADMIN, "SKULK_CLUSTER_KEY": CLUSTER_KEY}
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
LEASE_S = LEASE_MS / 1000
FAILOVER_S = LEASE_S + 3.0 + 0.5
"""The normal failover bound after a master stops heartbeating (hung or unreachable): the lease, then the 3 s
election timeout chaos tests allow, then the vacancy window."""
pytestmark = pytest.mark.timeout(300)


@contextmanager
def attacker(nodes: list[LocalNode]) -> Iterator[zenoh.Session]:
    """A zenoh peer without the cluster key, connected to every node."""
    conf = zenoh.Config()
    conf.insert_json5("mode", json.dumps("peer"))
    conf.insert_json5("connect/endpoints", json.dumps([n.endpoint for n in nodes]))
    conf.insert_json5("scouting/multicast/enabled", "false")
    session = zenoh.open(conf)
    try:
        yield session
    finally:
        session.close()


def security(node: LocalNode) -> dict[str, Any]:
    return httpx.get(node.url + "/v1/diagnostics/security", headers=HEADERS, timeout=10).json()


def instances(node: LocalNode) -> set[str]:
    state = node.get("/state", timeout=10)
    return set(state["instances"]) if state else set()


def test_a_command_captured_before_failover_is_refused_by_the_new_master(cluster: Cluster) -> None:
    """Capture the ciphertext of a PlaceInstance, delete that instance, kill -9 the master, replay the ciphertext
    to the survivors: the instance stays deleted and the new master counts the replay."""
    cluster.extra_env = ENV
    nodes = cluster.form(3, headers=HEADERS)
    master = cluster.master(nodes)
    api = next(n for n in nodes if n is not master)
    captured: list[bytes] = []
    with attacker(nodes) as session:
        session.declare_subscriber(f"skulk/{cluster.name}/{COMMANDS_KEY}",
                                   lambda sample: captured.append(sample.payload.to_bytes()))
        time.sleep(1.0)  # the subscription reaches every node (zenoh declares it asynchronously)
        placed_at = time.monotonic()
        status, reply = api.post("/place_instance", {"model_id": MODEL})
        assert status == 200, reply
        instance_id = reply["instanceId"]
        wait_until(lambda: instance_id in instances(api), 30, "the placed instance in state")
        placement = list(captured)  # the PlaceInstance only: replaying the DeleteInstance too would undo it
        deleted = httpx.delete(f"{api.url}/instance/{instance_id}", headers=HEADERS, timeout=30)
        assert deleted.status_code == 200, deleted.text
        survivors = [n for n in nodes if n is not master]
        wait_until(lambda: all(instance_id not in instances(n) for n in survivors), 30, "the instance deleted")
        assert placement, "the attacker heard no command"
        master.kill()
        wait_until(lambda: (m := one_master(survivors)) is not None and m != master.node_id, 30, "a new master")
        before = sum(security(n)["replayedDropped"] for n in survivors)
        assert time.monotonic() - placed_at < 50, "the capture is too old to test anything but the age limit"
        for payload in placement:
            session.put(f"skulk/{cluster.name}/{COMMANDS_KEY}", payload)
        wait_until(lambda: sum(security(n)["replayedDropped"] for n in survivors) > before
                   or any(instance_id in instances(n) for n in survivors), 20, "the replay refused or applied",
                   lambda: "\n".join(n.log_tail(30) for n in survivors))
        time.sleep(1.0)  # an applied replay would reach every follower within this
        assert all(instance_id not in instances(n) for n in survivors), "the replayed command re-created the instance"


def test_a_phantom_master_token_does_not_delay_failover(cluster: Cluster) -> None:
    """The attacker holds `alive/<master id>` (and `alive/<a made-up id>`): neither counts as a member, and after
    kill -9 of the master the survivors elect a new one within the lease-bound failover time."""
    cluster.extra_env = ENV
    nodes = cluster.form(3, headers=HEADERS)
    master = cluster.master(nodes)
    survivors = [n for n in nodes if n is not master]
    with attacker(nodes) as session:
        phantom = session.liveliness().declare_token(f"skulk/{cluster.name}/alive/{master.node_id}")
        ghost = session.liveliness().declare_token(f"skulk/{cluster.name}/alive/ghost0000node")
        try:
            wait_until(lambda: all("ghost0000node" in security(n)["unvouchedTokens"] for n in nodes), 10,
                       "every node to see the phantom tokens")
            for node in nodes:
                seen = security(node)
                assert "ghost0000node" not in seen["members"] and len(seen["members"]) == 3, seen
            killed_at = time.monotonic()
            master.kill()
            wait_until(lambda: (m := one_master(survivors)) is not None and m != master.node_id, 30,
                       "a new master while the phantom token is held")
            took = time.monotonic() - killed_at
            assert took < FAILOVER_S + 2.0, f"failover took {took:.1f} s with a phantom token"
            assert master_of(survivors[0]) in {n.node_id for n in survivors}
        finally:
            phantom.undeclare()
            ghost.undeclare()
