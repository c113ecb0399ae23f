"""The API's side of signed node-to-node calls (`skulk.internal_auth`): which routes nodes call on each other,
and the checks a signed call passes before any route runs.

A signed call is verified (signature, target, time window, fresh nonce), then its route is checked against
INTERNAL_ROUTES: the calls nodes really make of each other and nothing else, so a valid signature lends no
power to place or delete an instance, change config or switch tracing. Its body is read (bounded) and compared
with the signed digest before the route sees it, and its answer carries this node's proof of the nonce.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from starlette.types import Message, Receive, Scope, Send

from skulk import internal_auth
from skulk.internal_auth import Claim, Refusal
from skulk.types.errors import ErrorCode

_INTERNAL = [
    ("GET", r"/node/probe"), ("GET", r"/node/link_probe"), ("GET", r"/v1/diagnostics/node"),
    ("GET", r"/v1/traces"), ("GET", r"/v1/traces/[^/]+"), ("POST", r"/store/purge-staging/local"),
    ("POST", r"/store/models/.+/download"), ("GET", r"/store/models/.+/download/status"),
    ("GET", r"/internal/responses/[^/]+"), ("DELETE", r"/internal/responses/[^/]+"),
]
INTERNAL_ROUTES = [(method, re.compile(pattern + r"/?")) for method, pattern in _INTERNAL]
"""What one node calls on another (topology/link probes, diagnostics and trace fan-out, staging purge, a download
forwarded to the store host, a stored response looked up or deleted). Anything else refuses a signed call."""


def is_internal_route(method: str, path: str) -> bool:
    method = "GET" if method == "HEAD" else method
    return any(m == method and pattern.fullmatch(path) for m, pattern in INTERNAL_ROUTES)


def target_path(scope: Scope) -> str:
    """The raw path and query as the caller sent (and signed) them."""
    raw = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (raw + (b"?" + query if query else b"")).decode("latin-1")


@dataclass(frozen=True)
class Verdict:
    """What the gate decided: a refusal (status, message, code) or the verified claim."""

    claim: Claim | None = None
    status: int = 0
    message: str = ""
    code: ErrorCode | None = None


def check(scope: Scope, value: bytes) -> Verdict:
    """Verify a signed call's header and route (pure but for the nonce book it spends from)."""
    auth = internal_auth.current()
    assert auth is not None
    found = auth.verify(scope["method"], target_path(scope), value.decode("latin-1"), frozenset({auth.node_id}))
    if isinstance(found, Refusal):
        return Verdict(status=401, message=found.value, code=ErrorCode.invalid_internal_token)
    if not is_internal_route(scope["method"], scope["path"]):
        return Verdict(status=403, message=f"{scope['method']} {scope['path']} is not a call nodes make of each "
                       "other; use an admin API key", code=ErrorCode.internal_route_forbidden)
    return Verdict(claim=found)


async def read_whole(receive: Receive, limit: int) -> bytes | None:
    """The request's body, or None when the client left or it is longer than `limit`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def verified_body(claim: Claim, receive: Receive, limit: int) -> Receive | None:
    """A receive that hands the app the body already read and checked, or None when it does not match."""
    body = await read_whole(receive, limit)
    if body is None or hashlib.sha256(body).hexdigest() != claim.body_digest:
        return None
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def with_proof(send: Send, claim: Claim) -> Send:
    """The answer carries x-skulk-proof: the caller knows this node, not whoever holds its address, answered."""
    auth = internal_auth.current()
    assert auth is not None
    proof = (internal_auth.PROOF_HEADER.encode(), auth.proof(claim.nonce).encode())

    async def send_proved(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), proof]}
        await send(message)

    return send_proved
