"""One real node process on loopback: place the demo model and use it through the OpenAI API."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import zenoh
from prometheus_client.parser import text_string_to_metric_families

from skulk.testing.chaos import frozen
from skulk.testing.convergence import view_of
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import StreamProbe
from skulk.testing.streams import chat_body as long_chat

from .harness import Cluster, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    cluster = Cluster(tmp_path_factory.mktemp("single"))
    (started,) = cluster.start(1)
    place_and_wait(started)
    yield started
    assert cluster.stop_all() == [], "runner processes outlived their node"


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 8, **extra}


def test_openai_sdk_streams_a_completion(node: LocalNode) -> None:
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    usage = chunks[-1].usage
    assert usage is not None and 1 <= usage.completion_tokens <= 12 and usage.prompt_tokens > 0


def test_openai_sdk_non_streaming(node: LocalNode) -> None:
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and reply.usage.completion_tokens <= 4
    assert [m.id for m in client.models.list().data].count(MODEL) == 1


# Greedy, the demo model writes all 2000 tokens of these streams; sampled with seeds 1 and 2 it ended after 41 and
# 149 tokens, which on the f32 kernel under a loaded run could be before the disconnect or the cancel landed.
LONG_STREAM = {"max_tokens": 2000, "stream": True, "temperature": 0.0}


async def _stream_one(client: httpx.AsyncClient, n: int) -> tuple[int, str | None, int]:
    """(content chunks, finish reason, requests the runner was already serving when it admitted this one)."""
    tokens, finish, in_flight = 0, None, -1
    body = chat_body(max_tokens=24, temperature=0.8, seed=n, stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith(": serving_stats "):
                in_flight = json.loads(line.removeprefix(": serving_stats "))["in_flight_at_admission"]
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += 1 if choice["delta"].get("content") is not None else 0
            finish = choice["finish_reason"] or finish
    return tokens, finish, in_flight


def scrape(node: LocalNode) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GET /metrics parsed by prometheus_client's own parser: (sample name, labels) -> value."""
    reply = httpx.get(node.url + "/metrics", timeout=10, trust_env=False)
    assert reply.status_code == 200, reply.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def moved(before: dict[tuple[str, frozenset[tuple[str, str]]], float],
          after: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """How far the samples called `name` whose labels include `labels` moved between two scrapes."""
    def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)
    return total(after) - total(before)


