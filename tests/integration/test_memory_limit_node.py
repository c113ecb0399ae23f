"""A node knows its limit (issue 41), with real node processes: one inside a 1.6 GB memory cgroup (as a
container would run it) advertises the group's limit, not the host's RAM, and its runner stays in the group;
one started with SKULK_MEMORY_LIMIT advertises that; a placement that cannot fit is refused naming the node's
limit and where it came from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from skulk.testing.cgroups import MemoryGroup, why_not
from skulk.testing.cluster import DEMO

from .harness import Cluster, place_and_wait, wait_until

pytestmark = pytest.mark.timeout(180)
GROUP_LIMIT = 1_600_000_000
CONFIGURED = 3_000_000_000


@pytest.fixture
def group() -> Iterator[MemoryGroup]:
    if (why := why_not()) is not None:
        pytest.skip(why)
    with MemoryGroup(GROUP_LIMIT) as made:
        yield made


def _memory(node_url: str) -> dict[str, dict[str, object]]:
    try:
        return httpx.get(f"{node_url}/state", timeout=10).json().get("nodeMemory", {})
    except (httpx.HTTPError, ValueError):
        return {}


def test_a_node_advertises_its_limit_and_placement_names_it(cluster: Cluster, group: MemoryGroup,
                                                            tmp_path: Path) -> None:
    capped = cluster.start(1)[0]
    assert capped.process is not None
    group.add(capped.process.pid)
    configured = cluster.start(1, extra_env={"SKULK_MEMORY_LIMIT": "3GB"})[0]

    def limits() -> dict[str, tuple[object, object]]:
        return {n: (m["ramTotal"], m.get("limitSource")) for n, m in _memory(capped.url).items()}

    want = {capped.node_id: ({"inBytes": group.limit}, "cgroup v1"),
            configured.node_id: ({"inBytes": CONFIGURED}, "--memory-limit")}
    wait_until(lambda: limits() == want, 60, "each node's own limit in /state", lambda: str(limits()))
    for node_id, memory in _memory(capped.url).items():
        total, free = memory["ramTotal"], memory["ramAvailable"]
        assert isinstance(total, dict) and isinstance(free, dict) and free["inBytes"] < total["inBytes"]
        assert memory["ramReserved"] == {"inBytes": 512 * 1024**2}, node_id

    status, refused = capped.post("/place_instance", {"model_id": DEMO, "kv_cache_gb": 6})
    assert status == 400 and refused["error"]["code"] == "InsufficientMemory", refused
    message = refused["error"]["message"]
    assert "limit (cgroup v1)" in message or "limit (--memory-limit)" in message, message

    place_and_wait(capped, DEMO, excluded_nodes=[configured.node_id])
    runners = capped.runner_pids()
    assert runners, "a runner was started"
    for pid in runners:
        assert str(pid) in (group.path / "cgroup.procs").read_text().split(), "the runner runs inside the limit"
    status, reply = capped.post("/v1/chat/completions", {"model": DEMO, "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, reply


def test_a_runner_killed_for_memory_shows_in_health_and_names_the_limit(cluster: Cluster) -> None:
    """A runner that outgrows its node's 1.7 GB group (SKULK_FAULT=crash:hog on a poisoned request) is ended by
    the kernel's OOM killer: its failure says OOM and names the node and its limit, the node's health turns
    unhealthy with memory_oom, and the chat ends with a retryable error rather than hanging. (The group holds the
    node, its reserve and a runner as placement counts one: the weights x 1.05 and the runner's 576 MiB.)"""
    if (why := why_not()) is not None:
        pytest.skip(why)
    with MemoryGroup(1_700_000_000) as tight:
        node = cluster.start(1, extra_env={"SKULK_FAULT": "crash:hog"})[0]
        assert node.process is not None
        tight.add(node.process.pid)
        wait_until(lambda: (_memory(node.url).get(node.node_id) or {}).get("limitSource") == "cgroup v1", 60,
                   "the group's limit in /state")
        place_and_wait(node, DEMO)
        status, reply = node.post("/v1/chat/completions", {"model": DEMO, "max_tokens": 4, "messages": [
            {"role": "user", "content": "SKULK_POISON eat"}]}, timeout=120)
        assert status >= 500 and reply["error"].get("retryable") is True, (status, reply)
        assert tight.oom_kills() >= 1, "the kernel's OOM killer ended it"

        def failures() -> list[str]:
            runners = (node.get("/state") or {}).get("runners", {})
            return [s["RunnerFailed"].get("errorMessage") or "" for s in runners.values() if "RunnerFailed" in s]

        def health() -> dict[str, object]:
            return ((node.get("/state") or {}).get("nodeHealth") or {}).get(node.node_id) or {}

        wait_until(lambda: any("OOM" in f for f in failures()) or "memory_oom" in str(health()), 60,
                   "the OOM in state", lambda: f"{failures()} {health()}")
        wait_until(lambda: health().get("level") == "unhealthy" and "memory_oom" in str(health()), 60,
                   "memory_oom in the node's health", lambda: str(health()))
        assert "1.70 GB limit (cgroup v1)" in str(health())
        said = [f for f in failures() if "OOM" in f]
        assert not said or ("whose memory limit is 1.70 GB (cgroup v1)" in said[0] and node.node_id[:8] in said[0])
        node.stop()
