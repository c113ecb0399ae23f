"""Read-only views of the cluster: /state, /node_id (the catalog, /models, is api/models.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Query, Response

from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.diagnostics.health import cluster_health, event_log_reason
from skulk.types.answers import StateView
from skulk.types.links import LINK_PROBE_MAX_BYTES
from skulk.types.state import State

DATA_TRANSPORT = "zenoh"
"""How tokens travel from the sampling rank to the API node (the data plane)."""


def node_system_and_resources(state: State) -> dict[str, dict[str, Any]]:
    """Skulk's per-node views: `nodeSystem[node]` (performance readings with the accelerator inside, as Skulk
    nests it) and `nodeResources[node]` (what the node can run and how its tokens travel)."""
    nodes = set(state.node_system) | set(state.node_accelerator)
    system: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    for node_id in sorted(nodes):
        perf = state.node_system.get(node_id)
        accel = state.node_accelerator.get(node_id)
        system[node_id] = {
            **(perf.model_dump(mode="json") if perf is not None else {}),
            "accelerator": accel.model_dump(mode="json") if accel is not None else None,
        }
        backends = ["torch"] + (["cuda"] if accel is not None and accel.vendor == "nvidia" else [])
        resources[node_id] = {"backends": backends, "participation": "full", "dataTransport": DATA_TRANSPORT}
    return {"nodeSystem": system, "nodeResources": resources}


def state_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["state"])

    @router.get("/state", response_model=None, responses=documented(StateView))
    async def get_state() -> dict[str, Any]:
        body = node.state.model_dump(mode="json")
        event_log = node.event_log  # counting-only is this node's own fact, not state's
        mine = [event_log_reason(event_log.counting_reason or "")] if event_log and event_log.counting_only else []
        health = cluster_health(node.state, datetime.now(UTC), {node.node_id: mine})
        body["nodeHealth"] = {n: h.model_dump(mode="json") for n, h in health.items()}
        body.update(node_system_and_resources(node.state))
        return body

    @router.get("/node_id", response_model=None, responses=documented(str))
    async def get_node_id() -> str:
        return node.node_id

    @router.get("/node/probe", response_model=None, include_in_schema=False)  # node to node, signed
    async def probe_node_id() -> str:
        """The topology probe: this node's id, answered with the proof of the caller's nonce (internal_gate)."""
        return node.node_id

    @router.get("/node/link_probe", response_model=None, include_in_schema=False)  # node to node, not a client's
    async def link_probe(size: int = Query(alias="bytes", ge=1, le=LINK_PROBE_MAX_BYTES)) -> Response:
        """`bytes` zero bytes: what a peer reads to measure its bandwidth to this node (worker/links.py)."""
        return Response(content=bytes(size), media_type="application/octet-stream")

    return router
