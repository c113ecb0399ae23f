"""GET /metrics: this node's view of the cluster in the Prometheus text format, read at scrape time.

A registry per app (tests build several apps in one process) and a collector that reads the node's state only
when scraped, so serving tokens costs nothing. The route needs an admin key on a keyed node (security.py: every
route not listed for inference keys needs admin); a keyless node serves it like its other routes.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from skulk.api.services import ApiServices


class NodeCollector(Collector):
    """Reads the node's applied state and its supervisors at each scrape."""

    def __init__(self, services: ApiServices) -> None:
        self._services = services

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
        runners = GaugeMetricFamily("skulk_runners", "Runner supervisors on this node.")
        runners.add_metric([], len(services.runners()))
        yield runners
        log = services.event_log
        if log is not None:  # off (event_log.enabled false): no series rather than a misleading zero
            events = GaugeMetricFamily("skulk_event_log_last_seq", "Events this node's event log has numbered.")
            events.add_metric([], log.seq)
            yield events
            size = GaugeMetricFamily("skulk_event_log_bytes", "The event log's bytes on disk, archive included.")
            size.add_metric([], log.bytes_on_disk)
            yield size


def metrics_router(services: ApiServices) -> APIRouter:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(services))
    router = APIRouter(tags=["diagnostics"])

    @router.get("/metrics", include_in_schema=False)
    def metrics() -> Response:  # pyright: ignore[reportUnusedFunction]
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
