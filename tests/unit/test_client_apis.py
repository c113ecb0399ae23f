"""Pure parts of the client APIs: context admission, request stats, config diffs, the wire-shape checker and the
request conversions of the Claude, Ollama and Responses routes."""

from __future__ import annotations

import pytest

from skulk.api.claude import to_chat_request as claude_to_chat
from skulk.api.config_routes import changed_keys
from skulk.api.ollama import to_chat_request as ollama_to_chat
from skulk.api.responses import completion_to_chat
from skulk.api.responses_api import responses_to_chat
from skulk.runner.admission import context_refusal
from skulk.runner.stats import RequestClock
from skulk.testing.wire_shape import shape_mismatches
from skulk.types.chat import SamplingParams
from skulk.types.claude import ClaudeRequest
from skulk.types.ollama import OllamaChatRequest, OllamaGenerateRequest
from skulk.types.responses import CompletionRequest, ResponsesRequest


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "explicit", "refused"),
    [(10, 90, True, False), (10, 91, True, True), (100, 1, False, True), (10, 1_000_000, False, False),
     (99, 1, True, False), (99, 2, True, True)],
)
def test_context_admission(prompt: int, max_tokens: int, explicit: bool, refused: bool) -> None:
    """Context 100: an explicit max_tokens must fit after the prompt; an implicit one is cut at the end."""
    message = context_refusal(prompt, SamplingParams(max_tokens=max_tokens, max_tokens_explicit=explicit), 100)
    assert (message is not None) == refused
    if message is not None and explicit:
        assert f"at most {100 - prompt}" in message


def test_request_clock_counts_steps_and_rates() -> None:
    clock = RequestClock(in_flight=2, now=0.0)
    for now in (0.5, 0.5, 1.0, 1.5):  # the prefill step yields two tokens
        clock.on_token(now)
    stats = clock.stats(prompt_tokens=50, generated=4)
    assert stats.serving_batches == 3 and stats.in_flight_at_admission == 2
    assert stats.generation.prompt_tps == pytest.approx(100.0)
    assert stats.generation.generation_tps == pytest.approx(3.0)
    assert stats.generation.peak_memory_usage.in_bytes > 0


def test_changed_keys_are_dotted() -> None:
    old = {"tracing": {"retention_days": 2}, "cluster": "a"}
    assert changed_keys(old, old) == []
    assert changed_keys(old, {"tracing": {"retention_days": 3}}) == ["cluster", "tracing.retention_days"]


def test_wire_shape_checker() -> None:
    recorded = {"a": 1, "m": {"<any>": {"x": "s"}}, "o": "<number|null>", "l": [{"k": True}], "e": {"<extra_ok>": 1}}
    assert shape_mismatches(recorded, {"a": 2.5, "m": {"n1": {"x": "t"}}, "o": None, "l": [], "e": {"z": 1}}) == []
    problems = shape_mismatches(recorded, {"a": "1", "m": {"n1": {}}, "o": "x", "l": [{"k": 1}], "e": {}, "z": 0})
    assert [p.split(": ", 1) for p in problems] == [
        ["$.z", "not in the recorded shape"], ["$.a", "expected number, got string ('1')"], ["$.m.n1.x", "missing"],
        ["$.o", "expected <number|null>, got string ('x')"], ["$.l[0].k", "expected boolean, got number (1)"],
    ]
    # an extra key is tolerated only where the recording says so (<extra_ok>), never below it
    assert shape_mismatches({"e": {"y": 1}}, {"e": {"y": 1, "z": 1}}) == ["$.e.z: not in the recorded shape"]
    assert shape_mismatches({"e": {"y": {"q": 1}}}, {"e": {"y": {"q": 1, "r": 2}}}, extra_ok=True) == [
        "$.e.y.r: not in the recorded shape"]


def test_claude_request_to_chat() -> None:
    body = ClaudeRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}], "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]},
        ],
    })
    chat = claude_to_chat(body)
    roles = [("system", "sys"), ("user", "ab"), ("assistant", ""), ("tool", "42")]
    assert [(m.role, m.text) for m in chat.messages] == roles
    (call,) = chat.messages[2].tool_calls or []
    assert (call.id, call.function.name, call.function.arguments) == ("t1", "f", '{"x": 1}')
    assert chat.messages[3].tool_call_id == "t1"
    sampling = chat.sampling()
    assert sampling.max_tokens == 5 and sampling.max_tokens_explicit and sampling.stop == ["END"]


def test_ollama_and_openai_text_requests_to_chat() -> None:
    chat = ollama_to_chat(OllamaChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3, "stop": "x"}}
    ), stream=True)
    assert chat.sampling().max_tokens == 3 and chat.sampling().stop == ["x"] and chat.stream
    generate = ollama_to_chat(OllamaGenerateRequest(model="m", prompt="p", system="s"), stream=False)
    assert [m.role for m in generate.messages] == ["system", "user"] and not generate.sampling().max_tokens_explicit
    legacy = completion_to_chat(CompletionRequest(model="m", prompt=["once"]))
    assert legacy.messages[0].text == "once" and legacy.sampling().max_tokens == 16
    parts = [{"type": "input_text", "text": "q"}]
    responses = responses_to_chat(ResponsesRequest.model_validate(
        {"model": "m", "instructions": "be", "input": [{"role": "user", "content": parts}]}
    ))
    assert [(m.role, m.text) for m in responses.messages] == [("system", "be"), ("user", "q")]


