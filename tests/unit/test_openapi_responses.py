"""Every route declares what it answers: a success body, the error statuses in its API family's error shape, and
streamed content where it streams; and what the routes really send matches what they declare."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skulk.api.app import create_app
from skulk.api.openapi import COMMON_ERRORS
from skulk.types.errors import HTTP_STATUS, VALIDATION_STATUS

from .factories import api_services, instance

pytestmark = pytest.mark.timeout(60)

STREAMED = {"/v1/chat/completions": "text/event-stream", "/v1/completions": "text/event-stream",
            "/v1/responses": "text/event-stream", "/v1/messages": "text/event-stream",
            "/ollama/api/chat": "application/x-ndjson", "/ollama/api/generate": "application/x-ndjson"}
KNOWN_STATUSES = set(HTTP_STATUS.values()) | {VALIDATION_STATUS}
LEFT_OUT_OF_CALLS = {("POST", "/admin/restart"), ("PUT", "/config"), ("POST", "/store/models/{model_id}/download")}
"""Called by the wire check below with an empty body, except these: one restarts the node, one rewrites its
skulk.yaml, one reaches for the model hub."""


def _app() -> FastAPI:
    return create_app(api_services())


def _family_error(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "ClaudeErrorBody"
    return "OllamaErrorBody" if path.startswith("/ollama/") else "OpenAIErrorBody"


def _operations(app: FastAPI) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in app.openapi()["paths"].items() for method, op in ops.items()]


def _generic(schema: dict[str, Any], doc: dict[str, Any]) -> bool:
    """An object schema that names no key: `dict[str, Any]`, whether inline or behind a $ref."""
    if "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema.get("type") == "object" and not schema.get("properties")


def test_every_route_declares_a_success_model() -> None:
    app = _app()
    doc = app.openapi()
    assert len(_operations(app)) >= 60  # the dashboard's routes are out of the schema; everything else is in
    missing = []
    for method, path, op in _operations(app):
        ok = [op["responses"][s] for s in op["responses"] if s.startswith("2")]
        schema = ok[0].get("content", {}).get("application/json", {}).get("schema", {}) if len(ok) == 1 else {}
        generic = _generic(schema, doc)
        if not schema or generic:
            missing.append(f"{method} {path}: {ok}")
    assert missing == [], "routes without a declared success model:\n" + "\n".join(missing)


def test_streaming_routes_declare_their_stream() -> None:
    paths = _app().openapi()["paths"]
    for path, media in STREAMED.items():
        assert media in paths[path]["post"]["responses"]["200"]["content"], path


def test_every_route_declares_its_errors_in_its_family_shape() -> None:
    wrong = []
    for method, path, op in _operations(_app()):
        statuses = {int(s) for s in op["responses"] if not s.startswith("2")}
        if not set(COMMON_ERRORS) <= statuses:
            wrong.append(f"{method} {path}: lacks {sorted(set(COMMON_ERRORS) - statuses)}")
        if not statuses <= KNOWN_STATUSES:
            wrong.append(f"{method} {path}: {sorted(statuses - KNOWN_STATUSES)} is no ErrorCode's status")
        for status in statuses:
            ref = op["responses"][str(status)]["content"]["application/json"]["schema"].get("$ref", "")
            model = ref.rsplit("/", 1)[-1]
            expected = "OpenAIErrorBody" if status in COMMON_ERRORS else _family_error(path)
            if status == 500 and model == _family_error(path):  # a failed task in the family's shape
                continue
            if model != expected and not (path == "/admin/restart" and status == 409):
                wrong.append(f"{method} {path} {status}: {model or 'no model'}, expected {expected}")
    assert wrong == [], "\n".join(wrong)


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """The OpenAPI 3.1 schema is JSON Schema 2020-12; its `#/components/...` refs resolve against `doc`."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def test_what_routes_send_matches_what_they_declare() -> None:
    """Each route called in-process (an empty body, `x` for path parameters): the status it answers is declared
    and the body validates against the schema declared for that status."""
    app = create_app(api_services(state=_state_with_instance()))
    doc = app.openapi()
    client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    problems = []
    for method, path, op in _operations(app):
        if (method, path) in LEFT_OUT_OF_CALLS:
            continue
        url = path.replace("{model_id}", "org/x")
        for param in op.get("parameters", []):
            url = url.replace("{" + param["name"] + "}", "inst" if param["name"] == "instance_id" else "x")
        response = client.request(method, url, json={} if method in ("POST", "PUT") else None)
        declared = op["responses"].get(str(response.status_code))
        if declared is None:
            problems.append(f"{method} {url}: {response.status_code} is not declared")
            continue
        schema = declared.get("content", {}).get("application/json", {}).get("schema")
        if schema is not None and response.headers.get("content-type", "").startswith("application/json"):
            errors = [e.message for e in _validator(doc, schema).iter_errors(response.json())]
            if errors:
                problems.append(f"{method} {url} {response.status_code}: {errors[:3]}")
    assert len(problems) == 0, "\n".join(problems)


def test_405_carries_allow() -> None:
    client = TestClient(_app(), base_url="http://127.0.0.1")
    for method, path in (("DELETE", "/state"), ("GET", "/place_instance"), ("PATCH", "/v1/chat/completions")):
        response = client.request(method, path)
        assert response.status_code == 405
        assert response.headers["allow"], path
        assert response.json()["error"]["type"] == "invalid_request_error"


def _state_with_instance() -> Any:
    from skulk.types.state import State

    inst = instance("inst", ("n1",))
    return State(instances={inst.instance_id: inst})
