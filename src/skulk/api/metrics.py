"""GET /metrics: this node's view of the cluster in the Prometheus text format, read at scrape time.

A registry per app (tests build several apps in one process) holding a collector that reads the node's state only
when scraped, and the metrics counted as things happen (api/serving_metrics.py: requests, tokens, latencies, store
bytes, masters followed), which cost serving one int add per token. The route needs an admin key on a keyed node
(security.py: every route not listed for inference keys needs admin); a keyless node serves it like its other
routes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from skulk.api.patience import held_on
from skulk.api.runner_metrics import runner_families
from skulk.api.services import ApiServices
from skulk.types.ids import CommandId, NodeId
from skulk.types.links import LinkMeasurement
from skulk.types.node_info import MemoryUsage
from skulk.types.state import State
from skulk.types.waiting import WaitingOn


class NodeCollector(Collector):
    """Reads the node's applied state, its supervisors and its API's open requests at each scrape."""

    def __init__(self, services: ApiServices) -> None:
        self._services = services

    def collect(self) -> Iterator[Metric]:
        services = self._services
        state = services.state
        term = GaugeMetricFamily("skulk_master_term", "The cluster's master term as this node has applied it.")
        term.add_metric([], state.term)
        yield term
        is_master = GaugeMetricFamily("skulk_is_master", "1 when this node is the cluster's master.")
        is_master.add_metric([], 1.0 if services.master_id == services.node_id else 0.0)
        yield is_master
        instances = GaugeMetricFamily("skulk_instances", "Instances placed in the cluster.")
        instances.add_metric([], len(state.instances))
        yield instances
        supervisors = services.runners()
        runners = GaugeMetricFamily("skulk_runners", "Runner supervisors on this node.")
        runners.add_metric([], len(supervisors))
        yield runners
        yield from runner_families(supervisors)
        yield held_family(state, services.requests.unheard())
        yield from memory_families(state.node_memory.get(services.node_id))
        yield from link_families(state.node_links.get(services.node_id, {}))
        log = services.event_log
        if log is not None:  # off (event_log.enabled false): no series rather than a misleading zero
            events = GaugeMetricFamily("skulk_event_log_last_seq", "Events this node's event log has numbered.")
            events.add_metric([], log.seq)
            yield events
            size = GaugeMetricFamily("skulk_event_log_bytes", "The event log's bytes on disk, archive included.")
            size.add_metric([], log.bytes_on_disk)
            yield size


HELD_ON = (WaitingOn.unassigned, WaitingOn.loading, WaitingOn.queue)
"""What a held request can wait for (api/patience.py `held_on`): each placed model has a series of each, zeros
included, so a gauge falls back to 0 rather than vanishing when the last held request goes."""


def held_family(state: State, unheard: Sequence[tuple[CommandId, str]]) -> Metric:
    """The requests this node's API holds that no runner has accepted yet, by model and what they wait for: one
    pass over the state's tasks when any request is unheard (none on an idle node), nothing per token."""
    family = GaugeMetricFamily("skulk_api_held_requests", "Requests this node's API holds that no runner has "
                               "accepted yet, by what they wait for: unassigned (no instance took the request "
                               "yet), loading (its instance's runners are not all ready), queue (its instance "
                               "serves; a runner has not accepted it yet).", labels=["model", "waiting_on"])
    counts: Counter[tuple[str, WaitingOn]] = Counter()
    if unheard:
        tasks = {t.command_id: t for t in state.tasks.values()}
        for command_id, model in unheard:
            on = held_on(state, tasks.get(command_id))
            if on is not None:
                counts[model, on] += 1
    models = {str(i.model_id) for i in state.instances.values()} | {m for m, _ in counts}
    for model in sorted(models):
        for on in HELD_ON:
            family.add_metric([model, on.value], counts[model, on])
    return family


MEMORY_SERIES = (
    ("limit", "The node's memory limit: the smallest of its RAM, cgroup limit, GPU working set and "
     "--memory-limit (memory_limit.py)."),
    ("used", "Memory counted as used against the limit."),
    ("reserved", "Memory kept back from placement (--memory-reserve)."),
    ("free", "Free memory under the limit, less the reserve: what placement plans shards and KV pools into."),
)


def memory_families(memory: MemoryUsage | None) -> Iterator[Metric]:
    """The node's memory budget as its last node info reported it (a second or so old; none before the first)."""
    families = {key: GaugeMetricFamily(f"skulk_memory_{key}_bytes", text) for key, text in MEMORY_SERIES}
    if memory is not None:
        values = {"limit": memory.ram_total, "used": memory.ram_used, "reserved": memory.ram_reserved,
                  "free": memory.ram_available}
        for key, family in families.items():
            found = values[key]
            if found is not None:
                family.add_metric([], found.in_bytes)
    yield from families.values()


def link_families(links: dict[NodeId, LinkMeasurement]) -> Iterator[Metric]:
    """Round trip to each peer as this node measured it (worker/links.py), labelled by the peer's node id."""
    rtt = GaugeMetricFamily("skulk_link_rtt_seconds", "The network round trip to a peer: the median of the "
                            "topology probes less the HTTP stacks' own cost.", labels=["peer"])
    probe = GaugeMetricFamily("skulk_link_probe_rtt_seconds", "The topology probes' median round trip to a peer, "
                              "HTTP stacks included.", labels=["peer"])
    for peer, link in sorted(links.items()):
        rtt.add_metric([str(peer)], link.rtt_ms / 1000)
        probe.add_metric([str(peer)], link.probe_rtt_ms / 1000)
    yield from (rtt, probe)


def metrics_router(services: ApiServices) -> APIRouter:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(services))
    for collector in services.serving.collectors():  # built unregistered: each app's registry holds its own
        registry.register(collector)
    router = APIRouter(tags=["diagnostics"])

    @router.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:  # pyright: ignore[reportUnusedFunction]
        # on the event loop, not a worker thread: the supervisors' deques and dicts are mutated there
        # (diagnostics/supervisor_view.py); a render of three models' series took about 1 ms here
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
