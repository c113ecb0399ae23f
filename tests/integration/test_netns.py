"""Two nodes in separate network namespaces, joined by a veth pair, find each other by multicast alone.

Loopback tests use explicit endpoints, so they never exercise scouting on a real link. Here each node sees
only its own end of a veth pair (its own "LAN"), has no bootstrap peer, and must discover the other through
zenoh multicast scouting on the interface it was told to use. Everything the test creates (namespaces, the
veth pair, addresses, routes) lives inside namespaces it owns and deletes; host interfaces are never touched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

API_PORT = 52415
ZENOH_PORT = 7447


def _ip(*args: str) -> None:
    """Run one `ip` command; a failure raises with its stderr so setup problems are readable."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def skip_reason() -> str | None:
    """Why this machine cannot run the test, or None. Namespaces need root and a working `ip netns`."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the tests as root to include this one)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


@dataclass
class NsNode:
    """One `skulk` node running inside its own namespace, reached over HTTP only from inside it."""

    ns: str
    veth: str
    addr: str
    home: Path
    cluster: str
    process: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.home / "node.log"

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [
            "ip", "netns", "exec", self.ns, sys.executable, "-m", "skulk",
            "--multicast", "--multicast-interface", self.veth,
            "--zenoh-listen", f"tcp/{self.addr}:{ZENOH_PORT}",
            "--api-host", "0.0.0.0", "--api-port", str(API_PORT),
            "--home", str(self.home), "--cluster", self.cluster, "--no-place-default",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SKULK_BOOTSTRAP_PEERS", None)
        with self.log_path.open("wb") as log:
            # Own process group: teardown can signal the node and anything it spawned, and nothing else.
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.home, start_new_session=True
            )

    def get(self, path: str) -> Any:
        """GET from inside the namespace: the test process lives in the root namespace and cannot reach it."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns, "curl", "-sf", "-m", "5", f"http://{self.addr}:{API_PORT}{path}"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout else None

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL whatever is left; never leaves a node holding a namespace."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)  # the whole group: the node and anything it spawned
            except ProcessLookupError:
                pass
            try:
                self.process.wait(wait)
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def build_pair(tag: str, subnet: int) -> list[tuple[str, str, str]]:
    """Create two namespaces joined by a veth pair; return (namespace, interface, address) per side.

    The pair is created inside the first namespace with its peer moved straight into the second, so it never
    exists in the host namespace even for a moment.
    """
    sides = [(f"skulk-{tag}-{s}", f"sk{tag}{s}", f"10.231.{subnet}.{i}") for i, s in ((1, "a"), (2, "b"))]
    for ns, _, _ in sides:
        _ip("netns", "add", ns)
    (ns_a, veth_a, _), (ns_b, veth_b, _) = sides
    _ip("-n", ns_a, "link", "add", veth_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
    for ns, veth, addr in sides:
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        _ip("-n", ns, "link", "set", veth, "up", "multicast", "on")
        _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", veth)
    return sides


def delete_namespaces(tag: str) -> None:
    """Deleting a namespace also deletes the veth end inside it (and so the pair)."""
    for side in ("a", "b"):
        subprocess.run(["ip", "netns", "del", f"skulk-{tag}-{side}"], capture_output=True, timeout=20)


@pytest.fixture
def ns_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[NsNode]]:
    reason = skip_reason()
    if reason:
        print(f"SKIP test_netns: {reason}")
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    nodes: list[NsNode] = []

    def teardown() -> None:
        for node in nodes:
            node.stop()
        delete_namespaces(tag)

    request.addfinalizer(teardown)
    cluster = f"netns{tag}"
    for ns, veth, addr in build_pair(tag, random.randint(0, 255)):
        nodes.append(NsNode(ns=ns, veth=veth, addr=addr, home=tmp_path / ns, cluster=cluster))
    for node in nodes:
        node.start()
    yield nodes


def formed(nodes: list[NsNode]) -> bool:
    """Each node lists both node ids in nodeMemory, sees both directed links, and all agree on one master."""
    ids = {n.get("/node_id") for n in nodes}
    states = [n.get("/state") for n in nodes]
    if None in ids or len(ids) != 2 or any(s is None for s in states):
        return False
    return (
        all(set(s["nodeMemory"]) == ids for s in states)
        and all(len(s["topology"]["connections"]) == 2 for s in states)
        and len({s["masterNodeId"] for s in states}) == 1
        and states[0]["masterNodeId"] in ids
    )


@pytest.mark.timeout(120)
def test_two_namespaces_discover_each_other_by_multicast(ns_nodes: list[NsNode]) -> None:
    """No bootstrap peers: formation here can only come from multicast scouting over the veth link."""
    deadline = time.monotonic() + 60
    started = time.monotonic()
    while not formed(ns_nodes):
        for node in ns_nodes:
            assert node.process is not None and node.process.poll() is None, f"{node.ns} died:\n{node.log_tail()}"
        if time.monotonic() > deadline:
            detail = "\n".join(f"--- {n.ns}: {n.get('/state')}\n{n.log_tail()}" for n in ns_nodes)
            raise AssertionError(f"the two namespaced nodes did not form one cluster in 60 s\n{detail}")
        time.sleep(0.3)
    print(f"formed over veth by multicast in {time.monotonic() - started:.1f} s")
