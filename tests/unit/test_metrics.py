"""GET /metrics: parsed by prometheus_client's own parser, and behind the admin key on a keyed node."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from skulk.api.app import create_app
from skulk.api.chat_session import start_chat
from skulk.api.metrics import NodeCollector
from skulk.api.services import ApiServices
from skulk.api.serving_metrics import UNMATCHED, Generation, ServingMetrics
from skulk.config import Settings
from skulk.engines.torch.wire import Released, Started
from skulk.eventlog import EventLog
from skulk.runner.channel import Outbox
from skulk.runner.core import Runner
from skulk.runner.messages import FromRunner
from skulk.types.chat import ChatCompletionRequest, SamplingParams
from skulk.types.chunks import TokenChunk
from skulk.types.commands import Command, StartChatCompletion
from skulk.types.diagnostics import AttrValue, FlightRecorderEntry
from skulk.types.events import Event, InstanceCreated, RunnerStatusUpdated, TaskCreated, TaskStatusUpdated
from skulk.types.ids import CommandId, NodeId, RunnerId, TaskId
from skulk.types.links import LinkMeasurement
from skulk.types.runners import RunnerLoading, RunnerReady
from skulk.types.state import State
from skulk.types.tasks import ChatCompletionTaskParams, TaskStatus
from tests.unit.diagnostics_fakes import NOW, busy_supervisor, cluster_state
from tests.unit.factories import CARD, api_services, applied, chat_task, instance


def test_metrics_parse_and_read_state() -> None:
    client = TestClient(create_app(api_services(State(term=7), node_id="n1", master="n1")), base_url="http://127.0.0.1")
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(response.text) for s in f.samples}
    assert samples["skulk_master_term"] == 7 and samples["skulk_is_master"] == 1
    assert samples["skulk_instances"] == 0 and samples["skulk_runners"] == 0


def test_metrics_need_admin_key_on_keyed_node(tmp_path: Path) -> None:
    settings = Settings(config=tmp_path / "skulk.yaml", home=tmp_path, api_keys=["u"], admin_keys=["a"])
    client = TestClient(create_app(api_services(settings=settings, home=tmp_path)), base_url="http://127.0.0.1")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer u"}).status_code == 403
    assert client.get("/metrics", headers={"Authorization": "Bearer a"}).status_code == 200


def samples_of(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_requests_count_by_route_template_and_status() -> None:
    client = TestClient(create_app(api_services()), base_url="http://127.0.0.1")
    for path in ("/v1/models", "/v1/models", "/no/such/path", "/another/missing"):
        client.get(path)
    samples = samples_of(client.get("/metrics").text)
    key = "skulk_http_requests_total"
    assert samples[(key, frozenset({("route", "/v1/models"), ("method", "GET"), ("status", "200")}))] == 2
    assert samples[(key, frozenset({("route", UNMATCHED), ("method", "GET"), ("status", "404")}))] == 2


def value(metrics: ServingMetrics, name: str, **labels: str) -> float:
    registry = CollectorRegistry(auto_describe=False)
    for collector in metrics.collectors():
        registry.register(collector)
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_a_generation_is_observed_once_when_it_ends() -> None:
    metrics = ServingMetrics()
    done = Generation(metrics, "m")
    assert value(metrics, "skulk_active_streams", model="m") == 1
    done.first("i1")
    done.tokens += 4
    done.end("stop", prompt_tokens=7, completion_tokens=5)
    done.end("cancelled")  # the stream's close after its last chunk: counted already
    ids = {"model": "m", "instance_id": "i1"}
    assert value(metrics, "skulk_generations_total", **ids, outcome="stop") == 1
    assert value(metrics, "skulk_generations_total", **ids, outcome="cancelled") == 0
    assert value(metrics, "skulk_prompt_tokens_total", **ids) == 7
    assert value(metrics, "skulk_generated_tokens_total", **ids) == 5
    assert value(metrics, "skulk_time_to_first_token_seconds_count", **ids) == 1
    assert value(metrics, "skulk_inter_token_latency_seconds_count", **ids) == 1
    left = Generation(metrics, "m")  # the client left before the first token: no latency to observe
    left.end("cancelled")
    gone = {"model": "m", "instance_id": ""}
    assert value(metrics, "skulk_generations_total", **gone, outcome="cancelled") == 1
    assert value(metrics, "skulk_time_to_first_token_seconds_count", **gone) == 0
    assert value(metrics, "skulk_active_streams", model="m") == 0


def test_node_series_read_memory_links_and_runners_at_scrape_time() -> None:
    """Memory and link RTT from this node's applied node info; state, pending tasks, KV blocks and speculative
    totals per runner from its supervisor (the newest kv_usage record of its flight recorder)."""
    state = cluster_state()
    link = LinkMeasurement(rtt_ms=0.5, probe_rtt_ms=1.5, measured_at_s=NOW.timestamp())
    state = state.model_copy(update={"node_links": {NodeId("n1"): {NodeId("n2"): link}}})
    inst = state.instances[next(iter(state.instances))]
    sup = busy_supervisor(inst, "n1", "decode_stream", 1.0)
    sup.view.status = RunnerReady()
    task = chat_task("t2", inst.instance_id)
    sup.view.pending[task.task_id] = task
    ctx = sup.spec.context(None)
    for held in (3, 5):  # the newest record wins
        usage: dict[str, AttrValue] = {"kv_blocks": 64, "kv_blocks_held": held, "kv_blocks_cached": 2,
                                       "kv_block_size": 16, "queued": 1, "running": 2,
                                       "spec_drafted": 10 * held, "spec_accepted": held}
        sup.view.flight_recorder.append(FlightRecorderEntry(at=NOW.isoformat(), phase="kv_cache_lookup",
                                                            event="prefix_hit", attrs=usage, context=ctx))
    client = TestClient(create_app(api_services(state, runners={RunnerId(ctx.runner_id): sup})), base_url="http://127.0.0.1")
    samples = samples_of(client.get("/metrics").text)
    assert samples[("skulk_memory_limit_bytes", frozenset())] == 16 * 1024**3
    assert samples[("skulk_memory_free_bytes", frozenset())] == 8 * 1024**3
    assert ("skulk_memory_used_bytes", frozenset()) not in samples  # not reported: no series, not a zero
    assert samples[("skulk_link_rtt_seconds", frozenset({("peer", "n2")}))] == 0.0005
    assert samples[("skulk_link_probe_rtt_seconds", frozenset({("peer", "n2")}))] == 0.0015
    ids = {("model", ctx.model_id), ("instance_id", ctx.instance_id), ("runner_id", ctx.runner_id)}
    assert samples[("skulk_runner_state", frozenset({*ids, ("state", "Ready")}))] == 1
    assert samples[("skulk_runner_pending_tasks", frozenset(ids))] == 1
    assert samples[("skulk_kv_blocks", frozenset(ids))] == 64
    assert samples[("skulk_kv_blocks_used", frozenset(ids))] == 5
    assert samples[("skulk_kv_blocks_free", frozenset(ids))] == 59
    assert samples[("skulk_engine_queued_requests", frozenset(ids))] == 1
    assert samples[("skulk_speculative_drafted_tokens_total", frozenset(ids))] == 50
    assert samples[("skulk_speculative_accepted_tokens_total", frozenset(ids))] == 5


def test_a_runner_without_kv_records_has_no_kv_series() -> None:
    state = cluster_state()
    sup = busy_supervisor(state.instances[next(iter(state.instances))], "n1", "decode_stream", 1.0)
    ctx = sup.spec.context(None)
    text = TestClient(create_app(api_services(state, runners={RunnerId(ctx.runner_id): sup})),
                      base_url="http://127.0.0.1").get("/metrics").text
    names = {name for name, _ in samples_of(text)}
    assert "skulk_runner_state" in names and "skulk_kv_blocks_free" not in names
    assert "skulk_kv_blocks_free" in {f.name for f in text_string_to_metric_families(text)}  # listed, empty


MODEL = str(CARD.model_id)
HELD_ON = ("unassigned", "loading", "queue")


def _placed(*, ready: bool) -> State:
    """One instance of CARD's model on n1, its runner ready or still loading."""
    return applied(InstanceCreated(instance=instance()), RunnerStatusUpdated(
        runner_id=RunnerId("r-n1"), runner_status=RunnerReady() if ready else RunnerLoading()))


