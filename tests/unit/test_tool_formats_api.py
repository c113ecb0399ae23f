"""Each family's tool-call format through the OpenAI chat route's own reply code, streamed and not: the engine's
output is replaced by a fixed sequence of chunks (a fake ChatSession), cut every few characters so tags arrive
split. Reasoning (a `<think>` block first), content and tool calls come out apart, exactly; a call's text never
streams as content."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest

from skulk.api import openai as openai_route
from skulk.api.chat_session import ChatSession
from skulk.api.tool_calls import ToolFormat
from skulk.types.chat import ChatCompletionRequest
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId
from tests.unit.test_tool_parsers import _DS_CALL, _GLM_CALL, _HARMONY_CALL, _KIMI_CALL, _QC_CALL, SCHEMAS

pytestmark = pytest.mark.timeout(30)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "zip": "75001"}}
# (parser, scripted reply, reasoning mode, reasoning, content, calls as (name, arguments))
SCRIPTS: list[tuple[str, str, str | None, str, str, list[tuple[str, Any]]]] = [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>',
     None, "", "Sure.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", "<think>\nNeed the weather.\n</think>\n\n" + _QC_CALL, "think", "Need the weather.", "",
     [("get_weather", WEATHER["arguments"])]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, "", "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, "", "",
     [("get_weather", {"city": "Paris"})]),
    ("deepseek_v31", "Checking." + _DS_CALL, None, "", "Checking.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("kimi_k2", _KIMI_CALL, None, "", "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("glm45", "<think>Look it up.</think>\nOne moment.\n" + _GLM_CALL, "think", "Look it up.", "One moment.",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True})]),
    ("harmony", _HARMONY_CALL, None, "", "", [("get_weather", {"city": "Paris"})]),
    ("kimi_k2", "Just text, no call.", None, "", "Just text, no call.", []),
    ("harmony", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + _HARMONY_CALL, "harmony",
     "Need weather.", "", [("get_weather", {"city": "Paris"})]),
    ("harmony", "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     "harmony", "Greet.", "Hi!", []),
]


class ScriptedSession:
    """What the routes read of a ChatSession, over a fixed reply cut into chunks of `step` characters."""

    def __init__(self, text: str, reasoning: str | None, step: int) -> None:
        cid = CommandId("c1")
        parts = [text[i:i + step] for i in range(0, len(text), step)]
        self.chunks_ = [TokenChunk(command_id=cid, text=p, token_id=i, completion_tokens=i + 1, prompt_tokens=5)
                        for i, p in enumerate(parts)]
        last = self.chunks_[-1]
        self.chunks_[-1] = last.model_copy(update={"finish_reason": "stop"})
        self.chunks_[0] = self.chunks_[0].model_copy(update={"reasoning": reasoning})
        self.first = self.chunks_[0]
        self.command_id = cid
        self.reasoning_tokens = 0

    async def chunks(self) -> Any:
        for c in self.chunks_:
            yield c

    def ready(self) -> bool:
        """Every chunk already waits (a stream behind its runner): the routes write each batch at once."""
        return True

    def close(self) -> None:
        pass


def _request(stream: bool) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, "stream": stream})


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


async def _streamed(session: ScriptedSession, fmt: ToolFormat) -> list[dict[str, Any]]:
    events = openai_route._stream_events(cast(ChatSession, session), _request(True), fmt)
    written = "".join([e async for e in events])  # a batch is one write of several events: split as clients do
    return [json.loads(e[6:]) for e in written.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("script", SCRIPTS, ids=[f"{s[0]}-{i}" for i, s in enumerate(SCRIPTS)])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_openai_chat_reads_each_format_streamed_and_not(script: tuple[Any, ...], step: int) -> None:
    parser, text, mode, reasoning, content, calls = script
    fmt = ToolFormat(parser, SCHEMAS)
    reply = asyncio.run(openai_route._complete(cast(ChatSession, ScriptedSession(text, mode, step)),
                                               _request(False), fmt))
    choice = json.loads(bytes(reply.body))["choices"][0]
    message = choice["message"]
    assert _calls(message.get("tool_calls") or []) == calls
    assert (message["content"] or "") == content and message.get("reasoning_content", "") == reasoning
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")

    deltas = [d["choices"][0] for d in asyncio.run(_streamed(ScriptedSession(text, mode, step), fmt)) if d["choices"]]
    streamed = [c["delta"] for c in deltas]
    assert "".join(d.get("content") or "" for d in streamed).strip() == content  # no fragment of a call
    assert "".join(d.get("reasoning_content") or "" for d in streamed) == reasoning
    assert _calls([c for d in streamed for c in d.get("tool_calls") or []]) == calls
    assert deltas[-1]["finish_reason"] == ("tool_calls" if calls else "stop")
