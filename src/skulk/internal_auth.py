"""How one node's HTTP calls to another (topology and link probes, diagnostics and trace fan-out, store reads
and purges) prove they come from the cluster, per request, so that nothing a listener captures can be reused.

Each call carries one `x-skulk-internal` header: a signature (HMAC-SHA256 under a key derived with HKDF from the
cluster's secret) over the method, the raw path and query, the digest of the body, the node it is meant for, a
timestamp and a random nonce. A node accepts a signed call only when the signature holds, it is the target, the
timestamp is within MAX_SKEW_S of its own clock and the nonce is new (each nonce is kept until its timestamp
leaves the window), so a captured call replayed, altered or sent to another node is refused. The answer to a
signed call carries `x-skulk-proof`, an HMAC of the nonce and the answering node's id: a prober counts a round
trip only when the real peer answered it (a keyless host at a reused address cannot).

The secret is the cluster key when one is set, else the admin keys every node was started with. A cluster with
neither has no secret, signs nothing, and its internal calls work only while the API is open (no keys).

Header layout: `v2;t=<unix ms>;n=<32 hex>;to=<target>;bh=<sha256 hex of body>;s=<hmac hex>`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from enum import Enum

import httpx
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from skulk.types import versions

HEADER = "x-skulk-internal"
HEADER_BYTES = HEADER.encode()
PROOF_HEADER = "x-skulk-proof"
STORE_TARGET = "store"
"""The target the model store's file server answers to (it is addressed by name and port, not by node id)."""
MAX_SKEW_S = 60.0
"""A signed call older (or further in the future) than this is refused; nodes on a LAN agree far better."""
NONCES_KEPT = 200_000
"""Nonces remembered at most: far above what a node is sent within MAX_SKEW_S (tens a second)."""
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
_VERSION = "v2"


def _derive(secret: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"skulk internal http v2",
                info=b"node-to-node requests").derive(secret.encode())


class Refusal(Enum):
    """Why a signed call was refused (the store and the API both answer 401 with the matching code)."""

    malformed = "the internal signature header is malformed"
    forged = "the internal signature does not verify (wrong cluster key, or the call was altered)"
    wrong_target = "the internal call was signed for another node"
    stale = "the internal call's timestamp is outside the accepted window (replayed, or the clocks disagree)"
    replayed = "the internal call was already received once (replayed)"
    body = "the internal call's body does not match its signed digest"


@dataclass(frozen=True)
class Claim:
    """What one signed header says, parsed (not yet verified)."""

    ts_ms: int
    nonce: str
    target: str
    body_digest: str
    signature: str


def parse(value: str) -> Claim | None:
    parts = value.split(";")
    if len(parts) != 6 or parts[0] != _VERSION:
        return None
    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    try:
        claim = Claim(int(fields["t"]), fields["n"], fields["to"], fields["bh"], fields["s"])
    except (KeyError, ValueError):
        return None
    if len(claim.nonce) != 32 or len(claim.body_digest) != 64 or len(claim.signature) != 64 or not claim.target:
        return None
    return claim


def _message(method: str, target_path: str, claim: Claim) -> bytes:
    return "\n".join((f"skulk-internal-{_VERSION}", method.upper(), target_path, claim.target, str(claim.ts_ms),
                      claim.nonce, claim.body_digest)).encode()


@dataclass
class NonceBook:
    """The nonces accepted within the window, oldest first; thread-safe (the store serves on threads)."""

    limit: int = NONCES_KEPT
    _seen: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def first_time(self, nonce: str, now: float) -> bool:
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * MAX_SKEW_S
                                  or len(self._seen) >= self.limit):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


