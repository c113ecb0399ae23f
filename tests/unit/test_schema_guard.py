"""Schemas the grammar library cannot compile (issue 38): every `$ref` shape that cannot mean what it says is a 400
naming why on every API that constrains decoding (OpenAI chat and a forced tool call, Responses' text.format,
Ollama's format on chat and generate, Claude's forced tool input schema), streamed or not, before anything is
admitted; legitimate recursion (a tree with optional children) passes; compile time and grammar size are bounded."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from skulk.api.app import create_app
from skulk.api.schema_check import CHECKER, SchemaChecker, constraint_schema
from skulk.engines.constrained import HERMES, call_schema
from skulk.engines.schema_refs import ref_problem, resolve
from skulk.types.chat import OutputConstraint
from skulk.types.ids import InstanceId
from skulk.types.state import State

from .factories import CARD, api_services, instance

pytestmark = pytest.mark.timeout(120)

NODE: dict[str, Any] = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
    "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}
TREE: dict[str, Any] = {"$defs": {"node": NODE}, "$ref": "#/$defs/node"}
LEGITIMATE: dict[str, dict[str, Any]] = {
    "tree, children an array that may be empty": TREE,
    "list, next optional": {"$defs": {"l": {"type": "object", "properties": {"next": {"$ref": "#/$defs/l"}}}},
                            "type": "object", "properties": {"head": {"$ref": "#/$defs/l"}}, "required": ["head"]},
    "root recursion with a way out": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]},
    "escaped pointer": {"$defs": {"a/b": {"type": "integer"}}, "type": "object",
                        "properties": {"x": {"$ref": "#/$defs/a~1b"}}, "required": ["x"]},
}
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "cycle a->b->a": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                      "no finite value"),
    "cycle a->b->a with content": ({"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
        "$ref": "#/$defs/a"}, "no finite value"),
    "self a->a": ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "no finite value"),
    "self, required": ({"$defs": {"a": {"type": "object", "properties": {"me": {"$ref": "#/$defs/a"}},
                                        "required": ["me"]}}, "$ref": "#/$defs/a"}, "no finite value"),
    "self, non-empty array": ({"$defs": {"a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}},
                               "$ref": "#/$defs/a"}, "no finite value"),
    "dangling": ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "points at nothing"),
    "remote": ({"type": "object", "properties": {"x": {"$ref": "http://example.com/s.json"}}}, "not a local"),
    "relative": ({"type": "object", "properties": {"x": {"$ref": "other.json#/a"}}}, "not a local"),
    "malformed pointer": ({"$defs": {"a": {}}, "type": "object", "properties": {"x": {"$ref": "#defs//a~"}}},
                          "not a local"),
    "pointer past the end": ({"$defs": {"a": {"prefixItems": [{}]}}, "type": "object", "properties": {"x": {
        "$ref": "#/$defs/a/prefixItems/7"}}},
                             "points at nothing"),
    "pointer at data": ({"$defs": {"a": {"const": 3}}, "type": "object", "properties": {"x": {
        "$ref": "#/$defs/a/const"}}}, "not a schema"),
}


def _bodies(schema: dict[str, Any], stream: bool) -> list[tuple[str, dict[str, Any]]]:
    """The same schema through every API that compiles one."""
    messages = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return [
        ("/v1/chat/completions", {"model": "test/model", "messages": messages, "stream": stream, "response_format": {
            "type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}),
        ("/v1/chat/completions", {"model": "test/model", "messages": messages, "stream": stream, "tools": [tool],
                                  "tool_choice": "required"}),
        ("/v1/responses", {"model": "test/model", "input": "x", "stream": stream, "text": {"format": {
            "type": "json_schema", "name": "t", "schema": schema}}}),
        ("/ollama/api/chat", {"model": "test/model", "messages": messages, "stream": stream, "format": schema}),
        ("/ollama/api/generate", {"model": "test/model", "prompt": "x", "stream": stream, "format": schema}),
        ("/v1/messages", {"model": "test/model", "max_tokens": 8, "messages": messages, "stream": stream,
                          "tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}}),
    ]


def _message(path: str, reply: Any) -> str:
    """The error message in the API's own shape (asserting the shape)."""
    body = reply.json()
    if path.startswith("/ollama"):
        assert isinstance(body["error"], str)
        return body["error"]
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["code"] == "invalid_request" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.fixture(scope="module")
def client() -> TestClient:
    state = State(instances={InstanceId("inst"): instance()}, model_cards={CARD.model_id: CARD})
    return TestClient(create_app(api_services(state=state)), base_url="http://127.0.0.1")


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_ref_shape_is_refused_by_the_pure_check(name: str) -> None:
    schema, says = BAD[name]
    assert says in (ref_problem(schema) or ""), name


