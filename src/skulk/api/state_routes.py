"""Read-only views of the cluster: /state, /node_id (the catalog, /models, is api/models.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter

from skulk.api.handle import NodeHandle
from skulk.diagnostics.health import cluster_health, event_log_reason


def state_router(node: NodeHandle) -> APIRouter:
    router = APIRouter(tags=["state"])

    @router.get("/state")
    async def get_state() -> dict[str, Any]:
        body = node.state.model_dump(mode="json")
        event_log = getattr(node, "event_log", None)  # counting-only is this node's own fact, not state's
        mine = [event_log_reason(event_log.counting_reason or "")] if event_log and event_log.counting_only else []
        health = cluster_health(node.state, datetime.now(UTC), {node.node_id: mine})
        body["nodeHealth"] = {n: h.model_dump(mode="json") for n, h in health.items()}
        return body

    @router.get("/node_id")
    async def get_node_id() -> str:
        return node.node_id

    return router