@dataclass
class InternalAuth:
    """One node's signing key and identity, and the nonces it has accepted."""

    key: bytes
    node_id: str
    clock: Callable[[], float] = time.time
    nonces: NonceBook = field(default_factory=NonceBook)

    def _mac(self, message: bytes) -> str:
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def sign(self, method: str, target_path: str, body: bytes, target: str) -> str:
        """The header value for one call: `target_path` is the raw path with its query, as sent."""
        claim = Claim(int(self.clock() * 1000), secrets.token_hex(16), target, hashlib.sha256(body).hexdigest(), "")
        signature = self._mac(_message(method, target_path, claim))
        return (f"{_VERSION};t={claim.ts_ms};n={claim.nonce};to={target};bh={claim.body_digest};s={signature}")

    def verify(self, method: str, target_path: str, value: str, accepts: frozenset[str]) -> Claim | Refusal:
        """The claim when the call is authentic, new and meant for one of `accepts`; else why not. The nonce is
        spent only by a call that passes every other check, so a forgery cannot burn a real call's nonce."""
        claim = parse(value)
        if claim is None:
            return Refusal.malformed
        if not hmac.compare_digest(claim.signature, self._mac(_message(method, target_path, claim))):
            return Refusal.forged
        if claim.target not in accepts:
            return Refusal.wrong_target
        now = self.clock()
        if abs(now - claim.ts_ms / 1000) > MAX_SKEW_S:
            return Refusal.stale
        if not self.nonces.first_time(claim.nonce, now):
            return Refusal.replayed
        return claim

    def proof(self, nonce: str) -> str:
        """What this node answers a signed call with: only a holder of the key can say it for this nonce."""
        return self._mac(f"proof\n{nonce}\n{self.node_id}".encode())

    def proves(self, nonce: str, peer: str, value: str | None) -> bool:
        expected = self._mac(f"proof\n{nonce}\n{peer}".encode())
        return value is not None and hmac.compare_digest(value, expected)


_auth: InternalAuth | None = None


def configure(cluster_key: str | None, admin_keys: list[str], node_id: str = "") -> None:
    """Called once by the node at start, when it knows its id (the zenoh session gives it)."""
    global _auth
    secret = cluster_key or ("\n".join(sorted(admin_keys)) if admin_keys else None)
    _auth = InternalAuth(_derive(secret), node_id) if secret else None


def current() -> InternalAuth | None:
    return _auth


def required() -> bool:
    """Whether this cluster has a secret, so that internal endpoints must demand a signature."""
    return _auth is not None


def signed_headers(method: str, target_path: str, target: str, body: bytes = b"") -> dict[str, str]:
    """Headers for one call made outside httpx (the store's stream reader): the format version, and the
    signature when the cluster has a secret."""
    version = {versions.HEADER: str(versions.FORMAT_VERSION)}
    return {**version, HEADER: _auth.sign(method, target_path, body, target)} if _auth is not None else version


def nonce_of(request: httpx.Request) -> str | None:
    """The nonce a signed request was sent with (to check the answer's proof), None when unsigned."""
    claim = parse(request.headers.get(HEADER, ""))
    return claim.nonce if claim is not None else None


class Signer(httpx.Auth):
    """httpx auth that signs each request for `target` as it is sent (a retry or redirect is signed anew)."""

    requires_request_body = True

    def __init__(self, target: str) -> None:
        self.target = target

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        yield self(request)

    def __call__(self, request: httpx.Request) -> httpx.Request:
        """Sign in place (also the shape of a plain function auth, which Starlette's test client takes); every
        node-to-node call says its format version, signed or not."""
        request.headers[versions.HEADER] = str(versions.FORMAT_VERSION)
        if _auth is not None:
            request.headers[HEADER] = _auth.sign(request.method, request.url.raw_path.decode("ascii"),
                                                 request.content, self.target)
        return request


def signer(target: str) -> Signer:
    """The `auth=` of one call to `target` (a node id, or STORE_TARGET)."""
    return Signer(target)


def answered_by(response: httpx.Response, peer: str) -> bool:
    """Whether a signed call's answer came from `peer` itself (always True in a cluster with no secret)."""
    if _auth is None:
        return True
    nonce = nonce_of(response.request)
    return nonce is not None and _auth.proves(nonce, peer, response.headers.get(PROOF_HEADER))


_version_lock = threading.Lock()
_versions_logged: set[str] = set()


def version_refusal(value: str | None, caller: str) -> str | None:
    """Why a node-to-node call saying format version `value` (its `x-skulk-format` header; none: the release
    before versioning) is refused, or None when this node works with it. The first refusal of each version is
    logged (one WARNING line: both versions, what to upgrade); the caller answers 409 with the same line."""
    theirs = versions.version_of_header(value)
    if versions.accepted(versions.judge(theirs)):
        return None
    line = versions.refusal_line(caller, theirs)
    with _version_lock:
        first = str(theirs) not in _versions_logged
        _versions_logged.add(str(theirs))
    if first:
        logging.getLogger(__name__).warning("%s", line)
    return line
