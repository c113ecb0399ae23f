"""Runner faults over real node processes: a frozen runner is declared hung and restarted, a poisoned request
fails alone, crashes are a budget over time, and a multi-rank instance whose rank died restarts as a whole."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, instance_ready, place, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
pytestmark = pytest.mark.timeout(240)


def body(content: str = "go", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def state_of(node: LocalNode) -> dict[str, Any]:
    return httpx.get(f"{node.url}/state", timeout=10).json()


def chat_ok(node: LocalNode) -> bool:
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=body(max_tokens=4, temperature=0), timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def only_runner(node: LocalNode) -> int:
    return wait_until(lambda: next(iter(node.runner_pids()), None), 60, "a runner process")


def new_runner(node: LocalNode, old: int) -> int:
    return wait_until(lambda: next(iter(node.runner_pids() - {old}), None), 60, "a restarted runner process")


def stream_until_error(node: LocalNode, payload: dict[str, Any], on_first_token: Any) -> tuple[list[Any], float]:
    """Open a long stream, call on_first_token() once tokens flow, return (error events, seconds after it)."""
    errors: list[Any] = []
    with (
        httpx.Client(base_url=node.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=payload) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        on_first_token()
        started = time.monotonic()
        for line in lines:
            if line.startswith("data: {") and '"error"' in line:
                errors.append(json.loads(line[6:])["error"])
            if line == "data: [DONE]":
                break
        return errors, time.monotonic() - started


# nearly the demo's whole context (2048), greedy: the demo model then writes every token (sampled with seed 7 it
# ends after 192, a fifth of a second on the f32 kernel: a fault injected after the first token could miss it)
LONG = body(max_tokens=2000, temperature=0.0, stream=True)
WINDOW_S = 2.0


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalNode, str]]:
    """One single-rank node for the tests that leave it serving (it costs a start and a placement once):
    poisoned requests raise while sampling, and the restart window is short so crashes can be spread."""
    nodes = Cluster(Path(tmp_path_factory.mktemp("faulty")))
    env = {"SKULK_FAULT": "raise:sample", "SKULK_RUNNER_RESTART_WINDOW_SECONDS": str(WINDOW_S)}
    (node,) = nodes.start(1, extra_env=env)
    instance_id = place_and_wait(node)
    yield node, instance_id
    assert nodes.stop_all() == [], "runner processes outlived their node"


def serving(node: LocalNode, instance_id: str) -> None:
    wait_until(lambda: instance_ready(node, instance_id), 90, "the runner serving", node.log_tail)


def test_a_frozen_runner_is_declared_hung_and_restarted(faulty: tuple[LocalNode, str]) -> None:
    node, instance_id = faulty
    serving(node, instance_id)
    frozen = only_runner(node)
    errors, elapsed = stream_until_error(node, LONG, lambda: os.kill(frozen, signal.SIGSTOP))
    assert errors and errors[0]["retryable"] is True, errors
    assert "made no progress" in errors[0]["message"] and "retry" in errors[0]["message"], errors
    assert elapsed <= 20, f"the error came {elapsed:.1f} s after SIGSTOP (hung limit 15 s)"
    new_runner(node, frozen)
    serving(node, instance_id)
    runners = node.get("/v1/diagnostics/node")["supervisorRunners"]
    assert [r["exitCode"] for r in runners] == [None], "the killed process's -9 is not the restarted runner's"
    assert chat_ok(node)
    assert "declared hung" in "\n".join(node.output)


def test_a_poisoned_request_fails_alone(faulty: tuple[LocalNode, str]) -> None:
    node, instance_id = faulty
    serving(node, instance_id)
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=body(seed=2**64), timeout=30)
    assert reply.status_code == 422 and "seed" in reply.json()["error"]["message"], reply.text
    runner = only_runner(node)
    poison_among_good(node)
    assert node.runner_pids() == {runner}, "the runner kept serving"


def poison_among_good(node: LocalNode) -> None:
    """Two good chats and a poisoned one at the same time: the poisoned one gets a 500, the others complete."""
    results: dict[str, httpx.Response] = {}

    def send(name: str, content: str) -> None:
        payload = body(content, max_tokens=24, temperature=0)
        results[name] = httpx.post(f"{node.url}/v1/chat/completions", json=payload, timeout=60)

    threads = [threading.Thread(target=send, args=(f"good{i}", f"hello {i}")) for i in range(2)]
    threads.append(threading.Thread(target=send, args=("bad", "SKULK_POISON hello")))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    bad = results["bad"]
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "internal_error", bad.text
    assert "InjectedFault" in bad.json()["error"]["message"]
    for name in ("good0", "good1"):
        assert results[name].status_code == 200, results[name].text
        assert results[name].json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_crashes_spread_over_time_leave_a_runner_serving(faulty: tuple[LocalNode, str]) -> None:
    node, instance_id = faulty
    serving(node, instance_id)
    last_kill = 0.0
    for _crash in range(5):  # budget 3 per window; 5 crashes, each more than a window after the last
        runner = only_runner(node)
        time.sleep(max(0.0, last_kill + WINDOW_S + 0.5 - time.monotonic()))  # spacing is the point here
        os.kill(runner, signal.SIGKILL)
        last_kill = time.monotonic()
        new_runner(node, runner)
        serving(node, instance_id)
        assert chat_ok(node)
    assert state_of(node).get("instanceRetries", {}).get(instance_id, {}).get("failed") is None
    assert "restarting in 0.5 s (attempt 1 of 3 within 2 s)" in "\n".join(node.output)


def test_crashes_over_budget_fail_the_instance_visibly_and_chats_fast(cluster: Cluster) -> None:
    (node,) = cluster.start(1)
    instance_id = place_and_wait(node)
    runner = only_runner(node)
    for _crash in range(4):  # budget 3 within 60 s: the fourth crash is one too many
        os.kill(runner, signal.SIGKILL)
        if _crash < 3:
            runner = new_runner(node, runner)

    def failed_for_good() -> bool:
        state = state_of(node)
        runners = next(iter(state["instances"][instance_id].values()))["shardAssignments"]["runnerToShard"]
        return bool(state.get("instanceRetries", {}).get(instance_id, {}).get("failed")) and all(
            "RunnerFailed" in state["runners"].get(r, {}) for r in runners
        )

    wait_until(failed_for_good, 30, "the instance failed for good in /state", node.log_tail)
    started = time.monotonic()
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=body(max_tokens=4), timeout=30)
    assert time.monotonic() - started < 5
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "instance_failed" and "place it again" in error["message"], error
    assert not node.runner_pids(), "no restart over budget"


def test_a_killed_rank_restarts_its_multi_rank_instance_as_a_whole(cluster: Cluster) -> None:
    """Also: a request that raises on the sampling rank fails alone there too (the ranks agree to drop it)."""
    nodes = cluster.start(2, extra_env={"SKULK_FAULT": "raise:sample"})
    wait_until(lambda: all(len(state_of(n)["topology"]["connections"]) == 2 for n in nodes), 30, "links")
    instance_id = place(nodes[0], min_nodes=2)["instanceId"]
    wait_until(lambda: instance_ready(nodes[0], instance_id), 120, "the 2-rank instance", nodes[0].log_tail)
    shards = next(iter(state_of(nodes[0])["instances"][instance_id].values()))["shardAssignments"]
    rank_of = {r: next(iter(s.values()))["deviceRank"] for r, s in shards["runnerToShard"].items()}
    holder = {rank_of[r]: next(n for n in nodes if n.node_id == nid) for nid, r in shards["nodeToRunner"].items()}
    before = {rank: only_runner(holder[rank]) for rank in (0, 1)}
    poison_among_good(nodes[0])
    assert all(holder[rank].runner_pids() == {before[rank]} for rank in (0, 1)), "both ranks kept serving"
    errors, elapsed = stream_until_error(nodes[0], LONG, lambda: os.kill(before[1], signal.SIGKILL))
    assert errors and errors[0]["retryable"] is True, errors
    assert elapsed < 15, f"the stream ended {elapsed:.1f} s after the kill"
    for rank in (0, 1):
        new_runner(holder[rank], before[rank])
    wait_until(lambda: instance_ready(nodes[0], instance_id), 120, "the instance serving again",
               lambda: nodes[0].log_tail() + "\n" + nodes[1].log_tail())
    state = state_of(nodes[0])
    assert instance_id in state["instances"] and state["instanceRetries"][instance_id]["attempt"] == 1
    assert chat_ok(nodes[0])
    logs = "\n".join(line for n in nodes for line in n.output)
    assert "retrying as a whole (attempt 1 of 3 within 60 s)" in logs and "failed by a fault" in logs
