"""Who may call the API: API keys with two scopes, a Host allow-list, foreign Origins refused, owned cancels.

Without keys the API stays open (zero-config), as before. With `--api-key`/`--admin-key` every route needs a key
(`Authorization: Bearer …` as OpenAI and Ollama clients send it, or `x-api-key` as Anthropic clients do) except
the liveness routes. An inference key may chat, list models, read the cluster's state and cancel its own
requests; everything else (placing and deleting instances and MetaInstances, cancelling someone else's request,
diagnostics, the store, config) needs an admin key. Calls between nodes (probes, diagnostics and trace fan-out,
store purge) are signed per request instead (`skulk.internal_auth`) and may reach only the routes nodes call on
each other (`internal_gate`).

A browser page cannot be turned against a node: a Host header that names neither this machine nor an allowed
host is refused (DNS rebinding), and a state-changing request whose Origin is neither this node nor an allowed
CORS origin is refused (a form or fetch from any web page).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any
from urllib.parse import urlsplit

import psutil
from fastapi import APIRouter, FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from skulk import internal_auth
from skulk.api import internal_gate
from skulk.api.dashboard import is_dashboard_path
from skulk.api.limits import BodyLimitMiddleware, send_error
from skulk.api.openapi import declare_common_errors, documented
from skulk.cluster.seal import Sealer, reachable_beyond_loopback
from skulk.config import Settings
from skulk.internal_auth import Refusal
from skulk.types import versions
from skulk.types.answers import Health, SecurityView
from skulk.types.errors import ApiError, ErrorCode, kind_for


class Access(IntEnum):
    NONE = 0
    INFERENCE = 1
    ADMIN = 2


EXEMPT = {("GET", "/healthz"), ("GET", "/node_id")}
"""Liveness, and this node's id for a person or script (nodes probe each other on the signed /node/probe)."""
NODE_ID_RATE, NODE_ID_BURST = 20.0, 40.0
"""Keyless GET /node_id answers a second on a keyed node, and the burst: a flood costs a cheap 429 each."""
_INFERENCE = [
    ("POST", r"/v1/chat/completions"), ("POST", r"/bench/chat/completions"), ("POST", r"/v1/completions"),
    ("POST", r"/v1/messages(/count_tokens)?"), ("POST", r"/v1/responses"), ("POST", r"/v1/embeddings"),
    ("POST", r"(/ollama)?/api/(chat|generate|show|embed|embeddings)"), ("POST", r"/v1/cancel/[^/]+"),
    ("GET", r"/v1/responses/[^/]+"), ("DELETE", r"/v1/responses/[^/]+"),
    ("GET", r"/v1/models(/.*)?"), ("GET", r"/models"), ("GET", r"(/ollama)?/api/(tags|version|ps)"), ("GET", r"/state"),
    ("GET", r"/instance/[^/]+"), ("GET", r"/meta_instances"),
]
INFERENCE_ROUTES = [(method, re.compile(pattern + r"/?")) for method, pattern in _INFERENCE]
"""What an inference key may call; every other route (including any added later) needs an admin key."""
STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def required_access(method: str, path: str) -> Access:
    """The least access a route needs (pure). HEAD is GET's twin; OPTIONS is answered by CORS, if configured."""
    method = "GET" if method == "HEAD" else method
    if (method, path) in EXEMPT or (method == "GET" and is_dashboard_path(path)):
        return Access.NONE  # the dashboard's static files: the page must load to ask for a key
    if any(m == method and pattern.fullmatch(path) for m, pattern in INFERENCE_ROUTES):
        return Access.INFERENCE
    return Access.ADMIN


def fingerprint(key: str) -> str:
    """What the node keeps of a key to remember who started a request (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KeyRing:
    inference: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.inference or self.admin)

    def access_of(self, key: str | None) -> Access:
        """Constant-time comparison against every key; admin keys may do everything inference keys may."""
        if key is None:
            return Access.NONE
        is_admin = any(hmac.compare_digest(key.encode(), k.encode()) for k in self.admin)
        is_user = any(hmac.compare_digest(key.encode(), k.encode()) for k in self.inference)
        return Access.ADMIN if is_admin else Access.INFERENCE if is_user else Access.NONE


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
    return key or None


def host_name_of(host_header: str) -> str:
    """The host part of a Host header, without port; IPv6 literals keep no brackets."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def is_loopback_bind(api_host: str) -> bool:
    if api_host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(api_host).is_loopback
    except ValueError:
        return False


