"""An MLX instance on a real node: placed by a MetaInstance that asks for the mlx engine, served through every
API family (OpenAI, Claude, Ollama; streaming, cancel mid-stream), and a killed MLX runner gives the client a
retryable error while the MetaInstance places it again."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from skulk.testing.convergence import formed
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import open_long_stream

from .harness import Cluster, wait_until

pytest.importorskip("mlx_lm")

MODEL = "skulk/tiny-random-llama"
pytestmark = pytest.mark.timeout(240)


def state_of(node: LocalNode) -> dict[str, Any]:
    return httpx.get(f"{node.url}/state", timeout=10).json()


def backing(node: LocalNode, meta_id: str) -> dict[str, dict[str, Any]]:
    bodies = {iid: next(iter(i.values())) for iid, i in state_of(node)["instances"].items()}
    return {iid: b for iid, b in bodies.items() if b.get("metaInstanceId") == meta_id}


def serving(node: LocalNode, instance_id: str) -> bool:
    state = state_of(node)
    instance = state["instances"].get(instance_id)
    if instance is None:
        return False
    runners = next(iter(instance.values()))["shardAssignments"]["runnerToShard"]
    return all({"RunnerReady", "RunnerRunning"} & set(state["runners"].get(r, {})) for r in runners)


def placed_and_serving(node: LocalNode, meta_id: str, timeout: float = 90) -> str:
    return wait_until(lambda: next((i for i in backing(node, meta_id) if serving(node, i)), None), timeout,
                      "the MLX MetaInstance to be placed and serving")


def task_status(node: LocalNode, command_id: str) -> str | None:
    tasks = state_of(node)["tasks"].values()
    return next((t["ChatCompletion"]["taskStatus"] for t in tasks if t["ChatCompletion"]["commandId"] == command_id),
                None)


def ended_cancelled(node: LocalNode, command_id: str) -> None:
    status = wait_until(lambda: (s := task_status(node, command_id)) not in (None, "Pending", "Running") and s, 30,
                        "the abandoned task to end")
    assert status == "Cancelled"


@pytest.fixture(scope="module")
def mlx_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalNode, str]]:
    cluster = Cluster(Path(tmp_path_factory.mktemp("mlx")))
    try:
        (node,) = cluster.start(1)
        reply = httpx.post(f"{node.url}/meta_instance", json={"model_id": MODEL, "engine": "mlx"}, timeout=30)
        assert reply.status_code == 200, reply.text
        meta_id = reply.json()["meta_instance_id"]
        placed_and_serving(node, meta_id)
        yield node, meta_id
    finally:
        cluster.print_logs()
        assert cluster.stop_all() == [], "runner processes outlived their node"


def test_the_node_advertises_mlx_and_the_instance_runs_it(mlx_node: tuple[LocalNode, str]) -> None:
    node, meta_id = mlx_node
    state = state_of(node)
    assert state["nodeBackends"][node.node_id] == ["torch", "torch-cpu", "mlx", "mlx-cpu"]
    assert state["metaInstances"][meta_id]["engine"] == "mlx"
    (instance,) = backing(node, meta_id).values()
    assert instance["engine"] == "mlx"
    previews = node.get(f"/instance/previews?model_id={MODEL}&engine=mlx&sharding=Pipeline")["previews"]
    placeable = [p for p in previews if p["error"] is None]
    assert placeable and all(p["engine_by_node"] == {node.node_id: "mlx"} for p in placeable)
    auto = node.get(f"/instance/previews?model_id={MODEL}&sharding=Pipeline")["previews"]
    assert all(p["engine_by_node"] == {node.node_id: "torch"} for p in auto if p["error"] is None), "auto on Linux"


def test_engine_refusals_are_typed(mlx_node: tuple[LocalNode, str]) -> None:
    node, _ = mlx_node
    with node.client() as client:
        bad = client.post("/place_instance", json={"model_id": MODEL, "engine": "cuda"})
        assert bad.status_code == 422 and "engine" in bad.text
        jaccl = client.post("/place_instance", json={"model_id": MODEL, "engine": "mlx", "instance_meta": "MlxJaccl"})
        assert jaccl.status_code == 400 and "RDMA over Thunderbolt 5, macOS only" in jaccl.text


def test_openai_streaming_and_cancel(mlx_node: tuple[LocalNode, str]) -> None:
    import openai

    node, _ = mlx_node
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=12, temperature=0, stream=True))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                           temperature=0, logprobs=True, top_logprobs=2)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=node.url, timeout=60) as raw:
        with raw.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            command_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
            assert raw.post(f"/v1/cancel/{command_id}").status_code == 200
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and any('"error"' in line for line in rest)
    ended_cancelled(node, command_id)


def test_claude_streaming_and_disconnect_cancels(mlx_node: tuple[LocalNode, str]) -> None:
    import anthropic

    node, _ = mlx_node
    client = anthropic.Anthropic(base_url=node.url, api_key="unused", timeout=60)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1 and final.content[0].text == text  # type: ignore[union-attr]
    body = {"model": MODEL, "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "go"}]}
    with httpx.Client(base_url=node.url, timeout=60) as raw, raw.stream("POST", "/v1/messages", json=body) as reply:
        lines = reply.iter_lines()
        started = next(line for line in lines if line.startswith("data: ") and "message_start" in line)
        message_id = json.loads(started[6:])["message"]["id"]
        next(line for line in lines if "content_block_delta" in line)
    command_id = message_id.removeprefix("msg_")
    ended_cancelled(node, command_id)


def test_ollama_streaming_and_disconnect_cancels(mlx_node: tuple[LocalNode, str]) -> None:
    import ollama

    node, _ = mlx_node
    client = ollama.Client(host=f"{node.url}/ollama", timeout=60)
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                             options={"num_predict": 6, "temperature": 0}))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    before = {t["ChatCompletion"]["commandId"] for t in state_of(node)["tasks"].values()}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True,
            "options": {"num_predict": 2000, "temperature": 0}}
    with httpx.Client(base_url=node.url, timeout=60) as raw, raw.stream("POST", "/ollama/api/chat", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.strip())
        next(line for line in lines if line.strip())
    new = wait_until(lambda: next((t["ChatCompletion"]["commandId"] for t in state_of(node)["tasks"].values()
                                   if t["ChatCompletion"]["commandId"] not in before), None), 30, "the ollama task")
    ended_cancelled(node, new)


def test_a_killed_mlx_runner_fails_the_stream_retryably_and_the_meta_instance_recovers(
    mlx_node: tuple[LocalNode, str],
) -> None:
    """Last in the module: it kills the runner the others used."""
    node, meta_id = mlx_node
    (runner,) = node.runner_pids()
    probe = open_long_stream(node.url, MODEL)
    os.kill(runner, signal.SIGKILL)
    killed = time.monotonic()
    outcome = probe.wait(30)
    assert outcome.retryable_error, outcome.describe()
    assert outcome.ended is not None and outcome.ended - killed < 15, "the client heard within the torch bound"
    wait_until(lambda: state_of(node)["metaInstances"][meta_id]["consecutiveFailures"] >= 1 or None, 60,
               "the MetaInstance to count the failure")
    instance_id = placed_and_serving(node, meta_id)
    assert backing(node, meta_id)[instance_id]["engine"] == "mlx"
    reply = httpx.post(f"{node.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert reply.status_code == 200, reply.text


@pytest.mark.timeout(300)
def test_an_mlx_pipeline_over_two_nodes_serves_and_a_killed_rank_fails_the_stream_retryably(
    cluster: Cluster,
) -> None:
    """Two nodes, one MLX Pipeline instance over MLX's ring backend (hostfile and ports from placement): a chat
    answers, and kill -9 of the rank on the other node ends an open stream with a retryable error; the instance
    restarts as a whole and gives the same greedy reply again."""
    api, other = cluster.form(2)
    body = {"model_id": MODEL, "engine": "mlx", "min_nodes": 2}
    reply = httpx.post(f"{api.url}/place_instance", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    instance = reply.json()["instance"]["MlxRingInstance"]
    assert instance["engine"] == "mlx" and len(instance["shardAssignments"]["nodeToRunner"]) == 2
    wait_until(lambda: serving(api, instance["instanceId"]) or None, 120, "the MLX pipeline to be ready")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
    first = httpx.post(f"{api.url}/v1/chat/completions", json=chat, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] >= 1
    victim = wait_until(lambda: next(iter(other.runner_pids()), None), 30, "the other node's runner")
    probe = open_long_stream(api.url, MODEL)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    outcome = probe.wait(60)
    assert outcome.retryable_error, outcome.describe()
    heard = outcome.ended - killed if outcome.ended is not None else float("inf")
    assert heard < 15, f"heard after {heard:.1f} s"
    print(f"MLX pipeline: the client heard a retryable error {heard:.2f} s after kill -9 of a rank "
          f"({outcome.describe()})")
    wait_until(lambda: serving(api, instance["instanceId"]) or None, 120, "the instance restarted as a whole")
    again = httpx.post(f"{api.url}/v1/chat/completions", json=chat, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def greedy_chat(node: LocalNode) -> dict[str, Any]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    reply = httpx.post(f"{node.url}/v1/chat/completions", json=chat, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def placed_instance(node: LocalNode, **body: Any) -> dict[str, Any]:
    reply = httpx.post(f"{node.url}/place_instance", json={"model_id": MODEL, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    instance: dict[str, Any] = reply.json()["instance"]["MlxRingInstance"]
    wait_until(lambda: serving(node, instance["instanceId"]) or None, 180, "the instance to be ready")
    return instance


@pytest.mark.timeout(420)
def test_a_mixed_mlx_and_torch_pipeline_answers_as_one_rank_and_a_killed_rank_fails_retryably(
    cluster: Cluster,
) -> None:
    """Two nodes kept to one engine each (SKULK_ENGINES=mlx, SKULK_ENGINES=torch): `engine: auto` places one
    Pipeline instance whose first rank runs mlx-lm and whose second runs torch (the torch engine's group wire
    between them), previews say so per node, and its greedy reply (40 tokens, with their logprobs) is the one a
    single torch rank gives. kill -9 of the MLX rank ends an open stream with a retryable error."""
    (mlx_node,) = cluster.start(1, extra_env={"SKULK_ENGINES": "mlx"})
    (torch_node,) = cluster.start(1, extra_env={"SKULK_ENGINES": "torch"})
    nodes = [mlx_node, torch_node]
    wait_until(lambda: formed(nodes) or None, 60, "two nodes to form one cluster")
    wait_until(lambda: {n.node_id: n for n in nodes}.keys() <= state_of(mlx_node)["nodeBackends"].keys() or None, 60,
               "both nodes' backends")
    backends = state_of(mlx_node)["nodeBackends"]
    assert set(backends[mlx_node.node_id]) == {"mlx", "mlx-cpu"} and set(backends[torch_node.node_id]) == {
        "torch", "torch-cpu"}

    alone = placed_instance(mlx_node, engine="torch")
    assert list(alone["shardAssignments"]["nodeToRunner"]) == [torch_node.node_id]
    expected = greedy_chat(mlx_node)
    assert httpx.delete(f"{mlx_node.url}/instance/{alone['instanceId']}", timeout=30).status_code == 200
    wait_until(lambda: not torch_node.runner_pids() or None, 60, "the single rank to stop")

    previews = httpx.get(f"{mlx_node.url}/instance/previews", params={"model_id": MODEL}, timeout=30).json()
    two = [p for p in previews["previews"] if p.get("engine_by_node") and len(p["engine_by_node"]) == 2]
    assert two and two[0]["engine_by_node"] == {mlx_node.node_id: "mlx", torch_node.node_id: "torch"}
    mixed = placed_instance(mlx_node, min_nodes=2)
    assert mixed["engineByNode"] == {mlx_node.node_id: "mlx", torch_node.node_id: "torch"}
    assert mixed["engine"] == "torch"
    got = greedy_chat(mlx_node)
    assert got["message"] == expected["message"]
    assert [t["token"] for t in got["logprobs"]["content"]] == [t["token"] for t in expected["logprobs"]["content"]]
    assert len(got["logprobs"]["content"]) >= 32 or got["finish_reason"] == "stop"

    victim = wait_until(lambda: next(iter(mlx_node.runner_pids()), None), 30, "the MLX rank's runner")
    probe = open_long_stream(mlx_node.url, MODEL)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    outcome = probe.wait(60)
    assert outcome.retryable_error, outcome.describe()
    heard = outcome.ended - killed if outcome.ended is not None else float("inf")
    assert heard < 15, f"heard after {heard:.1f} s"
    print(f"mixed pipeline: the client heard a retryable error {heard:.2f} s after kill -9 of the "
          f"MLX rank ({outcome.describe()})")
