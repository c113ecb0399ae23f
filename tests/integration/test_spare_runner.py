"""A node's spare runner (worker/spare.py, issue 38) over a real node process: it is spawned once the node's runner
is ready, a runner killed with `kill -9` comes back as the spare (its pid, its milestone), a new spare follows once
that runner is ready, and a `kill -9` of the node leaves none of them behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    # at once, not after the start-up's 20 s (worker/spare.py): the test waits on the spare's process instead
    spare_env = {"SKULK_SPARE_RUNNER": "1", "SKULK_SPARE_AFTER_S": "0"}
    cluster = Cluster(tmp_path_factory.mktemp("spare"), extra_env=spare_env)
    (started,) = cluster.start(1)
    place_and_wait(started)
    yield started
    assert cluster.stop_all() == [], "runner processes outlived their node"


def supervisors(node: LocalNode) -> list[dict[str, Any]]:
    reply = httpx.get(f"{node.url}/v1/diagnostics/node", timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["supervisorRunners"]


def ready_runner(node: LocalNode) -> int | None:
    """The pid of the node's one runner once it is ready, else None."""
    found = supervisors(node)
    if len(found) != 1 or found[0]["statusKind"] not in ("RunnerReady", "RunnerRunning"):
        return None
    return found[0]["pid"]


def spare(node: LocalNode, runner: int) -> int | None:
    """The one runner-like process of the node that is not its runner: the spare."""
    others = node.runner_pids() - {runner}
    return next(iter(others)) if len(others) == 1 else None


def chat_ok(node: LocalNode) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_killed_runner_comes_back_as_the_spare(node: LocalNode) -> None:
    runner = wait_until(lambda: ready_runner(node), 120, "the default instance's runner to be ready")
    warm = wait_until(lambda: spare(node, runner), 60, "a spare runner beside the ready one")
    assert node.process is not None and psutil.Process(warm).ppid() == node.process.pid  # the node's own child
    os.kill(runner, signal.SIGKILL)
    replaced = wait_until(lambda: (pid := ready_runner(node)) not in (None, runner) and pid, 120,
                          "the killed runner's replacement to be ready")
    assert replaced == warm, (replaced, warm)
    milestones = [m.get("detail") or "" for m in supervisors(node)[0]["milestones"] if m["name"] == "spawned"]
    assert any("spare" in m and str(warm) in m for m in milestones), milestones
    chat_ok(node)
    refilled = wait_until(lambda: spare(node, replaced), 60, "a new spare once the replacement is ready")
    assert refilled not in (runner, warm)


def test_a_killed_node_leaves_no_runner_or_spare(node: LocalNode) -> None:
    """Last: it kills the node. The spare is a child of the node like its runner; both notice and exit."""
    runner = wait_until(lambda: ready_runner(node), 120, "a ready runner")
    warm = wait_until(lambda: spare(node, runner), 60, "a spare")
    node.kill()
    gone = wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                      for p in (runner, warm)), 30, "the runner and the spare to exit")
    assert gone
