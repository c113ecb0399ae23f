"""Cancel a non-streaming request when its client goes away, as a streaming one is.

A streaming response notices a gone client when a write fails; a non-streaming one writes only at the end, so it
would keep a batch slot decoding for nobody. Once the body is read, the next ASGI message can only be the
disconnect: racing it against the work cancels the work, and the work's own cleanup (ChatSession.close) sends
the CancelCommand."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

CLIENT_CLOSED = 499
"""nginx's "client closed request": nobody reads this response; it only shows in access logs."""


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(http: Request, work: Coroutine[Any, Any, T]) -> T | Response:
    """The work's result, or an empty 499 once the client disconnected (the work is cancelled then)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        job.cancel()
        raise
    finally:
        gone.cancel()
    if job.done():
        return job.result()
    job.cancel()
    await asyncio.gather(job, return_exceptions=True)
    return Response(status_code=CLIENT_CLOSED)
