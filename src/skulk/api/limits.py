"""Bounds on what one HTTP client can make a node hold: body size, slow clients, open connections.

A 10 MB body once took 13 s to refuse because it was read whole first, and ~1100 idle sockets took the API down:
slow connections were never timed out and the process ran out of file descriptors. Here the body is counted as
it arrives (413 as soon as it passes the limit, or at once from Content-Length), a body that stalls is refused
(408), a connection that does not finish its request head in time is closed, connections beyond a cap are
closed on accept, and the soft open-file limit is raised to the hard one at start.

A stall timeout alone did not bound a body that drips (1 byte every 20 s held a connection for ever), and one
global cap let a single key holder take all 4,096 connections (issue 27): the body now has a deadline of its own
(head deadline + body deadline = the whole request's), and each client address has its own cap.
"""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from skulk.types.errors import ErrorCode, error_body


class RequestRefused(HTTPException):
    """Raised from inside `receive` so the app stops reading. An HTTPException, so FastAPI's body parsing lets it
    through to the error handlers (any other exception there becomes a generic 400); the middleware answers it
    itself when it escapes a route that reads the body on its own."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(code.status, message, headers={"Connection": "close"})
        self.status, self.message, self.code = code.status, message, code


def too_large(limit: int) -> RequestRefused:
    return RequestRefused(ErrorCode.request_too_large,
                          f"request body exceeds the limit of {limit} bytes ({limit / 1048576:.1f} MiB); "
                          "send a smaller request or raise SKULK_MAX_BODY_BYTES")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_error(send: Send, status: int, message: str, code: ErrorCode,
                     kind: str = "invalid_request_error") -> None:
    """A refusal answered before any route runs, in the native body; the code is always one of ErrorCode's."""
    body = json.dumps(error_body(message, kind=kind, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Counts the bytes of the request body as the app reads them; refuses past `max_bytes` or after a stall."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, stall_timeout_s: float,
                 deadline_s: float | None = None) -> None:
        self.app, self.max_bytes, self.stall_timeout_s = app, max_bytes, stall_timeout_s
        self.deadline_s = deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            refused = too_large(self.max_bytes)
            await send_error(send, refused.status, refused.message, refused.code)
            return
        started = False
        seen = 0
        body_done = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s if self.deadline_s is not None else None

        async def counted_receive() -> Message:
            """The stall deadline holds only while the body is arriving: once it is complete, the next message is
            the client's disconnect, which streams (and a non-streaming request's watcher) wait for as long as
            the response takes."""
            nonlocal seen, body_done
            if body_done:
                return await receive()
            left = max(deadline - loop.time(), 0.0) if deadline is not None else self.stall_timeout_s
            overdue = left < self.stall_timeout_s  # the whole-body deadline comes before the next stall would
            try:
                async with asyncio.timeout(min(left, self.stall_timeout_s)):  # not wait_for: 3.11 can drop a cancel
                    message = await receive()
            except TimeoutError:
                why = (f"request body not complete within {self.deadline_s:.0f} s" if overdue else
                       f"request body stalled for {self.stall_timeout_s:.0f} s")
                raise RequestRefused(ErrorCode.request_timeout, why) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except RequestRefused as refused:
            if not started:
                await send_error(send, refused.status, refused.message, refused.code)


def client_address(transport: Any) -> str | None:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


class _OpenConnections:
    """The connections a server has admitted, in all and by client address.

    Counted here, not read from uvicorn's `connections` set: a connection refused on accept stays in that set
    until its `connection_lost` runs on a later turn of the loop, so a burst accepted in one turn (a flood
    from one address, then a legitimate client in the same batch) would count the refused ones against the
    global cap and refuse the legitimate client too."""

    def __init__(self) -> None:
        self.total = 0
        self.by_client: dict[str, int] = {}

    def admit(self, client: str | None, max_connections: int, max_per_client: int | None) -> bool:
        if self.total >= max_connections:
            return False
        if client is not None and max_per_client is not None and self.by_client.get(client, 0) >= max_per_client:
            return False
        self.total += 1
        if client is not None:
            self.by_client[client] = self.by_client.get(client, 0) + 1
        return True

    def release(self, client: str | None) -> None:
        self.total -= 1
        if client is None:
            return
        left = self.by_client.get(client, 1) - 1
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)


def guarded_protocol(
    max_connections: int, header_timeout_s: float, max_per_client: int | None = None, *, c_parser: bool = True
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a deadline for the request head and caps on open connections: all of them,
    and those of one client address.

    uvicorn times out idle keep-alive connections only after a first response, so a client that opens a
    socket and sends nothing (or one byte a minute) holds it for ever; its `limit_concurrency` answers 503 to
    every new request once enough such sockets are open, which is the outage itself.

    The protocol is uvicorn's httptools one where httptools is installed (a dependency): its parser is C, and
    h11's pure-Python event validation was the largest single cost of a streamed token on the API node (about a
    fifth of its Python per token, bench/node_path.py --spy-gil). h11's where it is not, or with c_parser False."""
    counts = _OpenConnections()  # one server's admitted connections (one event loop: no lock)
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools wheel for this platform
        HttpToolsProtocol = None
    if not c_parser:
        HttpToolsProtocol = None

    class Guard(asyncio.Protocol):
        """The guard, put before either protocol in the bases: admit on connect and arm the head deadline,
        release on loss; each protocol says where its request head is complete (`_head_complete`)."""

        _head_deadline: asyncio.TimerHandle | None = None
        _admitted: bool = False
        _client: str | None = None
        loop: asyncio.AbstractEventLoop
        transport: Any
        cycle: Any

        def connection_made(self, transport: Any) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
            super().connection_made(transport)
            client = client_address(transport)
            if not counts.admit(client, max_connections, max_per_client):
                transport.abort()
                return
            self._admitted = True
            self._client = client
            self._head_deadline = self.loop.call_later(header_timeout_s, self._head_overdue)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None
            if self._admitted:
                counts.release(self._client)
                self._admitted = False
            super().connection_lost(exc)

        def _head_complete(self) -> None:
            if self.cycle is not None and self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_overdue(self) -> None:
            self._head_deadline = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.abort()

    if HttpToolsProtocol is not None:
        class GuardedHttpToolsProtocol(Guard, HttpToolsProtocol):  # pyright: ignore[reportIncompatibleVariableOverride]
            def on_headers_complete(self) -> None:
                super().on_headers_complete()
                self._head_complete()

        return GuardedHttpToolsProtocol

    class GuardedH11Protocol(Guard, H11Protocol):  # pyright: ignore[reportIncompatibleVariableOverride]
        def handle_events(self) -> None:
            super().handle_events()
            self._head_complete()

    return GuardedH11Protocol


def raise_open_file_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit: every connection is a descriptor, and running out makes the
    accept loop fail (and log) in a tight loop. Returns (soft, hard) after the change."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard
