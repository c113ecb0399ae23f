"""Streamed tool calls go out one at a time, each as soon as its text closes, on all four streaming APIs (OpenAI
chat `delta.tool_calls`, Responses `function_call` items, Anthropic `tool_use` blocks, Ollama
`message.tool_calls`), in every family's format. The engine is a scripted session that counts the characters it
has handed to the route; each event is stamped with that count, so a test can tell that the first call went out
before any of the second call's text was read. Indexes and ids run on across the stream; no fragment of a call is
ever content."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from skulk.api import claude as claude_route
from skulk.api import ollama as ollama_route
from skulk.api import openai as openai_route
from skulk.api import responses_api
from skulk.api.chat_session import ChatSession
from skulk.api.tool_calls import ToolCallStream, ToolFormat, parse_tool_calls
from skulk.formats.tool_parsers.special_tokens import ds_token
from skulk.types.chat import ChatCompletionRequest
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId
from skulk.types.responses import ResponsesRequest
from tests.unit.test_tool_parsers import SCHEMAS

pytestmark = pytest.mark.timeout(30)

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"tz": "UTC"})
_DS = {k: ds_token(k.replace("_", " ")) for k in ("tool_calls_begin", "tool_call_begin", "tool_sep", "tool_call_end",
                                                   "tool_calls_end")}
_HARMONY = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"


def _qc(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


@dataclass(frozen=True)
class Script:
    """A reply of two calls: text before (content), the first call, text between, the second, text after."""

    name: str
    parser: str
    before: str
    first: str
    between: str
    second: str
    after: str = ""

    @property
    def text(self) -> str:
        return self.before + self.first + self.between + self.second + self.after

    @property
    def first_end(self) -> int:
        return len(self.before + self.first)

    @property
    def second_start(self) -> int:
        return self.first_end + len(self.between)


SCRIPTS = [
    Script("hermes", "hermes", "Let me check. ",
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>',
           "\nAnd the time:\n", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
           "\nDone."),
    Script("qwen3_coder", "qwen3_coder", "Checking.\n", _qc("get_weather", {"city": "Paris", "days": "3"}), "\n",
           _qc("get_time", {"tz": "UTC"}), "\n"),
    Script("glm45", "glm45", "One moment.\n", _glm("get_weather", {"city": "Paris", "days": "3"}), "\nthen\n",
           _glm("get_time", {"tz": "UTC"})),
    Script("llama3", "llama3", "", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
           "; ", '{"name": "get_time", "parameters": {"tz": "UTC"}}'),
    Script("mistral-list", "mistral", "",
           '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', ", ",
           '{"name": "get_time", "arguments": {"tz": "UTC"}}]'),
    Script("mistral-bare-list", "mistral", "", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
           ",\n ", '{"name": "get_time", "arguments": {"tz": "UTC"}}]'),
    Script("mistral-named", "mistral", "Checking. ", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "",
           '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}'),
    Script("deepseek_v31", "deepseek_v31", "Checking.",
           f'{_DS["tool_calls_begin"]}{_DS["tool_call_begin"]}get_weather{_DS["tool_sep"]}'
           f'{{"city": "Paris", "days": 3}}{_DS["tool_call_end"]}', "",
           f'{_DS["tool_call_begin"]}get_time{_DS["tool_sep"]}{{"tz": "UTC"}}{_DS["tool_call_end"]}',
           _DS["tool_calls_end"]),
    Script("kimi_k2", "kimi_k2", "",
           "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           '{"city": "Paris", "days": "3"}<|tool_call_end|>', "",
           '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|>',
           "<|tool_calls_section_end|>"),
    Script("harmony", "harmony", "", _HARMONY.format("get_weather", '{"city": "Paris", "days": 3}'), "",
           "<|start|>assistant" + _HARMONY.format("get_time", '{"tz": "UTC"}')),
]


class CountingSession:
    """What the routes read of a ChatSession, over a reply cut every `step` characters and where the first call
    ends; `pushed` is how many characters the route has been handed so far."""

    def __init__(self, text: str, step: int, cut: int = 0) -> None:
        cid = CommandId("c1")
        cuts = sorted({*range(0, len(text), step), cut} - {len(text)})
        parts = [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]
        self.chunks_ = [TokenChunk(command_id=cid, text=p, token_id=i, completion_tokens=i + 1, prompt_tokens=5)
                        for i, p in enumerate(parts)]
        self.chunks_[-1] = self.chunks_[-1].model_copy(update={"finish_reason": "stop"})
        self.first = self.chunks_[0]
        self.command_id = cid
        self.reasoning_tokens = 0
        self.pushed = 0

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        for c in self.chunks_:
            self.pushed += len(c.text)
            yield c

    def ready(self) -> bool:
        """Never a chunk waiting: each is read when the runner sends it, so `pushed` dates every event exactly."""
        return False

    def close(self) -> None:
        pass


@dataclass
class Seen:
    """What a client read from one stream: content, calls as (id, name, arguments, characters read by then)."""

    content: str = ""
    calls: list[tuple[str, str, Any, int]] = field(default_factory=list)
    finish: str | None = None


def _tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


async def _stamped(events: AsyncIterator[str], session: CountingSession) -> list[tuple[dict[str, Any], int]]:
    """Each event's JSON payload with the characters the session had handed out when it was yielded."""
    out = []
    async for event in events:
        for line in event.splitlines():
            if line.startswith("data: {") or line.startswith("{"):
                out.append((json.loads(line.removeprefix("data: ")), session.pushed))
    return out