def test_ollama_and_responses_reasoning_budgets_reach_the_sampler() -> None:
    """Ollama's `options.reasoning_budget` and Responses' `reasoning.max_tokens` are the engine's reasoning cap
    (SamplingParams.reasoning_budget), as chat's `reasoning_budget` and Claude's `budget_tokens` are."""
    ask = [{"role": "user", "content": "hi"}]
    chat = ollama_to_chat(OllamaChatRequest.model_validate(
        {"model": "m", "messages": ask, "think": True, "options": {"reasoning_budget": 30, "num_predict": 90}}
    ), stream=False)
    assert chat.sampling().reasoning_budget == 30 and chat.sampling().max_tokens == 90 and chat.enable_thinking
    generate = ollama_to_chat(OllamaGenerateRequest.model_validate(
        {"model": "m", "prompt": "p", "options": {"reasoning_budget": 7}}), stream=True)
    assert generate.sampling().reasoning_budget == 7
    assert ollama_to_chat(OllamaGenerateRequest(model="m", prompt="p"), stream=True).sampling().reasoning_budget is None
    responses = responses_to_chat(ResponsesRequest.model_validate(
        {"model": "m", "input": "q", "reasoning": {"effort": "high", "max_tokens": 40}}))
    assert responses.sampling().reasoning_budget == 40 and responses.reasoning_effort == "high"
    plain = responses_to_chat(ResponsesRequest.model_validate({"model": "m", "input": "q", "reasoning": {}}))
    assert plain.sampling().reasoning_budget is None


def test_a_long_response_outlives_the_body_stall_deadline() -> None:
    """The body-stall deadline covers reading the body, not the wait for a disconnect that a streaming response
    (and a non-streaming request's disconnect watcher) keeps open while it works."""
    import asyncio

    from starlette.types import Message, Receive, Scope, Send

    from skulk.api.limits import BodyLimitMiddleware

    async def slow_app(scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["type"] == "http.request"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:  # what StreamingResponse and unless_disconnected do: wait for a disconnect while working
            await asyncio.wait_for(receive(), 0.3)  # longer than the stall deadline below
        except TimeoutError:
            pass  # the client is still there
        await send({"type": "http.response.body", "body": b"done"})

    async def run() -> list[Message]:
        sent: list[Message] = []
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        app = BodyLimitMiddleware(slow_app, max_bytes=1024, stall_timeout_s=0.1)
        await app({"type": "http", "headers": []}, receive, send)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["status"] == 200 and sent[-1]["body"] == b"done"


QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("family", "text", "content", "names"),
    [
        ("qwen2", QWEN_CALL, "", ["get_weather"]),
        ("qwen2", "Let me look. " + QWEN_CALL + QWEN_CALL, "Let me look.", ["get_weather", "get_weather"]),
        ("qwen2", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("llama", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", ["get_weather"]),
        ("llama", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', "", ["a", "b"]),
        ("llama", '{"answer": 42}', '{"answer": 42}', []),
        ("qwen2", '{"name": "get_weather", "parameters": {}}', '{"name": "get_weather", "parameters": {}}', []),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", ["get_weather"]),
        ("mistral", ' [{"name": "a", "arguments": {}, "id": "abcdefghi"}, {"name": "b"}]', "", ["a", "b"]),
        ("mistral", "[1, 2]", "[1, 2]", []),
        ("mistral", "[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
        ("mistral", '{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}', []),
    ],
)
def test_tool_calls_are_parsed_per_family(family: str, text: str, content: str, names: list[str]) -> None:
    import json

    from skulk.api.tool_calls import parse_tool_calls

    left, calls = parse_tool_calls(family, text, "x")
    assert left == content and [c.function.name for c in calls] == names
    if names:
        assert isinstance(json.loads(calls[0].function.arguments), dict) and calls[0].id == "call_x_0"


@pytest.mark.parametrize(
    ("family", "pieces", "streamed", "names"),
    [
        ("qwen2", ["<tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"], "", ["f"]),
        ("qwen2", ["Hello", " there <to", "ol_call>{\"name\": \"f\"}</tool_call>"], "Hello there ", ["f"]),
        ("qwen2", ["Hi <", "b>bold</b>"], "Hi <b>bold</b>", []),
        ("llama", ["{\"name\": ", "\"f\", \"parameters\": {}}"], "", ["f"]),
        ("llama", ["Sure", ", {x}"], "Sure, {x}", []),
        ("mistral", ["[TOOL", "_CALLS] [{\"name\": \"f\", ", "\"arguments\": {}}]"], "", ["f"]),
        ("mistral", [" [{\"name\": \"f\"}", "]"], "", ["f"]),
        ("mistral", ["See ", "[the docs](x)"], "See [the docs](x)", []),
    ],
)
def test_tool_call_stream_holds_back_only_what_may_be_a_call(
    family: str, pieces: list[str], streamed: str, names: list[str]
) -> None:
    from skulk.api.tool_calls import ToolCallStream

    stream = ToolCallStream(family)
    out = "".join(stream.push(p) for p in pieces)
    tail, calls = stream.finish("x")
    assert out + ("" if calls else tail) == streamed  # a call's text never streams as content
    assert [c.function.name for c in calls] == names