def test_metrics_move_when_a_chat_streams(node: LocalNode) -> None:
    before = scrape(node)
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 2
    after = scrape(node)
    assert moved(before, after, "skulk_http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert moved(before, after, "skulk_generated_tokens_total", model=MODEL) == usage.completion_tokens
    assert moved(before, after, "skulk_prompt_tokens_total", model=MODEL) == usage.prompt_tokens
    assert moved(before, after, "skulk_generations_total", model=MODEL) == 1
    assert moved(before, after, "skulk_time_to_first_token_seconds_count", model=MODEL) == 1
    assert moved(before, after, "skulk_inter_token_latency_seconds_count", model=MODEL) == 1
    assert moved(before, after, "skulk_time_to_first_token_seconds_sum", model=MODEL) > 0
    assert after[("skulk_active_streams", frozenset({("model", MODEL)}))] == 0
    instances = {dict(ls).get("instance_id") for (n, ls) in after if n == "skulk_generated_tokens_total"}
    assert instances and "" not in instances, instances  # the serving instance is named
    assert moved(before, after, "skulk_http_requests_total", route="/metrics", status="200") == 1
    assert after[("skulk_memory_limit_bytes", frozenset())] > 0  # this node's budget, from its node info
    assert after[("skulk_memory_free_bytes", frozenset())] >= 0
    kv_free = {ls: v for (n, ls), v in after.items() if n == "skulk_kv_blocks_free"}
    assert kv_free and all(v > 0 for v in kv_free.values()), kv_free  # as of the chat's admission
    assert all(dict(ls)["model"] == MODEL and dict(ls)["instance_id"] for ls in kv_free)
    drafted = [v for (n, ls), v in after.items() if n == "skulk_speculative_drafted_tokens_total"]
    assert drafted and all(v >= 0 for v in drafted), drafted  # the engine's totals reach the node
    held = {dict(ls)["waiting_on"]: v for (n, ls), v in after.items()
            if n == "skulk_api_held_requests" and ("model", MODEL) in ls}
    assert held == {"unassigned": 0, "loading": 0, "queue": 0}, held  # the placed model's series, none held now

    def pool_released() -> bool:
        used = [v for (n, ls), v in scrape(node).items() if n == "skulk_kv_blocks_used" and ("model", MODEL) in ls]
        return bool(used) and all(v == 0 for v in used)
    # the step that released the chat's blocks records the pool again: the used blocks fall back after traffic
    wait_until(pool_released, 30, "the KV used blocks to fall back to 0 after the chat")
    # the runner goes back to Ready once the chat ended (its state series says so, labelled by its model)
    wait_until(lambda: any(n == "skulk_runner_state" and ("state", "Ready") in ls and ("model", MODEL) in ls
                           for (n, ls) in scrape(node)), 30, "the runner's state series to say Ready")


def test_eight_concurrent_streams_all_complete(node: LocalNode) -> None:
    """Eight streams at once all finish, and the runner served them together: they are sent while a long greedy
    stream is running (its first token seen), so each is admitted beside it at least (one at a time, every
    in_flight_at_admission would be 0). Without the holder, a loaded machine could admit the eight short streams
    one after another and the test would say nothing about batching."""
    async def hold(client: httpx.AsyncClient, running: asyncio.Event) -> None:
        """The long stream, read as it comes (a reader that stops would be a slow consumer, not a running
        request); `running` is set at its first content, which the runner writes once it has admitted it."""
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(**LONG_STREAM)) as holder:
            assert holder.status_code == 200
            async for line in holder.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    running.set()

    async def run() -> list[tuple[int, str | None, int]]:
        async with httpx.AsyncClient(base_url=node.url, timeout=120) as client:
            running = asyncio.Event()
            holder = asyncio.create_task(hold(client, running))
            await running.wait()
            try:
                return await asyncio.gather(*(_stream_one(client, n) for n in range(8)))
            finally:
                holder.cancel()
                await asyncio.gather(holder, return_exceptions=True)

    results = asyncio.run(run())
    assert len(results) == 8
    assert all(finish in ("length", "stop") and tokens >= 1 for tokens, finish, _ in results), results
    assert all(in_flight >= 0 for _, _, in_flight in results), "every stream ends with its serving_stats"
    assert min(in_flight for _, _, in_flight in results) >= 1, results


def _task_statuses(node: LocalNode) -> dict[str, str]:
    tasks = httpx.get(f"{node.url}/state", timeout=10).json()["tasks"]
    return {t["ChatCompletion"]["commandId"]: t["ChatCompletion"]["taskStatus"] for t in tasks.values()}