@pytest.mark.parametrize("name", sorted(LEGITIMATE))
def test_legitimate_recursion_passes_both_checks(name: str) -> None:
    assert ref_problem(LEGITIMATE[name]) is None
    assert CHECKER.problem(LEGITIMATE[name]) is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(BAD))
def test_every_api_answers_a_bad_ref_with_its_own_400(client: TestClient, name: str, stream: bool) -> None:
    schema, says = BAD[name]
    for path, body in _bodies(schema, stream):
        reply = client.post(path, json=body)
        assert reply.status_code == 400, (path, reply.text)
        message = _message(path, reply)
        assert "cannot be compiled" in message and says in message, (path, message)


def test_a_legitimate_recursive_schema_is_admitted(client: TestClient) -> None:
    """Past the check on every API: the model is not placed, so the answer is the 404 that says so."""
    for stream in (False, True):
        for path, body in _bodies(TREE, stream):
            reply = client.post(path, json={**body, "model": "nobody/none"})
            assert reply.status_code == 404, (path, reply.text)


def test_the_grammar_librarys_own_refusals_are_400s_too() -> None:
    """A shape only xgrammar refuses reaches the helper process and comes back as its reason, without the C++
    source prefix."""
    why = CHECKER.problem({"type": "string", "pattern": "(unclosed"})
    assert why is not None and "grammar library cannot compile it" in why and ".cc:" not in why


def test_compile_time_and_grammar_size_are_bounded() -> None:
    nested: dict[str, Any] = {"type": "integer"}
    for _ in range(12):
        nested = {"anyOf": [{"type": "array", "items": nested}, {"type": "object", "properties": {"x": nested}}]}
    props = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    small = SchemaChecker(max_chars=20_000)
    try:
        assert "over the 20000" in (small.problem(props) or "")
    finally:
        small.close()
    hurried = SchemaChecker(deadline_s=0.05)
    try:
        assert "did not convert it within 0.05 s" in (hurried.problem(nested) or "")
        assert hurried.problem({"type": "integer"}) is None  # a fresh helper after the killed one
    finally:
        hurried.close()


def test_a_tools_local_refs_still_point_into_its_parameters() -> None:
    """The parameters sit under /properties/arguments in the call schema: their #/$defs/... moved with them."""
    tools = [{"name": "f", "parameters": TREE}, {"name": "g", "parameters": TREE}]
    for constraint in (OutputConstraint(kind="tool_call", tools=tools, tool_name="g"),
                       OutputConstraint(kind="tool_call", tools=tools)):
        schema = call_schema(constraint, HERMES)
        assert schema == constraint_schema(constraint)
        assert ref_problem(schema) is None and CHECKER.problem(schema) is None
    one = call_schema(OutputConstraint(kind="tool_call", tools=tools, tool_name="f"), HERMES)
    node = resolve(one, "#/properties/arguments/$defs/node")[0]
    assert node["properties"]["kids"]["items"] == {"$ref": "#/properties/arguments/$defs/node"}
