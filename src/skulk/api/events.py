"""GET /events: this node's API-side event log (runbook 004), read back from disk.

Records are `{"seq", "at", "kind", "event"}`, oldest first, with `seq > since`; the answer says where to
continue (`nextSince`) and whether the log is writing or only counting (then history thins out).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query

from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.types.answers import EventsPage
from skulk.types.errors import ApiError, ErrorCode

MAX_LIMIT = 10_000




def events_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["events"])

    @router.get("/events", response_model=None, responses=documented(EventsPage, 404))
    async def events(
        since: Annotated[int, Query(ge=0, description="return records with seq greater than this")] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="at most this many records")] = 1000,
    ) -> dict[str, Any]:
        event_log = node.event_log
        if event_log is None:
            raise ApiError(ErrorCode.event_log_disabled,
                           "the event log is off on this node (event_log.enabled: false in skulk.yaml)")
        found = await asyncio.to_thread(event_log.read, since, limit)
        return {
            "events": found,
            "nextSince": found[-1]["seq"] if found else since,
            "firstSeq": await asyncio.to_thread(event_log.first_seq),
            **event_log.status(),
        }

    return router