def _step(services: ApiServices, event: Event) -> None:
    services.store.replace(applied(event, state=services.state))


def _held(text: str) -> dict[str, float]:
    samples = samples_of(text)
    return {on: samples[("skulk_api_held_requests", frozenset({("model", MODEL), ("waiting_on", on)}))]
            for on in HELD_ON}


def _scrape(services: ApiServices) -> str:
    """The node collector's series as the route renders them, without an app (for a test on its own loop)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(services))
    return generate_latest(registry).decode()


def test_a_held_request_is_counted_by_what_it_waits_for_until_a_runner_accepts_it() -> None:
    """No task yet, then a task on a loading instance, then its turn on a serving one; a runner's acceptance (or
    a first chunk that beats it to this node) ends the hold. A placed model's series are there at 0 before."""
    services = api_services(_placed(ready=False))
    client = TestClient(create_app(services), base_url="http://127.0.0.1")

    def scrape() -> dict[str, float]:
        return _held(client.get("/metrics").text)

    assert scrape() == {"unassigned": 0, "loading": 0, "queue": 0}
    params = ChatCompletionTaskParams(model=CARD.model_id, messages=[], sampling=SamplingParams())
    stream = services.requests.open(CommandId("c1"), params)
    services.requests.open(CommandId("placing"))  # a placement's stream: no model, no request held
    assert scrape() == {"unassigned": 1, "loading": 0, "queue": 0}
    _step(services, TaskCreated(task=chat_task("t1", command_id="c1")))
    assert scrape() == {"unassigned": 0, "loading": 1, "queue": 0}
    _step(services, RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=RunnerReady()))
    assert scrape() == {"unassigned": 0, "loading": 0, "queue": 1}
    _step(services, TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Running))
    assert scrape() == {"unassigned": 0, "loading": 0, "queue": 0}
    services.requests.close(stream)
    services.requests.open(CommandId("c2"), params)
    _step(services, TaskCreated(task=chat_task("t2", command_id="c2")))
    assert scrape()["queue"] == 1
    services.requests.deliver(TokenChunk(command_id=CommandId("c2"), token_id=1, text="x"))  # before Running
    assert scrape() == {"unassigned": 0, "loading": 0, "queue": 0}


