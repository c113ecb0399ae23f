"""Start real `skulk` node processes on loopback with explicit zenoh endpoints, and stop them cleanly.

Each node runs in its own session (process group), so a test can freeze or kill a node together with its
runner processes (`pause`/`resume`, as a laptop lid or a stuck VM would) and cleanup can find every process
the node ever spawned through the group, even one that outlived it.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import psutil

READY_MARK = "SKULK_READY"


_HANDED_OUT: set[int] = set()


def _port_range() -> tuple[int, int]:
    """20000-29000, split between pytest-xdist workers so two test processes never pick the same port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    span = 9000 // count
    index = int(worker) % count if worker.isdigit() else 0
    return 20000 + index * span, 20000 + (index + 1) * span - 1


def free_port() -> int:
    """A TCP port free right now, chosen below the kernel's ephemeral range (32768 and up) and below the
    rendezvous ports placement picks (29500-29999): a port handed out by binding to 0 is an ephemeral one, which
    any outgoing connection on the machine may take before the node binds it (seen as 'Address already in
    use' on a busy CI machine)."""
    rng = random.Random()
    low, high = _port_range()
    for _ in range(200):
        port = rng.randint(low, high)
        if port in _HANDED_OUT:
            continue  # not bound yet by the node it was chosen for, but taken all the same
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalNode:
    home: Path
    cluster: str
    api_port: int = field(default_factory=free_port)
    zenoh_port: int = field(default_factory=free_port)
    peers: list[str] = field(default_factory=list)
    place_default: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    """Sent with every get/post/client call (an API key, when the node is started with keys)."""
    extra_args: list[str] = field(default_factory=list)
    """Appended to the node's command line (flags a test wants visible there, such as keys)."""
    tls: tuple[Path, Path] | None = None
    """(cert, key): the node serves https with them (--tls-cert/--tls-key), and this harness trusts the cert."""
    process: subprocess.Popen[str] | None = None
    node_id: str = ""
    output: deque[str] = field(default_factory=lambda: deque(maxlen=400))
    paused: bool = False
    _ready: threading.Event = field(default_factory=threading.Event)
    _children: set[int] = field(default_factory=set)
    _groups: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.api_port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What httpx's `verify=` takes to trust this node: its own certificate when it serves https."""
        return ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else True

    @property
    def endpoint(self) -> str:
        return f"tcp/127.0.0.1:{self.zenoh_port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "skulk",
            "--api-host",
            "127.0.0.1",
            "--api-port",
            str(self.api_port),
            "--home",
            str(self.home),
            "--cluster",
            self.cluster,
            "--no-multicast",
            "--zenoh-listen",
            self.endpoint,
            "--place-default" if self.place_default else "--no-place-default",
        ]
        for peer in self.peers:
            cmd += ["--bootstrap-peer", peer]
        if self.tls:
            cmd += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        return cmd + self.extra_args

    def start(self) -> Self:
        # the random demo model is the tests' default placement; a test placing the real one asks for it
        # no start-up compute calibration (a few CPU-seconds a node, hundreds of nodes a suite) unless a test asks
        # and no spare runner (a node's imports of torch ahead of need, ~300 MB) unless a test asks
        env = {"SKULK_DEFAULT_MODEL": "skulk/tiny-random-llama", "SKULK_CALIBRATE_COMPUTE": "0",
               "SKULK_SPARE_RUNNER": "0", **os.environ,
               "PYTHONUNBUFFERED": "1", **self.extra_env}
        self.home.mkdir(parents=True, exist_ok=True)
        self.node_id = ""
        self.paused = False
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=self.home,
            start_new_session=True,  # its own group: pause/kill reach its runners, and nothing else
        )
        self._groups.add(self.process.pid)
        threading.Thread(target=self._pump, args=(self.process, self._ready), daemon=True).start()
        return self

    def restart(self, peers: list[str] | None = None, place_default: bool | None = None) -> Self:
        """Start again after stop() or kill(): same home and ports, so peers that dial its endpoint reconnect.

        The node id is per zenoh session, so the restarted node has a new one (read it after wait_ready()).
        `peers=None` keeps the bootstrap peers; `[]` starts it with none, as the first node of a cluster is.
        """
        assert self.process is None or self.process.poll() is not None, "restart() of a running node"
        if peers is not None:
            self.peers = list(peers)
        if place_default is not None:
            self.place_default = place_default
        self.output.append(f"---- restarted (peers={self.peers}) ----")
        return self.start()

    def _pump(self, process: subprocess.Popen[str], ready: threading.Event) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.output.append(line.rstrip())
            if line.startswith(READY_MARK):
                self.node_id = line.split("node=")[1].split()[0]
                ready.set()
        ready.set()

    def wait_ready(self, timeout: float = 60.0) -> Self:
        if not self._ready.wait(timeout) or not self.node_id:
            raise RuntimeError(f"node did not become ready; last output:\n{self.log_tail()}")
        return self

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(list(self.output)[-lines:])

    def get(self, path: str, timeout: float = 5.0) -> Any:
        """GET a JSON document from the node's API, or None while it is down, frozen or not yet serving.

        Polling treats all of those as 'not yet': the caller's deadline decides when that becomes a failure."""
        try:
            return httpx.get(self.url + path, timeout=timeout, trust_env=False, headers=self.headers,
                             verify=self.verify).json()
        except (httpx.HTTPError, ValueError):
            return None

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, Any]:
        """POST JSON; (HTTP status, parsed body), status 0 if nothing answered. Same as NsNode.post."""
        try:
            reply = httpx.post(self.url + path, json=body, timeout=timeout, trust_env=False, headers=self.headers,
                               verify=self.verify)
        except httpx.HTTPError:
            return 0, None
        try:
            return reply.status_code, reply.json()
        except ValueError:
            return reply.status_code, reply.text

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers, verify=self.verify)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def child_pids(self) -> set[int]:
        """Every descendant seen so far, remembered so a check after stop() knows what to look for.

        Members of the node's process groups count too: a runner whose node died is reparented away from it,
        but keeps the group of the node that started it."""
        if self.alive:
            assert self.process is not None
            try:
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    self._children.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        self._children |= self._group_members() - {p.pid for p in self._own_processes()}
        return set(self._children)

    def _own_processes(self) -> list[subprocess.Popen[str]]:
        return [self.process] if self.process is not None else []

    def _group_members(self) -> set[int]:
        """Live processes in any group this node ever led (each start() leads a fresh one)."""
        found = set()
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) in self._groups:
                    found.add(proc.pid)
            except (ProcessLookupError, PermissionError):
                continue
        return found

    def runner_pids(self) -> set[int]:
        """Live runner processes of this node (multiprocessing spawn children, not its resource tracker)."""
        found = set()
        for pid in self.child_pids():
            try:
                if "spawn_main" in " ".join(psutil.Process(pid).cmdline()):
                    found.add(pid)
            except psutil.NoSuchProcess:
                continue
        return found

    def pause(self) -> None:
        """SIGSTOP the node's whole process group (node and runners), as if its machine froze."""
        assert self.process is not None and self.alive, "pause() of a node that is not running"
        self.child_pids()
        os.killpg(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT the group; safe to call when not paused or already gone (cleanup calls it unconditionally)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.paused = False

    def kill(self) -> float:
        """SIGKILL the node process alone, as an operator's `kill -9 <pid>` would; its runners must notice.

        Returns the monotonic time the signal was sent, for tests that time the cluster's reaction."""
        self.child_pids()
        killed_at = time.monotonic()
        if self.alive:
            assert self.process is not None
            self.resume()  # a stopped process dies on SIGKILL too, but its runners should not stay frozen
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        return killed_at

    def stop(self, timeout: float = 20.0) -> None:
        self.child_pids()
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()  # SIGTERM to a stopped process would wait for a SIGCONT that never comes
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def reap_leftovers(self, timeout: float = 10.0) -> list[int]:
        """Kill what survived (a test failure, never normal) and return the pids that had survived."""
        deadline = time.monotonic() + timeout
        self.child_pids()
        for group in self._groups:  # a frozen leftover would ignore everything but SIGKILL
            try:
                os.killpg(group, signal.SIGCONT)
            except ProcessLookupError:
                continue
        alive = [p for p in self._children if psutil.pid_exists(p)]
        while alive and time.monotonic() < deadline:
            _gone, still = psutil.wait_procs([psutil.Process(p) for p in alive if psutil.pid_exists(p)], 0.5)
            alive = [p.pid for p in still]
        for pid in alive:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        return alive
