"""Start real `skulk` node processes on loopback with explicit zenoh endpoints, and stop them cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

READY_MARK = "SKULK_READY"


def free_port() -> int:
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
    process: subprocess.Popen[str] | None = None
    node_id: str = ""
    output: deque[str] = field(default_factory=lambda: deque(maxlen=400))
    _ready: threading.Event = field(default_factory=threading.Event)
    _children: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

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
        return cmd

    def start(self) -> LocalNode:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        self.home.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=self.home,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip())
            if line.startswith(READY_MARK):
                self.node_id = line.split("node=")[1].split()[0]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 60.0) -> LocalNode:
        if not self._ready.wait(timeout) or not self.node_id:
            raise RuntimeError(f"node did not become ready; last output:\n{self.log_tail()}")
        return self

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(list(self.output)[-lines:])

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def child_pids(self) -> set[int]:
        """Every descendant seen so far, remembered so a check after stop() knows what to look for."""
        if self.process is not None and self.process.poll() is None:
            try:
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    self._children.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        return set(self._children)

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

    def kill(self) -> None:
        """SIGKILL, as an operator's `kill -9` would."""
        self.child_pids()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        self.child_pids()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def reap_leftovers(self, timeout: float = 10.0) -> list[int]:
        """Kill what survived (a test failure, never normal) and return the pids that had survived."""
        deadline = time.monotonic() + timeout
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
