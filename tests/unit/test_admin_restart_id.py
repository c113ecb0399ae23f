"""POST /admin/restart?node_id= with an empty id is a typed 400, not a restart of this node (issue 27)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from skulk.api.admin import admin_router
from skulk.api.errors import install_error_handlers
from skulk.restart import RestartGate
from skulk.types.state import State


def test_an_empty_node_id_is_refused_and_nothing_restarts() -> None:
    gate = RestartGate()
    node = SimpleNamespace(node_id="me", state=State(), restart=gate)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(node))  # pyright: ignore[reportArgumentType]
    client = TestClient(app)
    for query in ("?node_id=", "?node_id=%20"):
        reply = client.post("/admin/restart" + query)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "invalid_node_id"
    assert not gate.pending
