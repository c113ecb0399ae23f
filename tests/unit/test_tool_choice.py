"""Forced tool choices, response_format validation and the Responses API's tool items, as pure decisions."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from skulk.api.chat_options import forced_tool, prepared, unmet_tool_choice
from skulk.api.errors import ApiError
from skulk.api.responses_api import responses_to_chat
from skulk.api.tool_calls import ToolCallStream
from skulk.types.chat import ChatCompletionRequest, FunctionCall, ToolCall
from skulk.types.responses import ResponsesRequest

pytestmark = pytest.mark.timeout(30)


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def _chat(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    )


def _call(name: str) -> ToolCall:
    return ToolCall(id="c", function=FunctionCall(name=name))


def test_forced_tool_decisions() -> None:
    tools = [_tool("a"), _tool("b")]
    assert forced_tool(_chat(tools=tools)) is None and forced_tool(_chat(tools=tools, tool_choice="none")) is None
    assert forced_tool(_chat(tools=tools, tool_choice="required")) == ""
    assert forced_tool(_chat(tools=tools, tool_choice={"type": "function", "function": {"name": "b"}})) == "b"
    for bad in ({"type": "function", "function": {"name": "zz"}}, {"type": "function"}, {"type": "x"}):
        with pytest.raises(ApiError) as refused:
            forced_tool(_chat(tools=tools, tool_choice=bad))
        assert refused.value.status == 400
    with pytest.raises(ApiError, match="needs tools"):
        forced_tool(_chat(tool_choice="required"))


def test_a_named_function_is_the_only_tool_offered_and_asked_for() -> None:
    request = prepared(_chat(tools=[_tool("a"), _tool("b")], tool_choice={"type": "function",
                                                                         "function": {"name": "b"}}))
    assert [t.function.name for t in request.tools or []] == ["b"]
    assert request.messages[0].role == "system" and "function b" in request.messages[0].text
    required = prepared(_chat(tools=[_tool("a"), _tool("b")], tool_choice="required"))
    assert len(required.tools or []) == 2 and "calling one of the tools" in required.messages[0].text


def test_the_instructions_join_the_conversations_own_system_message() -> None:
    own = prepared(_chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                         response_format={"type": "json_object"}))
    assert [m.role for m in own.messages] == ["system", "user"]
    assert own.messages[0].text.startswith("Respond with one valid JSON") and own.messages[0].text.endswith("Be brief.")


def test_unmet_tool_choice() -> None:
    assert unmet_tool_choice(None, []) is None and unmet_tool_choice("", [_call("a")]) is None
    assert unmet_tool_choice("b", [_call("b")]) is None
    assert "in text" in (unmet_tool_choice("", []) or "")
    assert "called a, not b" in (unmet_tool_choice("b", [_call("a")]) or "")


def test_hold_all_streams_nothing_and_parses_at_the_end() -> None:
    held = ToolCallStream("qwen", hold_all=True)
    assert held.push("plain ") == "" and held.push("text") == ""
    assert held.finish("x") == ("plain text", [])


def test_response_format_json_schema_is_validated() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ok = _chat(response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    assert '"properties":{"a":{"type":"integer"}}' in prepared(ok).messages[0].text
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5000):
        inner["items"] = inner = {}
    for bad in ({"name": "thing", "schema": {"type": "nonsense"}}, {"schema": schema},
                {"name": "has space", "schema": schema}, {"name": "t", "schema": [1]}, None,
                {"name": "t", "schema": {"$schema": 5}}, {"name": "t", "schema": {"$schema": ["x"]}},
                {"name": "t", "schema": deep}):
        with pytest.raises(ValidationError, match="json_schema"):
            _chat(response_format={"type": "json_schema", "json_schema": bad})
    with pytest.raises(ValidationError):
        _chat(response_format={"type": "xml"})


def test_responses_tools_and_call_items_become_chat() -> None:
    body = ResponsesRequest.model_validate({
        "model": "m", "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "w"},
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    })
    chat = responses_to_chat(body)
    assert [(m.role, m.text) for m in chat.messages][1:] == [
        ("user", "weather?"), ("assistant", "checking"), ("tool", "sunny")]
    assert [c.id for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert chat.messages[3].tool_call_id == "c1" and forced_tool(chat) == "w"
    with pytest.raises(ApiError, match="only function tools"):
        responses_to_chat(ResponsesRequest.model_validate(
            {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}))