@dataclass
class LocalNames:
    """This machine's names and addresses, refreshed at most every few seconds (DHCP moves addresses)."""

    extra: frozenset[str]
    refresh_s: float = 5.0
    _names: frozenset[str] = frozenset()
    _at: float = -1e9

    def allows(self, host: str) -> bool:
        host = host.lower()
        if not host or "*" in self.extra or host in self.extra or host in LOOPBACK_NAMES:
            return True
        if host not in self._names and time.monotonic() - self._at > self.refresh_s:
            self._names, self._at = _local_names(), time.monotonic()
        return host in self._names


def _local_names() -> frozenset[str]:
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    for addresses in psutil.net_if_addrs().values():
        names.update(a.address.split("%", 1)[0].lower() for a in addresses if a.family in (socket.AF_INET,
                                                                                               socket.AF_INET6))
    return frozenset(names)


@dataclass(frozen=True)
class Principal:
    access: Access
    key_id: str | None  # fingerprint of the key used; None when keys are off or for internal calls


OPEN = Principal(Access.ADMIN, None)
INTERNAL = Principal(Access.ADMIN, None)
"""A verified node-to-node call: admin, but only on internal_gate.INTERNAL_ROUTES (the gate refuses the rest)."""
CURRENT: ContextVar[Principal] = ContextVar("skulk_principal", default=OPEN)


@dataclass
class Owners:
    """Which key started which command on this node, so a cancel by command id can be checked (bounded)."""

    limit: int = 100_000
    _by_command: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def claim(self, command_id: str) -> None:
        key_id = CURRENT.get().key_id
        if key_id is None:
            return
        self._by_command[command_id] = key_id
        while len(self._by_command) > self.limit:
            self._by_command.popitem(last=False)

    def check_cancel(self, command_id: str) -> None:
        """An admin may cancel anything; an inference key only what it started (on the node it started it)."""
        principal = CURRENT.get()
        if principal.access >= Access.ADMIN:
            return
        if self._by_command.get(command_id) != principal.key_id:
            raise ApiError(ErrorCode.forbidden,
                           f"request {command_id} was not started with this API key; only the key that "
                           "started it (or an admin key) may cancel it")


OWNERS = Owners()


@dataclass
class TokenBucket:
    """`rate` takes a second, up to `burst` at once (monotonic clock)."""

    rate: float
    burst: float
    _tokens: float = -1.0
    _at: float = 0.0

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = self.burst if self._tokens < 0 else min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def same_origin(origin: str, host_header: str) -> bool:
    parts = urlsplit(origin)
    return bool(parts.netloc) and parts.netloc.lower() == host_header.lower()


class SecurityMiddleware:
    """Host, Origin and API-key checks before any route runs or any body byte is read."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.keys = KeyRing(tuple(settings.api_keys), tuple(settings.admin_keys))
        self.names = LocalNames(frozenset(h.lower() for h in settings.allowed_hosts))
        self.origins = frozenset(o.rstrip("/").lower() for o in settings.cors_origins)
        self.max_body_bytes = settings.max_body_bytes
        self.guarded = self.keys.enabled or settings.cluster_key is not None
        self.node_id_bucket = TokenBucket(NODE_ID_RATE, NODE_ID_BURST)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        refused = version_refused(headers)
        if refused is not None:
            await send_error(send, 409, refused, ErrorCode.format_version_refused, kind_for(409))
            return
        signed = headers.get(internal_auth.HEADER_BYTES)
        if signed is not None and internal_auth.required():
            await self._internal(scope, receive, send, headers, signed)
            return
        refusal = self.refusal(scope["method"], scope["path"], headers)
        if refusal is not None:
            status, message, code, kind = refusal
            await send_error(send, status, message, code, kind)
            return
        token = CURRENT.set(self.principal(headers))
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT.reset(token)

    async def _internal(self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes],
                        signed: bytes) -> None:
        """A call signed by a node of the cluster: verified per request, limited to the routes nodes call on each
        other, its body checked against the signed digest; it acts as admin on that route only."""
        refusal = self.place_refusal(scope["method"], headers)
        if refusal is not None:
            await send_error(send, *refusal)
            return
        verdict = internal_gate.check(scope, signed)
        if verdict.claim is None:
            assert verdict.code is not None, "a verdict without a claim is a refusal, which names its code"
            await send_error(send, verdict.status, verdict.message, verdict.code, kind_for(verdict.status))
            return
        checked = await internal_gate.verified_body(verdict.claim, receive, self.max_body_bytes)
        if checked is None:
            await send_error(send, 401, Refusal.body.value, ErrorCode.invalid_internal_token, "authentication_error")
            return
        token = CURRENT.set(INTERNAL)
        try:
            await self.app(scope, checked, internal_gate.with_proof(send, verdict.claim))
        finally:
            CURRENT.reset(token)

    def principal(self, headers: dict[bytes, bytes]) -> Principal:
        if not self.keys.enabled:
            return OPEN
        key = presented_key(headers)
        return Principal(self.keys.access_of(key), fingerprint(key) if key else None)

    def place_refusal(self, method: str, headers: dict[bytes, bytes]) -> tuple[int, str, ErrorCode, str] | None:
        """The Host and Origin checks every request passes, a signed node's call too."""
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.names.allows(host_name_of(host)):
            return (400, f"Host {host!r} is not this node; add it with --allowed-host (SKULK_ALLOWED_HOSTS) if it "
                    "is a name of this machine", ErrorCode.host_not_allowed, "invalid_request_error")
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/")
        if method in STATE_CHANGING and origin and origin.lower() not in self.origins and not same_origin(
                origin, host):
            return (403, f"Origin {origin!r} may not change anything here; allow it with --cors-origin",
                    ErrorCode.origin_not_allowed, "permission_error")
        return None

    def refusal(self, method: str, path: str, headers: dict[bytes, bytes]) -> tuple[int, str, ErrorCode, str] | None:
        """None, or (status, message, code, kind) for the first check the request fails."""
        if (placed := self.place_refusal(method, headers)) is not None:
            return placed
        needed = required_access(method, path)
        if needed is Access.NONE or method == "OPTIONS":
            if (method, path) == ("GET", "/node_id") and self.guarded and not self.node_id_bucket.take():
                return (429, "GET /node_id is answered at most a few times a second on a keyed node; retry later",
                        ErrorCode.rate_limited, "rate_limit_error")
            return None
        got = self.principal(headers).access
        if got is Access.NONE:
            return (401, "an API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    ErrorCode.missing_api_key if presented_key(headers) is None else ErrorCode.invalid_api_key,
                    "authentication_error")
        if got < needed:
            return (403, f"{method} {path} needs an admin key (--admin-key); this key may only run inference",
                    ErrorCode.admin_key_required, "permission_error")
        return None