async def _openai(session: CountingSession, fmt: ToolFormat) -> Seen:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": _tools(), "stream": True})
    seen = Seen()
    for payload, pushed in await _stamped(openai_route._stream_events(cast(ChatSession, session), request, fmt),
                                          session):
        for choice in payload["choices"]:
            delta = choice["delta"]
            seen.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                assert call["index"] == len(seen.calls)
                fn = call["function"]
                seen.calls.append((call["id"], fn["name"], json.loads(fn["arguments"]), pushed))
            seen.finish = choice["finish_reason"] or seen.finish
    return seen


async def _claude(session: CountingSession, fmt: ToolFormat) -> Seen:
    seen, blocks = Seen(), {}
    for payload, pushed in await _stamped(claude_route._events(cast(ChatSession, session), "m", fmt), session):
        kind = payload["type"]
        if kind == "content_block_start":
            assert payload["index"] not in blocks, "block indexes run on"
            blocks[payload["index"]] = {**payload["content_block"], "json": ""}
        elif kind == "content_block_delta":
            delta, block = payload["delta"], blocks[payload["index"]]
            seen.content += delta.get("text", "")
            block["json"] += delta.get("partial_json", "")
        elif kind == "content_block_stop" and blocks[payload["index"]]["type"] == "tool_use":
            block = blocks[payload["index"]]
            seen.calls.append((block["id"], block["name"], json.loads(block["json"]), pushed))
        elif kind == "message_delta":
            seen.finish = payload["delta"]["stop_reason"]
    return seen


async def _responses(session: CountingSession, fmt: ToolFormat) -> Seen:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()], "stream": True,
        "store": False})
    builder = responses_api.ResponseBuilder(cast(ChatSession, session), body, fmt, None)
    events = responses_api.response_events(cast(ChatSession, session), builder, cast(Any, None))
    seen, final = Seen(), {}
    for payload, pushed in await _stamped(events, session):
        kind = payload["type"]
        if kind == "response.output_text.delta":
            seen.content += payload["delta"]
        elif kind == "response.output_item.done" and payload["item"]["type"] == "function_call":
            item = payload["item"]
            assert payload["output_index"] == len(seen.calls) + int(bool(seen.content))
            seen.calls.append((item["call_id"], item["name"], json.loads(item["arguments"]), pushed))
        elif kind == "response.completed":
            final = payload["response"]
    calls = [(i["call_id"], i["name"], json.loads(i["arguments"])) for i in final["output"]
             if i["type"] == "function_call"]
    assert calls == [c[:3] for c in seen.calls], "the finished response lists the streamed calls"
    seen.finish = final["status"]
    return seen


