"""Read-only views of the cluster: /state, /node_id, /models."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter

from skulk.api.handle import NodeHandle
from skulk.diagnostics.health import cluster_health
from skulk.models.cards import all_cards


def state_router(node: NodeHandle) -> APIRouter:
    router = APIRouter(tags=["state"])

    @router.get("/state")
    async def get_state() -> dict[str, Any]:
        body = node.state.model_dump(mode="json")
        health = cluster_health(node.state, datetime.now(UTC))
        body["nodeHealth"] = {n: h.model_dump(mode="json") for n, h in health.items()}
        return body

    @router.get("/node_id")
    async def get_node_id() -> str:
        return node.node_id

    @router.get("/models")
    async def get_models() -> dict[str, Any]:
        return {"data": [card.model_dump(mode="json") for card in all_cards()]}

    return router
