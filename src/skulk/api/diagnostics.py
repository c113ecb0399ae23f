"""Diagnostics endpoints: this node's bundle, the cluster bundle and timeline, one peer, cooperative cancel.

Read-only except for cancel, which only asks a local runner to stop its task; the runner decides when.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.diagnostics.clock import utc_now
from skulk.diagnostics.cluster import (
    DEFAULT_PEER_TIMEOUT_S,
    collect_cluster,
    fetch_peers,
    known_peers,
)
from skulk.diagnostics.node_bundle import collect_node_bundle
from skulk.diagnostics.timeline import merge_timeline
from skulk.types.answers import PeerDiagnostics, RunnerCancel
from skulk.types.diagnostics_bundle import ClusterDiagnostics, ClusterTimeline, NodeDiagnostics
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import NodeId, RunnerId


def diagnostics_router(node: ApiServices, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> APIRouter:
    router = APIRouter(prefix="/v1/diagnostics", tags=["diagnostics"])

    async def cluster() -> ClusterDiagnostics:
        local = await collect_node_bundle(node)
        return await collect_cluster(
            local, node.state, node.node_id, node.master_id, peer_timeout_s, departed=node.departed_peers
        )

    @router.get("/node", response_model=None, responses=documented(NodeDiagnostics))
    async def node_diagnostics() -> dict[str, Any]:
        return (await collect_node_bundle(node)).model_dump(mode="json")

    @router.get("/cluster", response_model=None, responses=documented(ClusterDiagnostics))
    async def cluster_diagnostics() -> dict[str, Any]:
        return (await cluster()).model_dump(mode="json")

    @router.get("/cluster/timeline", response_model=None, responses=documented(ClusterTimeline))
    async def cluster_timeline() -> dict[str, Any]:
        bundle = await cluster()
        return merge_timeline(bundle, utc_now(), node.state).model_dump(mode="json")

    @router.get("/cluster/{node_id}", response_model=None, responses=documented(PeerDiagnostics, 404))
    async def peer_diagnostics(node_id: str) -> dict[str, Any]:
        """One node's bundle through any node: the answer is a ClusterDiagnostics node entry."""
        if node_id == node.node_id:
            local = await collect_node_bundle(node)
            return {"nodeId": node_id, "url": None, "ok": True, "diagnostics": local.model_dump(mode="json")}
        peer = NodeId(node_id)
        if peer not in known_peers(node.state, node.node_id):
            raise ApiError(ErrorCode.node_not_found, f"node {node_id} is not known to this cluster")
        (result,) = await fetch_peers(node.state, node.node_id, [peer], peer_timeout_s)
        return result.model_dump(mode="json")

    @router.post("/node/runners/{runner_id}/cancel", response_model=None, responses=documented(RunnerCancel, 404))
    async def cancel_runner_task(runner_id: str) -> dict[str, Any]:
        """Cooperative: the runner observes the cancel between steps and ends the task as Cancelled."""
        supervisor = node.supervisors.get(RunnerId(runner_id))
        if supervisor is None:
            raise ApiError(ErrorCode.runner_not_found, f"runner {runner_id} does not run on this node")
        view = supervisor.view
        task_ids = [*view.in_progress, *(t for t in view.pending if t not in view.in_progress)]
        for task_id in task_ids:
            supervisor.cancel(task_id)
        return {"runnerId": runner_id, "nodeId": node.node_id, "cancelRequestedTaskIds": task_ids}

    return router