@pytest.mark.timeout(20)
async def test_a_chat_waiting_for_its_instance_is_held_then_let_go_when_it_leaves() -> None:
    """Through start_chat: the request the API holds while its instance loads counts 1, and 0 once the client
    leaves (no master here: the test hands it its task)."""
    sent: list[Command] = []
    started = asyncio.Event()

    def send(command: Command) -> None:
        sent.append(command)
        started.set()

    services = api_services(_placed(ready=False), commands=send)
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    chat = asyncio.create_task(start_chat(services, request))
    await asyncio.wait_for(started.wait(), 10)
    assert _held(_scrape(services)) == {"unassigned": 1, "loading": 0, "queue": 0}
    command = sent[0]
    assert isinstance(command, StartChatCompletion)
    _step(services, TaskCreated(task=chat_task("t1", command_id=command.command_id)))
    assert _held(_scrape(services)) == {"unassigned": 0, "loading": 1, "queue": 0}
    chat.cancel()
    with pytest.raises(asyncio.CancelledError):
        await chat
    assert _held(_scrape(services)) == {"unassigned": 0, "loading": 0, "queue": 0}


class _GoneSource:
    """The runner's inbox source, already closed: its pump thread ends at once."""

    def get(self) -> Any:
        raise EOFError


class _Sent:
    def __init__(self) -> None:
        self.messages: list[FromRunner] = []

    def put(self, message: FromRunner) -> None:
        self.messages.append(message)


def test_a_step_that_releases_requests_records_the_pool_so_kv_used_falls_back() -> None:
    """The prefill's start records the pool at its busiest; the step whose header released the requests records
    it again (once for the step, in the phase the rank is in), so the scraped used blocks fall back after
    traffic instead of keeping their last value."""
    state = cluster_state()
    sup = busy_supervisor(state.instances[next(iter(state.instances))], "n1", "decode_stream", 1.0)
    runner = Runner(sup.spec, cast(Any, _GoneSource()), cast(Outbox, _Sent()))
    pool: dict[str, int] = {"kv_blocks": 64, "kv_blocks_held": 9, "kv_blocks_cached": 0, "kv_block_size": 16,
                            "queued": 0, "running": 2}
    runner.engine = cast(Any, SimpleNamespace(kv_usage=lambda: dict(pool)))
    runner._follow_requests([Started("t1", "c1", 0), Started("t2", "c2", 0)])
    phase = runner.recorder.phase
    pool.update(kv_blocks_held=0, kv_blocks_cached=4, running=0)
    runner._follow_requests([Released("t1", "c1", False), Released("t2", "c2", True)])
    assert runner.recorder.phase == phase
    entries = runner.recorder.drain()
    assert [e.event for e in entries].count("kv_released") == 1
    sup.view.flight_recorder.extend(entries)
    ctx = sup.spec.context(None)
    client = TestClient(create_app(api_services(state, runners={RunnerId(ctx.runner_id): sup})),
                        base_url="http://127.0.0.1")
    samples = samples_of(client.get("/metrics").text)
    ids = frozenset({("model", ctx.model_id), ("instance_id", ctx.instance_id), ("runner_id", ctx.runner_id)})
    assert samples[("skulk_kv_blocks_used", ids)] == 0 and samples[("skulk_kv_blocks_free", ids)] == 64
    assert samples[("skulk_engine_running_requests", ids)] == 0


DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json"
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def test_every_dashboard_expression_names_a_metric_the_app_serves(tmp_path: Path) -> None:
    """A renamed metric would leave a panel silently empty: every skulk_* name in the dashboard must be a family
    (or a family's sample) of a scrape. Families with labels are listed even before their first sample."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    services = replace(api_services(home=tmp_path), event_log=EventLog(tmp_path / "eventlog"))  # its series too
    text = TestClient(create_app(services), base_url="http://127.0.0.1").get("/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    used = {m for e in exprs for m in re.findall(r"\bskulk_[a-z_]+", e)}
    assert len(used) >= 10, used
    missing = sorted(m for m in used if m not in families and not any(
        m.endswith(s) and m.removesuffix(s) in families for s in SUFFIXES))
    assert missing == [], missing
