"""How this node dials its peers' HTTP APIs: plain http, or https verified against a CA, for the whole process.

A cluster either serves TLS on every node or on none: a node started with --tls-cert/--tls-key calls every peer
over https (topology and link probes, diagnostics and trace fan-out, store-host calls and purges, response
lookups), and a node without calls every peer over plain http. Peers' URLs are built here (`base_url`) so the
scheme has one home.

Verification: with --tls-ca the peer's certificate must chain to that CA and name the address dialled (as any
https client checks). Without it the node's own certificate is the only trust anchor and the host name is not
checked: a cluster sharing one self-signed pair (`skulk tls self-signed`) dials its peers at whatever addresses
topology finds (DHCP, several interfaces), and only a holder of that exact key can answer, which pins the peer
more tightly than a name would.
"""

from __future__ import annotations

import ssl
from pathlib import Path

_scheme = "http"
_verify: ssl.SSLContext | bool = True


def configure(cert: Path | None, ca: Path | None) -> None:
    """Once, at node start, before anything dials: https when this node serves a certificate."""
    global _scheme, _verify
    if cert is None:
        _scheme, _verify = "http", True
        return
    _scheme, _verify = "https", client_context(cert, ca)


def client_context(cert: Path, ca: Path | None) -> ssl.SSLContext:
    """Trust `ca`, with host names checked; without one, trust `cert` itself, pinned (see the module's note)."""
    context = ssl.create_default_context(cafile=str(ca or cert))
    if ca is None:
        context.check_hostname = False
    return context


def scheme() -> str:
    return _scheme


def verify() -> ssl.SSLContext | bool:
    """What httpx's `verify=` takes for a call to a peer's API."""
    return _verify


def context() -> ssl.SSLContext | None:
    """The verifying context for a peer's https (None: peers speak plain http), for http.client's HTTPSConnection."""
    return _verify if isinstance(_verify, ssl.SSLContext) else None


def base_url(host: str, port: int) -> str:
    """`scheme://host:port` for a peer's API, an IPv6 address in brackets (a bracketed one is kept as it is)."""
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{_scheme}://{bracketed}:{port}"
