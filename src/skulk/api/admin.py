"""Admin routes: POST /admin/restart[?node_id=…] (runbook 004).

Admin scope: with API keys configured, every route outside the inference list needs an admin key
(api/security.py), so these are admin-only by construction; nothing here needs to check it again.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.diagnostics.cluster import known_peers
from skulk.types.answers import RestartAnswer
from skulk.types.commands import RestartNode
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import CommandId, NodeId, new_id


def admin_router(node: ApiServices) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])

    pending = {409: {"model": RestartAnswer, "description": "A restart is already pending"}}

    @router.post("/restart", response_model=None, responses={**documented(RestartAnswer, 400, 404), **pending})
    async def restart(node_id: str | None = None) -> dict[str, Any] | JSONResponse:
        """This node: stop runners and os.execv in place (same pid). Another node: a RestartNode command.
        An empty or blank node_id is a mistake (a script's unset variable), never this node: 400."""
        if node_id is not None and not node_id.strip():
            raise ApiError(ErrorCode.invalid_node_id,
                           "node_id is empty; omit it to restart this node, or give a node id from GET /state")
        if node_id is not None and node_id != node.node_id:
            if NodeId(node_id) not in known_peers(node.state, node.node_id):
                raise ApiError(ErrorCode.node_not_found,
                               f"node {node_id} is not known to this cluster (GET /state lists the node ids)")
            node.send_command(RestartNode(command_id=CommandId(new_id()), node_id=NodeId(node_id)))
            return {"status": "restart_sent", "nodeId": node_id}
        if not node.restart.request("POST /admin/restart"):
            return JSONResponse({"status": "restart_already_pending", "nodeId": node.node_id}, status_code=409)
        return {"status": "restarting", "nodeId": node.node_id}

    return router
