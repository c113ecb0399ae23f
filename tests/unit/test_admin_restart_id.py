"""POST /admin/restart?node_id= with an empty id is a typed 400, not a restart of this node (issue 27)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from skulk.api.admin import admin_router
from skulk.api.errors import install_error_handlers
from skulk.types.state import State

from .factories import api_services


def test_an_empty_node_id_is_refused_and_nothing_restarts() -> None:
    node = api_services(State(), node_id="me", master="me")
    gate = node.restart
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(node))
    client = TestClient(app)
    for query in ("?node_id=", "?node_id=%20"):
        reply = client.post("/admin/restart" + query)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "invalid_node_id"
    assert not gate.pending
