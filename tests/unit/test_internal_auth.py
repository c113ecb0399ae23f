"""Signed node-to-node calls (issue 38): each call is bound to method, path and query, body, target node, a time
window and a nonce; replayed, altered, retargeted, stale or forged calls are refused, and a valid signature lends
no power beyond the routes nodes call on each other. The answer proves the node that gave it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from skulk import internal_auth
from skulk.api.errors import install_error_handlers
from skulk.api.internal_gate import is_internal_route
from skulk.api.security import install_security
from skulk.config import Settings
from skulk.internal_auth import MAX_SKEW_S, InternalAuth, Refusal

KEY = b"k" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_signed_call_verifies_once_and_only_as_signed() -> None:
    clock = Clock()
    sender, receiver = InternalAuth(KEY, "a", clock), InternalAuth(KEY, "b", clock)
    header = sender.sign("GET", "/v1/diagnostics/node", b"", "b")
    accepts = frozenset({"b"})
    assert receiver.verify("POST", "/v1/diagnostics/node", header, accepts) is Refusal.forged
    assert receiver.verify("GET", "/v1/diagnostics/node?x=1", header, accepts) is Refusal.forged
    assert receiver.verify("GET", "/place_instance", header, accepts) is Refusal.forged
    assert receiver.verify("GET", "/v1/diagnostics/node", header, frozenset({"c"})) is Refusal.wrong_target
    assert receiver.verify("GET", "/v1/diagnostics/node", header.replace("to=b", "to=c"), frozenset({"c"})) \
        is Refusal.forged, "the target is signed"
    assert receiver.verify("GET", "/v1/diagnostics/node", "0" * 64, accepts) is Refusal.malformed
    assert not isinstance(receiver.verify("GET", "/v1/diagnostics/node", header, accepts), Refusal)
    assert receiver.verify("GET", "/v1/diagnostics/node", header, accepts) is Refusal.replayed
    other_key = InternalAuth(b"x" * 32, "b", clock)
    assert other_key.verify("GET", "/x", sender.sign("GET", "/x", b"", "b"), accepts) is Refusal.forged


def test_the_time_window_and_the_nonce_book() -> None:
    clock = Clock()
    sender, receiver = InternalAuth(KEY, "a", clock), InternalAuth(KEY, "b", clock)
    old = sender.sign("GET", "/v1/traces", b"", "b")
    clock.now += MAX_SKEW_S + 1
    assert receiver.verify("GET", "/v1/traces", old, frozenset({"b"})) is Refusal.stale
    fresh = sender.sign("GET", "/v1/traces", b"", "b")
    assert not isinstance(receiver.verify("GET", "/v1/traces", fresh, frozenset({"b"})), Refusal)
    clock.now += MAX_SKEW_S / 2
    assert receiver.verify("GET", "/v1/traces", fresh, frozenset({"b"})) is Refusal.replayed, "kept in window"


def test_the_proof_names_the_node_that_answered() -> None:
    a, b = InternalAuth(KEY, "a"), InternalAuth(KEY, "b")
    assert a.proves("n" * 32, "b", b.proof("n" * 32))
    assert not a.proves("n" * 32, "c", b.proof("n" * 32)), "a proof for b is not c's"
    assert not a.proves("m" * 32, "b", b.proof("n" * 32)), "a proof is for one nonce"
    assert not InternalAuth(b"x" * 32, "a").proves("n" * 32, "b", b.proof("n" * 32))


def test_internal_routes_are_only_what_nodes_call() -> None:
    for method, path in (("GET", "/node/probe"), ("GET", "/node/link_probe"), ("GET", "/v1/diagnostics/node"),
                         ("GET", "/v1/traces/abc"), ("POST", "/store/purge-staging/local"),
                         ("POST", "/store/models/org/m/download"), ("GET", "/store/models/org/m/download/status")):
        assert is_internal_route(method, path), path
    for method, path in (("POST", "/place_instance"), ("DELETE", "/instance/abc"), ("PUT", "/v1/tracing"),
                         ("GET", "/config"), ("PUT", "/config"), ("GET", "/state"), ("POST", "/v1/chat/completions"),
                         ("POST", "/admin/restart"), ("POST", "/store/purge-staging"), ("GET", "/v1/diagnostics")):
        assert not is_internal_route(method, path), path


@pytest.fixture
def node() -> Iterator[TestClient]:
    """An in-process app with an admin key and cluster key, as node "me"."""
    internal_auth.configure("cluster-key", [], "me")
    app = FastAPI()
    install_error_handlers(app)
    install_security(app, Settings(admin_keys=["a"], cluster_key="cluster-key", max_body_bytes=4096))

    @app.get("/v1/diagnostics/node")
    async def diag() -> dict[str, str]:
        return {"ok": "diag"}

    @app.post("/store/purge-staging/local")
    async def purge(request: Request) -> dict[str, Any]:
        return {"body": (await request.body()).decode()}

    @app.post("/place_instance")
    async def place() -> dict[str, str]:
        return {"placed": "yes"}

    try:
        with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
            yield client
    finally:
        internal_auth.configure(None, [])


def _signed(client: TestClient, method: str, path: str, target: str = "me", **kw: Any) -> Any:
    """Starlette's test client is httpx2's: it takes the signer as a plain function auth."""
    sign: Any = internal_auth.signer(target)
    return client.request(method, path, auth=sign, **kw)


def test_the_api_admits_signed_calls_once_on_internal_routes(node: TestClient) -> None:
    ok = _signed(node, "GET", "/v1/diagnostics/node")
    assert ok.status_code == 200 and internal_auth.answered_by(ok, "me")
    assert not internal_auth.answered_by(ok, "someone-else")
    replay = node.get("/v1/diagnostics/node", headers={internal_auth.HEADER: ok.request.headers[internal_auth.HEADER]})
    assert replay.status_code == 401 and replay.json()["error"]["code"] == "invalid_internal_token"
    assert "replayed" in replay.json()["error"]["message"]
    assert _signed(node, "GET", "/v1/diagnostics/node", target="other").status_code == 401
    placed = _signed(node, "POST", "/place_instance", json={})
    assert placed.status_code == 403 and placed.json()["error"]["code"] == "internal_route_forbidden"
    assert node.post("/place_instance", headers={"Authorization": "Bearer a"}).status_code == 200


def test_the_body_is_bound_to_the_signature(node: TestClient) -> None:
    good = _signed(node, "POST", "/store/purge-staging/local", content=b'{"modelId": "x"}')
    assert good.status_code == 200 and good.json() == {"body": '{"modelId": "x"}'}
    auth = internal_auth.current()
    assert auth is not None
    header = auth.sign("POST", "/store/purge-staging/local", b'{"modelId": "x"}', "me")
    altered = node.post("/store/purge-staging/local", content=b'{"modelId": "*"}',
                        headers={internal_auth.HEADER: header})
    assert altered.status_code == 401 and "body" in altered.json()["error"]["message"]


def test_keyless_node_id_floods_get_a_cheap_429(node: TestClient) -> None:
    codes = [node.get("/node_id").status_code for _ in range(200)]
    assert codes.count(429) > 100 and codes[0] != 429
