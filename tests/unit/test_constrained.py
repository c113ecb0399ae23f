"""Constrained decoding on the real default model at temperature 1: twenty JSON schemas each yield JSON valid
against them; a forced tool call on a template without a tools section is a well-formed call to an offered tool
with schema-valid arguments; the tools reach the prompt (rendered into the system message) rather than vanish."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from skulk.api.tool_calls import parse_tool_calls
from skulk.engines.tool_prompt import TOOLS_HEADER
from skulk.engines.torch.engine import TorchEngine
from skulk.types.chat import ChatCompletionRequest, ChatMessage, SamplingParams
from tests.unit.smollm2 import packaged_smollm2

pytestmark = pytest.mark.timeout(600)

S: dict[str, Any] = {"type": "string", "maxLength": 24}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": S}, "required": ["ok", "note"]},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": S, "population": {
        "type": "integer", "minimum": 1}}, "required": ["name", "population"]}}, "required": ["city"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "label": S},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                                "maxItems": 2}}, "required": ["point"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"first": S, "last": S, "address": {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}},
        "required": ["first", "last", "address"]}}, "required": ["user"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
     "required": ["flags"]},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "genre": {"enum": ["drama", "comedy", "horror"]}},
     "required": ["title", "year", "genre"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "object", "properties": {"names": {"type": "array", "items": S, "maxItems": 4},
                                      "total": {"type": "integer", "minimum": 0, "maximum": 4}},
     "required": ["names", "total"], "additionalProperties": False},
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": S, "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a city", "parameters": {
    "type": "object", "properties": {"city": S}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    return TorchEngine(packaged_smollm2(tmp_path_factory), max_batch=8, max_seq=1024)


def _run(engine: TorchEngine, requests: dict[str, ChatCompletionRequest]) -> dict[str, tuple[str, str | None]]:
    """request id → (text, finish reason), every request batched together."""
    return {rid: (engine.tokenizer.decode(ids), finish) for rid, (ids, finish) in _run_ids(engine, requests).items()}


def _run_ids(engine: TorchEngine, requests: dict[str, ChatCompletionRequest]
             ) -> dict[str, tuple[list[int], str | None]]:
    """request id → (token ids, finish reason), every request batched together."""
    for rid, request in requests.items():
        engine.add_request(rid, engine.encode_chat(request.messages, request.tool_specs() or None), request.sampling())
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    finish: dict[str, str | None] = {}
    while engine.has_work():
        for tok in engine.step():
            assert tok.error is None, tok.error
            out[tok.request_id].append(tok.token_id)
            if tok.finish_reason is not None:
                finish[tok.request_id] = tok.finish_reason
    return {rid: (ids, finish.get(rid)) for rid, ids in out.items()}


def _chat(content: str, **extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": content}], "temperature": 1, "max_tokens": 300}
        | extra)


@pytest.mark.slow  # loads and samples the real model
def test_twenty_json_schemas_at_temperature_1_are_always_valid(engine: TorchEngine) -> None:
    requests = {str(i): _chat("Describe something as JSON.", seed=i, response_format={
        "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}) for i, schema in enumerate(SCHEMAS)}
    results = _run(engine, requests)
    for i, schema in enumerate(SCHEMAS):
        text, finish = results[str(i)]
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow  # loads and samples the real model
def test_json_object_is_one_json_object(engine: TorchEngine) -> None:
    """A free-form object has no end the grammar forces: at temperature 1 a 135M model may ramble inside a string
    or a number until max_tokens (which seed does moved with the prefix cache's rounding). What is guaranteed: every
    token is one the grammar allowed, and an answer that stopped is one whole object."""
    requests = {str(i): _chat("Give me a JSON object.", seed=i, response_format={"type": "json_object"})
                for i in range(6)}
    ids = _run_ids(engine, requests)
    stopped = 0
    for rid, (tokens, finish) in ids.items():
        constraint = requests[rid].sampling().constraint
        assert constraint is not None
        matcher = engine.grammars.matcher(constraint)
        assert all(matcher.advance(t) for t in tokens if t not in engine.tokenizer.eos_ids), rid
        text = engine.tokenizer.decode(tokens)
        if finish == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == "length" and text.lstrip().startswith("{"), (finish, text)
    assert stopped >= 1, "no answer closed its object"


@pytest.mark.slow  # loads and samples the real model
def test_tools_reach_a_template_without_a_tools_section(engine: TorchEngine) -> None:
    assert not engine.tokenizer.renders_tools  # SmolLM2's template ignores `tools`
    messages = [ChatMessage(role="user", content="What is the weather in Paris?")]
    with_tools = engine.tokenizer.hf.decode(engine.encode_chat(messages, [WEATHER]))
    assert TOOLS_HEADER.strip() in with_tools and "get_weather" in with_tools
    assert len(engine.encode_chat(messages, [WEATHER])) > len(engine.encode_chat(messages, None)) + 40


@pytest.mark.slow  # loads and samples the real model
def test_forced_tool_calls_are_well_formed_calls_with_valid_arguments(engine: TorchEngine) -> None:
    required = {f"r{i}": _chat("What is the weather in Paris?", seed=i, tools=[WEATHER, TIME],
                               tool_choice="required") for i in range(4)}
    named = {f"n{i}": _chat("Hello there!", seed=i, tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "function": {"name": "get_time"}}) for i in range(4)}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for rid, (text, finish) in _run(engine, {**required, **named}).items():
        assert finish == "stop", text
        content, calls = parse_tool_calls("llama", text, rid)
        assert len(calls) == 1 and content == "", text
        name = calls[0].function.name
        assert name in schemas and (rid.startswith("r") or name == "get_time")
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[name])


def test_sampling_carries_the_constraint() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[0]}}
    assert _chat("x", response_format=fmt).sampling().constraint.json_schema == SCHEMAS[0]  # type: ignore[union-attr]
    forced = _chat("x", tools=[WEATHER], tool_choice="required", response_format=fmt).sampling().constraint
    assert forced is not None and forced.kind == "tool_call" and forced.tools[0]["name"] == "get_weather"
    assert _chat("x", tools=[WEATHER], tool_choice="auto").sampling().constraint is None
    assert SamplingParams().constraint is None