def liveness_router() -> APIRouter:
    router = APIRouter(tags=["liveness"])

    @router.get("/healthz", response_model=None, responses=documented(Health))
    async def healthz() -> dict[str, str]:
        """Liveness: answers without a key, says nothing about the cluster."""
        return {"status": "ok"}

    return router


def install_security(app: FastAPI, settings: Settings) -> None:
    """Outermost first: CORS (only with --cors-origin) answers preflights, then Host/Origin/key checks, then the
    body limit, so an unauthenticated or misdirected request is refused before a byte of its body is read."""
    app.include_router(declare_common_errors(liveness_router()))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       stall_timeout_s=settings.body_timeout_seconds, deadline_s=settings.request_timeout_seconds)
    app.add_middleware(SecurityMiddleware, settings=settings)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["*"])


def sealing_router(
    sealer_of: Callable[[], Sealer | None],
    api_host: str,
    zenoh_listen: list[str],
    membership: Callable[[], tuple[frozenset[str], frozenset[str]]] = lambda: (frozenset(), frozenset()),
) -> APIRouter:
    """GET /v1/diagnostics/security (admin): whether the cluster is sealed, what was dropped as forged or
    replayed, and who is a member against who merely holds a liveliness token (a phantom shows as unvouched)."""
    router = APIRouter(tags=["diagnostics"])

    @router.get("/v1/diagnostics/security", response_model=None, responses=documented(SecurityView))
    async def security() -> dict[str, Any]:
        sealer = sealer_of()
        warnings = []
        if sealer is None and reachable_beyond_loopback(api_host, zenoh_listen):
            warnings.append("no cluster key: any host on this network can read prompts and tokens and send "
                            "commands (run `skulk keygen` and start every node with --cluster-key)")
        stats = sealer.stats if sealer is not None else None
        members, tokens = membership()
        return {
            "members": sorted(members),
            "unvouchedTokens": sorted(tokens - members),
            "sealed": sealer is not None,
            "forgedDropped": stats.forged if stats else 0,
            "replayedDropped": stats.replayed if stats else 0,
            "opened": stats.opened if stats else 0,
            "sealedSent": stats.sealed if stats else 0,
            "warnings": warnings,
        }

    return router


_FORMAT_HEADER = versions.HEADER.encode()


def version_refused(headers: dict[bytes, bytes]) -> str | None:
    """A node-to-node call of a format version this node does not work with (types/versions.py); clients that
    are not nodes send no version header and are never refused for it."""
    value = headers.get(_FORMAT_HEADER)
    if value is None:
        return None
    return internal_auth.version_refusal(value.decode("latin-1"), "a peer's call")
