"""Nodes in their own network namespaces, for faults loopback cannot stage: a link that goes down.

Everything here lives inside namespaces it creates and deletes (the veth pairs are created inside a
namespace with the peer moved straight into another, so they never exist in the host namespace): host
interfaces are never touched. The test process stays in the root namespace and reaches a node's API by
running curl inside the node's namespace. Needs root and iproute2; `skip_reason()` says why not.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .nodes import LocalNode

API_PORT = 52415
ZENOH_PORT = 7447
CLONE_NEWNET = 0x40000000


def enter(ns: str) -> None:
    """Move the calling thread, and only it, into namespace `ns` (network namespaces are per thread).

    For a client that must hold a connection open inside a namespace (a stream), where curl per request will
    not do; run it on a thread of its own that ends with the work."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{ns}") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")


def ip(*args: str) -> None:
    """Run one `ip` command; a failure raises with its stderr so setup problems are readable."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def skip_reason() -> str | None:
    """Why this machine cannot run namespace tests, or None. Namespaces need root and a working `ip netns`."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the tests as root to include this one)"
    for tool in ("ip", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


@dataclass
class NsNode(LocalNode):
    """A LocalNode whose process runs inside namespace `ns` and listens on `addr` of interface `veth`.

    Pause, kill, stop, restart and reaping are LocalNode's: `ip netns exec` execs the node in place, so the
    process started is the node itself and leads its own group."""

    ns: str = ""
    veth: str = ""
    addr: str = ""
    multicast: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.api_port}"

    @property
    def endpoint(self) -> str:
        return f"tcp/{self.addr}:{self.zenoh_port}"

    def command(self) -> list[str]:
        scouting = ["--multicast", "--multicast-interface", self.veth] if self.multicast else ["--no-multicast"]
        cmd = [
            "ip", "netns", "exec", self.ns, sys.executable, "-m", "skulk", *scouting,
            "--zenoh-listen", self.endpoint, "--api-host", "0.0.0.0", "--api-port", str(self.api_port),
            "--home", str(self.home), "--cluster", self.cluster,
            "--place-default" if self.place_default else "--no-place-default",
        ]  # fmt: skip
        for peer in self.peers:
            cmd += ["--bootstrap-peer", peer]
        return cmd

    def get(self, path: str, timeout: float = 5.0) -> Any:
        """GET from inside the namespace (the root namespace cannot reach it); None unless it answers 200."""
        status, body = self._curl(path, timeout)
        return body if status == 200 else None

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, Any]:
        """POST JSON from inside the namespace; (HTTP status, parsed body), status 0 if nothing answered."""
        return self._curl(path, timeout, "-X", "POST", "-H", "Content-Type: application/json", "-d", json.dumps(body))

    def _curl(self, path: str, timeout: float, *extra: str) -> tuple[int, Any]:
        cmd = ["ip", "netns", "exec", self.ns, "curl", "-s", "-m", str(timeout), "-w", "\n%{http_code}", *extra]
        try:
            out = subprocess.run([*cmd, self.url + path], capture_output=True, text=True, timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            return 0, None
        text, _, status = out.stdout.rpartition("\n")
        try:
            return int(status or 0), json.loads(text) if text else None
        except ValueError:
            return int(status or 0), None


def veth_pair(ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
    """A veth pair created inside `ns_a` with its peer moved straight into `ns_b`: never in the host namespace."""
    ip("-n", ns_a, "link", "add", name_a, "type", "veth", "peer", "name", name_b, "netns", ns_b)


def add_namespace(ns: str) -> None:
    ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")


def delete_namespace(ns: str) -> None:
    """Deleting a namespace deletes the veth ends inside it, and so the pairs; absent is fine."""
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@dataclass
class BridgedLan:
    """`size` node namespaces, each wired by a veth pair to one bridge in a hub namespace: a switch and its
    cables. cut(i) pulls node i's cable (its hub-side end goes down), heal(i) plugs it back in."""

    size: int
    subnet: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    created: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"skulk-{self.tag}-hub"

    def side(self, index: int) -> tuple[str, str, str]:
        """(namespace, interface, address) of node `index`."""
        return f"skulk-{self.tag}-{index}", f"sk{self.tag}n{index}", f"10.232.{self.subnet}.{index + 1}"

    def cable(self, index: int) -> str:
        return f"sk{self.tag}h{index}"

    def build(self) -> BridgedLan:
        """Create everything; on a failure part way, delete what was made before raising."""
        try:
            self._build()
        except Exception:
            self.delete()
            raise
        return self

    def _build(self) -> None:
        add_namespace(self.hub)
        self.created.append(self.hub)
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for index in range(self.size):
            ns, veth, addr = self.side(index)
            add_namespace(ns)
            self.created.append(ns)
            veth_pair(ns, veth, self.hub, self.cable(index))
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up", "multicast", "on")
            ip("-n", self.hub, "link", "set", self.cable(index), "master", "br0", "up")

    def cut(self, index: int) -> None:
        ip("-n", self.hub, "link", "set", self.cable(index), "down")

    def heal(self, index: int) -> None:
        ip("-n", self.hub, "link", "set", self.cable(index), "up")

    def delete(self) -> None:
        for ns in reversed(self.created):
            delete_namespace(ns)
        self.created.clear()


def start_nodes(lan: BridgedLan, root: Path, cluster: str, nodes: list[NsNode]) -> list[NsNode]:
    """One node per namespace of the LAN, as the README recipe starts them: node 0 without bootstrap peers,
    the others bootstrapping to node 0's endpoint. Returns once every node printed ready.

    Appends to the caller's `nodes` as each starts, so its cleanup reaches a node even if a later one fails."""
    for index in range(lan.size):
        ns, veth, addr = lan.side(index)
        peers = [nodes[0].endpoint] if nodes else []
        node = NsNode(
            home=root / f"node{index}", cluster=cluster, api_port=API_PORT, zenoh_port=ZENOH_PORT,
            peers=peers, ns=ns, veth=veth, addr=addr,
        )  # fmt: skip
        nodes.append(node.start())
    for node in nodes:
        node.wait_ready()
    return nodes
