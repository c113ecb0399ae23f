"""Runtime tracing (runbook 004): the cluster-wide switch and the traces saved on this node and its peers.

`/v1/tracing` reads and flips the event-sourced flag (new tasks only). `/v1/traces*` read this node's trace
files; `/v1/traces/cluster*` ask every reachable peer too and merge by task id (read-only).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from skulk import internal_auth, peer_tls
from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.diagnostics.cluster import known_peers, local_addresses, peer_url
from skulk.tracing.store import chrome_trace, merge_spans, stats, valid_task_id
from skulk.types.answers import ChromeTrace, TraceBody, TraceList, TracesDeleted, TraceStats, TracingSwitch
from skulk.types.commands import SetTracingEnabled
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import CommandId, new_id
from skulk.types.tracing import TraceSpan

FLIP_WAIT_S = 2.0
PEER_TIMEOUT_S = 5.0




class TracingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool


class DeleteTracesRequest(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    task_ids: list[str] = Field(min_length=1, max_length=10_000)


def tracing_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["tracing"])

    @router.get("/v1/tracing", response_model=None, responses=documented(TracingSwitch))
    async def get_tracing() -> dict[str, bool]:
        return {"enabled": node.state.tracing_enabled is True}

    @router.put("/v1/tracing", response_model=None, responses=documented(TracingSwitch))
    async def put_tracing(body: TracingRequest) -> dict[str, bool]:
        """Waits up to 2 s for the state to flip; answers what the state says then."""
        node.send_command(SetTracingEnabled(command_id=CommandId(new_id()), enabled=body.enabled))
        await node.wait_for_state(lambda s: (s.tracing_enabled is True) == body.enabled, FLIP_WAIT_S)
        return {"enabled": node.state.tracing_enabled is True}

    async def peers_get(path: str) -> list[Any]:
        state, ours = node.state, local_addresses()
        urls = {p: peer_url(state, node.node_id, p, ours) for p in known_peers(state, node.node_id)}
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, trust_env=False, verify=peer_tls.verify()) as client:
            return await asyncio.gather(*(_get(client, url + path, internal_auth.signer(p))
                                          for p, url in urls.items() if url is not None))

    def local_spans(task_id: str) -> list[TraceSpan]:
        found = node.traces.spans(task_id)
        return found[1] if found is not None else []

    async def cluster_spans(task_id: str) -> list[TraceSpan]:
        answers = await peers_get(f"/v1/traces/{task_id}")
        groups = [[TraceSpan.model_validate(s) for s in a.get("spans", [])] for a in answers if a is not None]
        return merge_spans([local_spans(task_id), *groups])

    @router.get("/v1/traces/cluster", response_model=None, responses=documented(TraceList))
    async def cluster_list() -> dict[str, Any]:
        merged: dict[str, dict[str, Any]] = {t["taskId"]: t for t in await asyncio.to_thread(node.traces.summaries)}
        for answer in await peers_get("/v1/traces"):
            for trace in (answer or {}).get("traces", []):
                mine = merged.setdefault(trace["taskId"], trace)
                if mine is not trace:
                    mine["sourceNodes"] = sorted({*mine["sourceNodes"], *trace["sourceNodes"]})
                    mine["fileSize"] += trace["fileSize"]
                    mine["spanCount"] += trace["spanCount"]
        return {"traces": sorted(merged.values(), key=lambda t: t["createdAt"], reverse=True)}

    @router.get("/v1/traces/cluster/{task_id}", response_model=None, responses=documented(TraceBody, 400, 404))
    async def cluster_trace(task_id: str) -> dict[str, Any]:
        spans = _found(task_id, await cluster_spans(_valid(task_id)))
        return _trace_body(task_id, spans)

    @router.get("/v1/traces/cluster/{task_id}/stats", response_model=None, responses=documented(TraceStats, 400, 404))
    async def cluster_stats(task_id: str) -> dict[str, Any]:
        return stats(task_id, _found(task_id, await cluster_spans(_valid(task_id))))

    @router.get("/v1/traces/cluster/{task_id}/raw", response_model=None, responses=documented(ChromeTrace, 400, 404))
    async def cluster_raw(task_id: str) -> dict[str, Any]:
        return chrome_trace(task_id, _found(task_id, await cluster_spans(_valid(task_id))))

    @router.get("/v1/traces", response_model=None, responses=documented(TraceList))
    async def list_traces() -> dict[str, Any]:
        return {"traces": await asyncio.to_thread(node.traces.summaries)}

    @router.post("/v1/traces/delete", response_model=None, responses=documented(TracesDeleted))
    async def delete_traces(body: DeleteTracesRequest) -> dict[str, Any]:
        return {"deleted": await asyncio.to_thread(node.traces.delete, body.task_ids)}

    @router.get("/v1/traces/{task_id}", response_model=None, responses=documented(TraceBody, 400, 404))
    async def get_trace(task_id: str) -> dict[str, Any]:
        return _trace_body(task_id, _found(task_id, local_spans(_valid(task_id))))

    @router.get("/v1/traces/{task_id}/stats", response_model=None, responses=documented(TraceStats, 400, 404))
    async def get_stats(task_id: str) -> dict[str, Any]:
        return stats(task_id, _found(task_id, local_spans(_valid(task_id))))

    @router.get("/v1/traces/{task_id}/raw", response_model=None, responses=documented(ChromeTrace, 400, 404))
    async def get_raw(task_id: str) -> dict[str, Any]:
        return chrome_trace(task_id, _found(task_id, local_spans(_valid(task_id))))

    return router


def _valid(task_id: str) -> str:
    if not valid_task_id(task_id):
        raise ApiError(ErrorCode.invalid_task_id, f"invalid task id {task_id!r}: letters, digits, '-' and '_' only")
    return task_id


def _found(task_id: str, spans: list[TraceSpan]) -> list[TraceSpan]:
    if not spans:
        raise ApiError(ErrorCode.trace_not_found,
                       f"no trace of task {task_id}; GET /v1/traces lists the traces saved here")
    return spans


def _trace_body(task_id: str, spans: list[TraceSpan]) -> dict[str, Any]:
    return {
        "taskId": task_id,
        "sourceNodes": sorted({s.node_id for s in spans if s.node_id}),
        "spans": [s.model_dump(mode="json") for s in spans],
    }


async def _get(client: httpx.AsyncClient, url: str, auth: httpx.Auth) -> Any:
    """A peer's JSON, or None: a peer that is down or has no such trace leaves the others' answers whole."""
    try:
        response = await client.get(url, auth=auth)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