def test_disconnect_cancels_the_task(node: LocalNode) -> None:
    body = chat_body(**LONG_STREAM)
    with (
        httpx.Client(base_url=node.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        command_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
    status = wait_until(
        lambda: (
            _task_statuses(node).get(command_id) not in (None, "Pending", "Running")
            and _task_statuses(node)[command_id]
        ),
        30,
        "the abandoned task to end",
    )
    assert status == "Cancelled"
    supervisors = httpx.get(f"{node.url}/v1/diagnostics/node", timeout=10).json()["supervisorRunners"]
    assert all(s["inProgressTasks"] == [] for s in supervisors)
    events = [
        e["event"] for s in supervisors for e in s["flightRecorder"] if e.get("commandId") == command_id
    ]
    assert "cancelled" in events and "task_complete" not in events


def test_cancel_endpoint(node: LocalNode) -> None:
    body = chat_body(**LONG_STREAM)
    with httpx.Client(base_url=node.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            command_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
            assert client.post(f"/v1/cancel/{command_id}").status_code == 200
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert any('"error"' in line for line in rest)
        assert client.post("/v1/cancel/not-a-command").status_code == 404


MALFORMED: list[tuple[str, object, int, str]] = [
    ("empty messages", chat_body(messages=[]), 422, "messages"),
    ("negative max_tokens", chat_body(max_tokens=-5), 422, "max_tokens"),
    ("messages of wrong type", chat_body(messages="hello"), 422, "messages"),
    ("unknown role", chat_body(messages=[{"role": "robot", "content": "x"}]), 422, "role"),
    ("temperature out of range", chat_body(temperature=7), 422, "temperature"),
    ("max_tokens as text", chat_body(max_tokens="many"), 422, "max_tokens"),
    ("missing model", {"messages": [{"role": "user", "content": "x"}]}, 422, "model"),
    ("only empty contents", chat_body(messages=[{"role": "user", "content": ""}]), 422, "content"),
    ("unknown model", chat_body(model="nobody/nothing"), 404, "model nobody/nothing is not known"),
    ("prompt beyond context", chat_body(messages=[{"role": "user", "content": "x" * 5000}]), 400, "context"),
]


@pytest.mark.parametrize(("what", "body", "status", "mentions"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_chat_requests_get_typed_errors(
    node: LocalNode, what: str, body: object, status: int, mentions: str
) -> None:
    with node.client() as client:
        for stream in (False, True):
            payload = {**body, "stream": stream} if isinstance(body, dict) else body
            reply = client.post("/v1/chat/completions", json=payload)
            assert reply.status_code == status, (what, reply.text)
            error = reply.json()["error"]
            assert mentions in error["message"] or mentions == error.get("code"), error
        if what == "prompt beyond context":
            assert "context_length_exceeded" in reply.text
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_invalid_json_body(node: LocalNode) -> None:
    with node.client() as client:
        reply = client.post(
            "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert reply.status_code == 422 and "error" in reply.json()


PLACEMENT_ERRORS: list[tuple[dict[str, object], int, str]] = [
    ({"model_id": "nobody/nothing"}, 404, "nobody/nothing"),
    ({"model_id": MODEL, "instance_meta": "MlxJaccl"}, 400, "MlxRing"),
    ({"model_id": MODEL, "sharding": "Diagonal"}, 422, "sharding"),
    ({"model_id": MODEL, "min_nodes": 0}, 422, "min_nodes"),
    ({"model_id": "meta-llama/Llama-3.3-70B-Instruct"}, 400, "GB"),
    ({"model_id": MODEL, "min_nodes": 2}, 400, "2"),
]


@pytest.mark.parametrize(("body", "status", "mentions"), PLACEMENT_ERRORS)
def test_placement_errors_are_typed(
    node: LocalNode, body: dict[str, object], status: int, mentions: str
) -> None:
    with node.client() as client:
        reply = client.post("/place_instance", json=body)
        assert reply.status_code == status, reply.text
        assert mentions in reply.json()["error"]["message"]


def test_does_not_fit_names_the_node_and_the_arithmetic(node: LocalNode) -> None:
    with node.client() as client:
        message = client.post(
            "/place_instance", json={"model_id": "meta-llama/Llama-3.3-70B-Instruct"}
        ).json()
    text = message["error"]["message"]
    # the big card's per-layer bytes are exact: weights count as they are (no x 1.05), beside the node's runtime
    assert node.node_id in text and " GB weights + " in text and " GB runtime" in text and "free" in text


def test_read_endpoints(node: LocalNode) -> None:
    with node.client() as client:
        assert client.get("/node_id").json() == node.node_id
        state = client.get("/state").json()
        for key in ("instances", "runners", "tasks", "lastSeen", "nodeIdentities", "nodeMemory", "topology"):
            assert key in state
        assert state["nodeMemory"][node.node_id]["ramTotal"]["inBytes"] > 0
        assert state["nodeIdentities"][node.node_id]["skulkVersion"]
        (instance_id,) = state["instances"]
        assert "MlxRingInstance" in client.get(f"/instance/{instance_id}").json()
        assert client.get("/instance/nope").status_code == 404
        assert client.delete("/instance/nope").status_code == 404
        assert any(c["id"] == MODEL for c in client.get("/models").json()["data"])
        previews = client.get("/instance/previews", params={"model_id": MODEL}).json()["previews"]
        assert any(p["error"] is None for p in previews)
        assert client.get("/instance/previews", params={"model_id": "nobody/x"}).status_code == 404


def test_delete_then_place_again(tmp_path: Path, cluster: Cluster) -> None:
    (fresh,) = cluster.start(1)
    instance_id = place_and_wait(fresh)
    with fresh.client() as client:
        assert client.delete(f"/instance/{instance_id}").status_code == 200
        assert instance_id not in client.get("/state").json()["instances"]
        reply = client.post("/v1/chat/completions", json=chat_body())
        assert reply.status_code == 404
    pids = fresh.runner_pids()
    wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 20, "the runner to exit")

    # placed again, quantized while loading: the runner runs int4 weights and chats
    instance_id = place_and_wait(fresh, quantization="int4")
    with fresh.client() as client:
        instance = next(iter(client.get(f"/instance/{instance_id}").json().values()))
        shard = next(iter(next(iter(instance["shardAssignments"]["runnerToShard"].values())).values()))
        assert shard["modelCard"]["quantizeAtLoad"] == "int4"
        reply = client.post("/v1/chat/completions", json=chat_body(temperature=0))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0, reply.text
        refused = client.post("/place_instance", json={"model_id": MODEL, "quantization": "int3"})
        assert refused.status_code == 422 and "quantization" in refused.text


def test_stopping_the_node_leaves_no_runner(cluster: Cluster) -> None:
    (fresh,) = cluster.start(1)
    place_and_wait(fresh)
    assert fresh.runner_pids(), "expected a runner process"
    fresh.stop()
    assert fresh.process is not None and fresh.process.returncode == 0, fresh.log_tail()
    assert fresh.reap_leftovers() == []


def test_kill_9_of_the_node_leaves_no_runner(cluster: Cluster) -> None:
    (fresh,) = cluster.start(1)
    place_and_wait(fresh)
    runners = fresh.runner_pids()
    assert runners
    fresh.kill()
    assert fresh.reap_leftovers(timeout=10) == [], "runners survived a kill -9 of their node"


def test_a_single_nodes_tokens_do_not_go_through_zenoh(node: LocalNode) -> None:
    """The runner's chunks reach this node's own stream directly (Node._publish_chunk): a zenoh peer that hears the
    node's other traffic hears nothing on the completion's data key while it streams (through zenoh, the node put
    one chunk per token there)."""
    heard: list[str] = []
    conf = zenoh.Config()
    conf.insert_json5("mode", json.dumps("peer"))
    conf.insert_json5("connect/endpoints", json.dumps([node.endpoint]))
    conf.insert_json5("scouting/multicast/enabled", "false")
    session = zenoh.open(conf)
    try:
        session.declare_subscriber(f"skulk/{node.cluster}/**", lambda sample: heard.append(str(sample.key_expr)))
        wait_until(lambda: heard, 15, "the node to route its traffic to this peer")  # its heartbeats
        reply = httpx.post(node.url + "/v1/chat/completions", timeout=60, json=chat_body(
            max_tokens=32, temperature=0.0, stream=True, stream_options={"include_usage": True}))
        assert reply.status_code == 200 and '"completion_tokens":32' in reply.text, reply.text
    finally:
        session.close()
    first = json.loads(reply.text.split("data: ", 2)[1])
    command_id = first["id"].removeprefix("chatcmpl-")  # only ours: an earlier test's closed stream may still talk
    assert not [key for key in heard if "/data/" in key and key.endswith(f"/{command_id}")]


PAUSE_S = 4.0
"""Longer than FROZEN_GAP_S (2.5 s): the node comes back believing it was frozen, as a starved loop does too."""


def test_a_lone_node_paused_mid_stream_stays_master_and_finishes_the_stream(node: LocalNode) -> None:
    """A one-node cluster frozen for a few seconds (SIGSTOP of node and runner; a loop starved under load looks
    the same) keeps its master and term: there is no peer that could have replaced it, and a new term would end
    every open request with 503 session_changed (it did: test_advertised_context failed so in two full runs)."""
    before = view_of(node)
    assert before is not None and before.master == node.node_id
    probe = StreamProbe(node.url, long_chat(MODEL, 600, temperature=0.0), read_timeout=60)
    probe.wait_tokens(5, 60)
    with frozen(node):
        time.sleep(PAUSE_S)
    outcome = probe.wait(120)
    assert outcome.kind == "completed", outcome.describe()
    after = view_of(node)
    assert after is not None and (after.master, after.term) == (before.master, before.term), (before, after)