async def _ollama(session: CountingSession, fmt: ToolFormat) -> Seen:
    events = ollama_route._ndjson(cast(ChatSession, session), "m", ollama_route._chat_shape, fmt, 0.0)
    seen = Seen()
    for payload, pushed in await _stamped(events, session):
        message = payload["message"]
        seen.content += message["content"]
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            assert fn["index"] == len(seen.calls)
            seen.calls.append((f"#{fn['index']}", fn["name"], fn["arguments"], pushed))
        if payload["done"]:
            seen.finish = payload["done_reason"]
    return seen


ROUTES = {"openai": (_openai, "call_c1_{}", "tool_calls"), "claude": (_claude, "toolu_call_c1_{}", "tool_use"),
          "responses": (_responses, "call_c1_{}", "completed"), "ollama": (_ollama, "#{}", "stop")}


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("step", [1, 4, 9])
def test_each_call_goes_out_as_it_closes(script: Script, route: str, step: int) -> None:
    read, ids, finish = ROUTES[route]
    fmt = ToolFormat(script.parser, SCHEMAS)
    content, calls = parse_tool_calls(fmt, script.text, "c1")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [WEATHER, TIME]
    session = CountingSession(script.text, step, script.first_end)
    seen = asyncio.run(read(session, fmt))
    assert [c[:3] for c in seen.calls] == [(ids.format(0), *WEATHER), (ids.format(1), *TIME)]
    assert seen.calls[0][3] <= script.second_start, "the first call went out before the second was read"
    assert seen.content.strip() == content == script.before.strip(), "no fragment of a call is content"
    assert seen.finish == finish


def test_a_malformed_call_after_a_good_one_is_content_and_the_good_one_stands() -> None:
    bad = '<tool_call>\n{"name": "get_time", "arguments": {"tz": </tool_call>'
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    script = Script("bad", "hermes", "", good, "\n", bad)
    fmt = ToolFormat("hermes", SCHEMAS)
    assert parse_tool_calls(fmt, script.text, "c1") == (script.text, [])  # not streamed: all of it is text
    for route, (read, ids, _) in ROUTES.items():
        seen = asyncio.run(read(CountingSession(script.text, 5, script.first_end), fmt))
        assert [c[:3] for c in seen.calls] == [(ids.format(0), *WEATHER)], route
        assert seen.calls[0][3] <= script.second_start, route
        assert seen.content.strip() == bad, route


def test_plain_text_and_json_content_stream_as_before() -> None:
    for parser, text in (("hermes", "Just text, no call."), ("llama3", '{"answer": 42} is the JSON.'),
                         ("mistral", "[see the docs](x)")):
        stream = ToolCallStream(ToolFormat(parser, SCHEMAS))
        out = [stream.push(text[i:i + 3]) for i in range(0, len(text), 3)]
        assert not any(stream.take("c1") for _ in range(2))
        tail, calls = stream.finish("c1")
        assert ("".join(out) + tail, calls) == (text, [])


def test_a_forced_call_is_held_whole() -> None:
    """With tool_choice forcing a tool the reply is checked whole before anything goes out (a wrong tool is an
    error, not a call already sent)."""
    stream = ToolCallStream(ToolFormat("hermes", SCHEMAS), hold_all=True)
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert stream.push(text) == "" and stream.take("c1") == []
    assert [c.function.name for c in stream.finish("c1")[1]] == ["get_time"]


def test_mistral_named_calls_need_every_call_whole() -> None:
    fmt = ToolFormat("mistral", SCHEMAS)
    assert parse_tool_calls(fmt, '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"} trailing', "c1")[1] == []
    assert parse_tool_calls(fmt, '[TOOL_CALLS]get_time[ARGS]["UTC"]', "c1")[1] == []
    content, calls = parse_tool_calls(fmt, 'Sure. [TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "c1")
    assert content == "Sure." and [(c.id, c.function.arguments) for c in calls] == [("call_c1_0", '{"tz":"UTC"}')]
