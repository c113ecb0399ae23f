"""Stored responses found from any node: a client behind a load balancer continues, reads or deletes a response
through whichever node it reaches.

A response stays where it was answered (response_store.py: one node's memory, with its bounds). A node that
does not hold it asks its peers, all at once, on a signed internal call (`GET /internal/responses/{id}`), and
takes the first that has it; the owner check is the asking node's, on the holder's record, so another inference
key gets the same 404 everywhere. A delete removes the local copy and asks every peer to remove theirs
(`DELETE /internal/responses/{id}`). Nothing is copied between nodes, so retention and size limits are the
holder's, and the same on every node.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from skulk import internal_auth, peer_tls
from skulk.api.response_store import ResponseStore, Stored, check_owner, not_found
from skulk.api.services import ApiServices
from skulk.diagnostics.cluster import local_addresses, peer_url
from skulk.types.chat import ChatMessage
from skulk.types.ids import NodeId

PEER_TIMEOUT_S = 3.0
"""How long a lookup waits for the slowest peer before a miss is a 404 (a hit returns at once)."""
_TURNS = TypeAdapter(list[ChatMessage])


def _record(stored: Stored, age_s: float) -> dict[str, Any]:
    return {"response": stored.response, "conversation": [m.model_dump(mode="json") for m in stored.conversation],
            "owner": stored.owner, "ageS": age_s, "size": stored.size}


def _from_record(body: Any, now: float) -> Stored | None:
    try:
        turns = _TURNS.validate_python(body["conversation"])
        return Stored(str(body["response"]), tuple(turns), now - float(body["ageS"]), int(body["size"]),
                      body.get("owner"))
    except (KeyError, TypeError, ValueError, ValidationError):
        return None


def _peers(node: ApiServices) -> dict[NodeId, str]:
    """The live peers with an API address (a departed node cannot hold what a client may still continue)."""
    ours = local_addresses()
    found = {p: peer_url(node.state, node.node_id, p, ours) for p in node.state.node_api_ports if p != node.node_id}
    return {p: url for p, url in found.items() if url is not None}


async def _ask(client: httpx.AsyncClient, method: str, peer: NodeId, url: str) -> httpx.Response | None:
    try:
        return await client.request(method, url, auth=internal_auth.signer(peer))
    except httpx.HTTPError:
        return None


class ClusterResponses:
    """This node's ResponseStore, and its peers' behind it."""

    def __init__(self, node: ApiServices, store: ResponseStore | None = None) -> None:
        self.node, self.local = node, store if store is not None else ResponseStore()

    async def find(self, response_id: str) -> Stored | None:
        found = self.local.get(response_id)
        if found is not None:
            return found
        peers = _peers(self.node)
        if not peers:
            return None
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, trust_env=False, verify=peer_tls.verify()) as client:
            asks = [asyncio.ensure_future(_ask(client, "GET", p, f"{url}/internal/responses/{response_id}"))
                    for p, url in peers.items()]
            try:
                for next_done in asyncio.as_completed(asks):
                    reply = await next_done
                    if reply is not None and reply.status_code == 200:
                        return _from_record(reply.json(), self.local.clock())
            finally:
                for ask in asks:
                    ask.cancel()
        return None

    async def require(self, response_id: str, *, param: str | None = None) -> Stored:
        """The response from this node or any peer, or the 404 (also for another key's response)."""
        found = check_owner(await self.find(response_id))
        if found is None:
            raise not_found(response_id, param, self.local.max_age_s)
        return found

    async def delete(self, response_id: str) -> None:
        """Require it (404 if no node has it for this key), then delete it here and on every peer."""
        await self.require(response_id)
        self.local.delete(response_id)
        peers = _peers(self.node)
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, trust_env=False, verify=peer_tls.verify()) as client:
            await asyncio.gather(*(_ask(client, "DELETE", p, f"{url}/internal/responses/{response_id}")
                                   for p, url in peers.items()))


def internal_router(responses: ClusterResponses) -> APIRouter:
    """What peers ask of this node's own store (internal_gate lets only signed node calls through)."""
    router = APIRouter(tags=["internal"], include_in_schema=False)

    @router.get("/internal/responses/{response_id}", response_model=None)
    async def held(response_id: str) -> JSONResponse:
        found = responses.local.get(response_id)
        if found is None:
            return JSONResponse({"found": False}, status_code=404)
        return JSONResponse(_record(found, responses.local.clock() - found.created))

    @router.delete("/internal/responses/{response_id}", response_model=None)
    async def drop(response_id: str) -> dict[str, bool]:
        return {"deleted": responses.local.delete(response_id)}

    return router
