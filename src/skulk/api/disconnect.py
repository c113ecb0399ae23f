"""Cancel a request when its client goes away: a non-streaming one as a streaming one is, and a streaming one
(Stream) without a task group between its first token and the client.

A streaming response notices a gone client when a write fails; a non-streaming one writes only at the end, so it
would keep a batch slot decoding for nobody. Once the body is read, the next ASGI message can only be the
disconnect: racing it against the work cancels the work, and the work's own cleanup (ChatSession.close) sends
the CancelCommand."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

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


class Stream(StreamingResponse):
    """A streamed response (SSE or NDJSON) written from the request's own task, with a watcher task that cancels it
    when the client disconnects: what Starlette's StreamingResponse does with an anyio task group whose streaming
    child only starts on a later turn of the loop (0.45 ms of every first token's way out here, issue 43). On a
    disconnect the body's generator is cancelled where it waits, so its cleanup (ChatSession.close) cancels the
    task, as before."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        streaming = asyncio.current_task()
        assert streaming is not None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            streaming.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside (the server stopping), not by the client's disconnect
            streaming.uncancel()
        finally:
            watcher.cancel()
        if self.background is not None:
            await self.background()
