"""How one node's HTTP calls to another (diagnostics fan-out, store purge, topology probes) prove they come
from the cluster and not from a user.

The token is an HMAC of a fixed label under the cluster's shared secret: the cluster key when one is set, else
the admin keys every node was started with. A cluster with neither has no secret, sends no token, and its
internal calls work only while the API is open (no keys). Calls carry it in `x-skulk-internal`.
"""

from __future__ import annotations

import hashlib
import hmac

HEADER = "x-skulk-internal"
HEADER_BYTES = HEADER.encode()
_LABEL = b"skulk internal api v1"
_token: str | None = None


def derive(secret: str) -> str:
    return hmac.new(secret.encode(), _LABEL, hashlib.sha256).hexdigest()


def configure(cluster_key: str | None, admin_keys: list[str]) -> None:
    """Called once by the node at start."""
    global _token
    secret = cluster_key or ("\n".join(sorted(admin_keys)) if admin_keys else None)
    _token = derive(secret) if secret else None


def headers() -> dict[str, str]:
    """Headers for a call to a peer node's API."""
    return {HEADER: _token} if _token else {}


def required() -> bool:
    """Whether this cluster has a secret, so that internal endpoints (the store) must demand the token."""
    return _token is not None


def is_internal(value: bytes | None) -> bool:
    return _token is not None and value is not None and hmac.compare_digest(value, _token.encode())
