"""The Responses API (POST /v1/responses): one response object, JSON or its typed SSE events, with function tools.

Function tools go to the chat template like chat's; the reply is parsed per model family, and each call becomes a
`function_call` output item (streamed as output_item.added, function_call_arguments.delta/.done and
output_item.done after any message item, which closes first), each as soon as its text has closed.
`function_call` and `function_call_output` input items go back into the template as the assistant's tool calls
and tool messages. Without tools the text streams as it comes; with tools it is held only while it could still be
a call (api/tool_calls.py). A thinking model's reasoning is a `reasoning` output item before the message (its text
in `content` as `reasoning_text`, streamed as response.reasoning_text.delta/.done), and its tokens are counted in
output_tokens_details.reasoning_tokens."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from skulk.api import sse
from skulk.api.chat_options import (
    check_supported,
    forced_tool,
    prepared,
    tool_family,
    unmet_tool_choice,
)
from skulk.api.chat_session import ChatSession, start_chat
from skulk.api.generation import Finished, GenerationFailed, Piece, collect, piece_batches
from skulk.api.response_peers import ClusterResponses
from skulk.api.security import CURRENT
from skulk.api.services import ApiServices
from skulk.api.tool_calls import ToolCallStream, ToolSpec, parse_tool_calls
from skulk.types.chat import ChatCompletionRequest, ChatMessage, Tool, ToolCall
from skulk.types.chunks import TokenLogprob
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.responses import FunctionTool, ResponsesRequest


def function_tools(body: ResponsesRequest) -> list[Tool] | None:
    """The request's tools in chat's shape; a 400 for any tool type but function (none is served here)."""
    tools: list[Tool] = []
    for i, spec in enumerate(body.tools or []):
        if spec.get("type") != "function":
            raise ApiError(ErrorCode.invalid_request,
                           f"tools[{i}]: only function tools are served here, not {spec.get('type')!r}")
        tools.append(FunctionTool.model_validate(spec).to_chat())
    return tools or None


def responses_to_chat(body: ResponsesRequest, history: list[ChatMessage] | None = None) -> ChatCompletionRequest:
    """The chat request: instructions, the earlier turns of `previous_response_id` (`history`), the input."""
    if (why := body.unsupported()) is not None:
        raise ApiError(ErrorCode.unsupported_field, why)
    request = ChatCompletionRequest(
        model=body.model, messages=body.chat_messages(history), max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, tools=function_tools(body),
        tool_choice=body.chat_tool_choice(), logprobs=body.wants_logprobs(),
        top_logprobs=(body.top_logprobs or 0) if body.wants_logprobs() else None,
        response_format=body.text.format.to_chat() if body.text is not None else None,
        reasoning_effort=body.reasoning_effort(), reasoning_budget=body.reasoning_budget(),
    )
    check_supported(request)
    return prepared(request)


def _part(text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
    """An output_text content part; logprobs are OpenAI's per-token entries (empty unless asked for)."""
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": [e.model_dump(mode="json") for e in logprobs or []]}


class ResponseBuilder:
    """One response object as it grows: ids, output items, status and usage."""

    def __init__(self, session: ChatSession, body: ResponsesRequest, family: ToolSpec | None, forced: str | None,
                 history: list[ChatMessage] | None = None) -> None:
        self.id = f"resp_{session.command_id}"
        self.history = history or []
        self.owner = CURRENT.get().key_id  # the request's key, read before any streaming
        self.command_id = session.command_id
        self.item_id = f"msg_{session.command_id}"
        self.reasoning_id = f"rs_{session.command_id}"
        self.first = 0
        """The message's output index: 1 once a reasoning item went before it."""
        self.reasoning_closed = False
        self.body, self.family, self.forced = body, family, forced
        self.created = int(time.time())
        self.seq = 0

    def message(self, text: str | None, status: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        content = [] if text is None else [_part(text, logprobs)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def call(self, index: int, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{self.command_id}_{index}", "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments if arguments is None else arguments, "status": status}

    def items(self, text: str, calls: list[ToolCall], logprobs: list[TokenLogprob] | None = None,
              status: str = "completed", reasoning: str = "", late: str = "") -> list[dict[str, Any]]:
        """The finished output: the reasoning (when the model reasoned), the message (left out when the reply is
        only calls, or only reasoning), then one item per call, then `late` text (a malformed call's, after calls
        that were streamed) as a message of its own. The message is `incomplete` when the response is (cut by
        max_output_tokens)."""
        thought = [self.reasoning(reasoning, "completed" if text or calls else status)] if reasoning else []
        message = [self.message(text, status, logprobs)] if text or not (calls or thought) else []
        after = [{**self.message(late, status), "id": self.late_id}] if late else []
        return [*thought, *message, *(self.call(i, c, "completed") for i, c in enumerate(calls)), *after]

    @property
    def late_id(self) -> str:
        return f"{self.item_id}_late"

    def late_message(self, text: str, output_index: int) -> list[str]:
        """The events of the message item that carries text after streamed calls (all of it at once)."""
        where = {"item_id": self.late_id, "output_index": output_index, "content_index": 0}
        return [self.event("response.output_item.added", output_index=output_index,
                           item={**self.message(None, "in_progress"), "id": self.late_id}),
                self.event("response.content_part.added", **where, part=_part("", None)),
                self.event("response.output_text.delta", **where, delta=text, logprobs=[]),
                self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=_part(text, None)),
                self.event("response.output_item.done", output_index=output_index,
                           item={**self.message(text, "completed"), "id": self.late_id})]

    def conversation(self, text: str, calls: list[ToolCall]) -> list[ChatMessage]:
        """What a later previous_response_id continues: the earlier turns, this input and this output."""
        reply = ChatMessage(role="assistant", content=text, tool_calls=calls or None)
        return [*self.history, *self.body.input_messages(), reply]

    def keep(self, store: ClusterResponses, response: dict[str, Any], text: str, calls: list[ToolCall]) -> None:
        if self.body.store:
            store.local.put(self.id, json.dumps(response), self.conversation(text, calls), self.owner)

    def obj(self, status: str, done: Finished | None = None, items: list[dict[str, Any]] | None = None
            ) -> dict[str, Any]:
        usage = None
        if done is not None:
            usage = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                     "total_tokens": done.prompt_tokens + done.completion_tokens,
                     "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens}}
        incomplete = {"reason": "max_output_tokens"} if done is not None and done.finish_reason == "length" else None
        b = self.body
        choice = b.tool_choice.model_dump() if b.tool_choice is not None and not isinstance(b.tool_choice, str) \
            else b.tool_choice or "auto"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": b.model,
                "status": "incomplete" if incomplete else status, "incomplete_details": incomplete, "error": None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "tools": b.tools or [], "tool_choice": choice,
                "parallel_tool_calls": True, "output": items or [], "usage": usage,
                "text": {"format": b.text.format.echo() if b.text is not None else {"type": "text"}},
                "previous_response_id": b.previous_response_id, "store": b.store, "metadata": b.metadata or {}}

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse.frame(json.dumps({"type": kind, "sequence_number": self.seq, **fields}), event=kind)

    # ---- streaming: the events of one message item and of one function call item

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.first, "content_index": 0}

    def open_message(self) -> list[str]:
        return [self.event("response.output_item.added", output_index=self.first,
                           item=self.message(None, "in_progress")),
                self.event("response.content_part.added", **self.where(), part=_part("", None))]

    def close_message(self, text: str, logprobs: list[TokenLogprob], status: str) -> list[str]:
        part = _part(text, logprobs)
        return [self.event("response.output_text.done", **self.where(), text=text, logprobs=part["logprobs"]),
                self.event("response.content_part.done", **self.where(), part=part),
                self.event("response.output_item.done", output_index=self.first,
                           item=self.message(text, status, logprobs))]

    def reasoning_delta(self, text: str) -> list[str]:
        """A piece of reasoning, the reasoning item opened before its first."""
        head = [] if self.first else [self.event("response.output_item.added", output_index=0,
                                                 item={**self.reasoning("", "in_progress"), "content": []})]
        self.first = 1
        return [*head, self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                  content_index=0, delta=text)]

    def close_reasoning(self, text: str, status: str) -> list[str]:
        """The reasoning item's last events, once (nothing when there was no reasoning)."""
        if not self.first or self.reasoning_closed:
            return []
        self.reasoning_closed = True
        return [self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0,
                           content_index=0, text=text),
                self.event("response.output_item.done", output_index=0, item=self.reasoning(text, status))]

    def delta(self, text: str, logprobs: list[TokenLogprob]) -> str:
        return self.event("response.output_text.delta", **self.where(), delta=text,
                          logprobs=[e.model_dump(mode="json") for e in logprobs])

    def call_events(self, output_index: int, index: int, call: ToolCall) -> list[str]:
        item_id, args = f"fc_{self.command_id}_{index}", call.function.arguments
        where = {"item_id": item_id, "output_index": output_index}
        return [self.event("response.output_item.added", output_index=output_index,
                           item=self.call(index, call, "in_progress", "")),
                self.event("response.function_call_arguments.delta", **where, delta=args),
                self.event("response.function_call_arguments.done", **where, arguments=args),
                self.event("response.output_item.done", output_index=output_index,
                           item=self.call(index, call, "completed"))]


def _status(done: Finished) -> str:
    return "incomplete" if done.finish_reason == "length" else "completed"


class _Sent:
    """What one streamed response has sent: the message's text and logprobs, the reasoning, the calls. The message
    item closes at the first call (no text follows a call but a malformed call's, which gets an item of its own)."""

    def __init__(self, r: ResponseBuilder) -> None:
        self.r = r
        self.opened = self.closed = False
        self.parts: list[str] = []
        self.thoughts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.sent = 0
        self.calls: list[ToolCall] = []

    def open_message(self) -> list[str]:
        """The message item, opened at its first text (after the reasoning item, closed first)."""
        events = [] if self.opened else [*self.r.close_reasoning("".join(self.thoughts), "completed"),
                                         *self.r.open_message()]
        self.opened = True
        return events

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = self.open_message()
        self.parts.append(text)
        events.append(self.r.delta(text, self.logprobs[self.sent:]))
        self.sent = len(self.logprobs)
        return events

    def close_message(self, status: str) -> list[str]:
        if self.closed:
            return []
        self.closed = True
        return [*self.open_message(), *self.r.close_message("".join(self.parts), self.logprobs, status)]

    def tools(self, calls: list[ToolCall]) -> list[str]:
        """A whole function_call item per call, after the reasoning and the message items."""
        if not calls:
            return []
        events = self.r.close_reasoning("".join(self.thoughts), "completed")
        events += self.close_message("completed") if self.opened else []
        for call in calls:
            events += self.r.call_events(self.r.first + int(self.opened) + len(self.calls), len(self.calls), call)
            self.calls.append(call)
        return events


async def response_events(session: ChatSession, r: ResponseBuilder, store: ClusterResponses
                          ) -> AsyncIterator[str]:
    """The response's typed events. The events of the pieces waiting together go out in one write
    (api/generation.py's `piece_batches`), as do the two opening and the closing events: the same bytes, in the
    same order, as one event per write."""
    yield r.event("response.created", response=r.obj("in_progress")) + r.event(
        "response.in_progress", response=r.obj("in_progress"))
    held = ToolCallStream(r.family, hold_all=r.forced is not None) if r.family is not None else None
    out = _Sent(r)
    done = Finished("", "stop", 0, 0, None, time.monotonic())
    try:
        async for batch in piece_batches(session):
            events: list[str] = []
            for piece in batch:
                events += _piece_events(r, out, held, piece)
                chunk = piece.chunk
                if chunk.finish_reason is not None:
                    done = Finished("", chunk.finish_reason, chunk.prompt_tokens, chunk.completion_tokens,
                                    chunk.stats, done.started, reasoning_tokens=session.reasoning_tokens)
            if events:
                yield "".join(events)
    except GenerationFailed as failed:
        yield r.event("error", code=failed.chunk.code, message=failed.chunk.message, param=None)
        return
    yield "".join(_closing(r, out, held, done, store))


def _piece_events(r: ResponseBuilder, out: _Sent, held: ToolCallStream | None, piece: Piece) -> list[str]:
    """One piece's events: its reasoning delta, its text delta (with the logprobs since the last), and each call
    whose text it closed, as soon as it closed."""
    events: list[str] = []
    if piece.reasoning:
        out.thoughts.append(piece.reasoning)
        events += r.reasoning_delta(piece.reasoning)
    text = held.push(piece.text) if held is not None else piece.text
    if piece.chunk.logprobs is not None:
        out.logprobs.append(piece.chunk.logprobs)
    return [*events, *out.text(text), *out.tools(held.take(r.command_id) if held is not None else [])]


def _closing(r: ResponseBuilder, out: _Sent, held: ToolCallStream | None, done: Finished, store: ClusterResponses
             ) -> list[str]:
    """The last events once the generation ended: the held tail and calls, the items' ends, the response."""
    tail, rest = held.finish(r.command_id) if held is not None else ("", [])
    calls = [*out.calls, *rest]
    unmet = unmet_tool_choice(r.forced, calls)
    if unmet is not None:
        return [r.event("error", code=ErrorCode.tool_choice_unmet.value, message=unmet, param=None)]
    late = tail if out.calls else ""  # a malformed call's text after calls that went out
    events = out.text(tail) if not late else []
    text, reasoning = "".join(out.parts), "".join(out.thoughts)
    status = _status(done)
    events += r.close_reasoning(reasoning, "completed" if text or calls else status)
    if out.opened or not (calls or reasoning):
        events += out.close_message(status)
    events += out.tools(rest)
    events += r.late_message(late, r.first + int(out.opened) + len(calls)) if late else []
    response = r.obj("completed", done, r.items(text, calls, out.logprobs, status, reasoning, late))
    r.keep(store, response, text + late, calls)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    return [*events, r.event(kind, response=response)]


async def _history(body: ResponsesRequest, store: ClusterResponses) -> list[ChatMessage]:
    if body.previous_response_id is None:
        return []
    return list((await store.require(body.previous_response_id, param="previous_response_id")).conversation)


async def respond(node: ApiServices, body: ResponsesRequest, store: ClusterResponses) -> dict[str, Any]:
    history = await _history(body, store)
    chat = responses_to_chat(body, history)
    session = await start_chat(node, chat)
    r = ResponseBuilder(session, body, tool_family(node, chat), forced_tool(chat), history)
    try:
        done = await collect(session)
    except GenerationFailed as failed:
        raise ApiError(failed.chunk.code, failed.chunk.message, status=max(failed.chunk.status, 500)) from failed
    text, calls = done.text, []
    if r.family is not None:
        text, calls = parse_tool_calls(r.family, done.text, session.command_id)
    unmet = unmet_tool_choice(r.forced, calls)
    if unmet is not None:
        raise ApiError(ErrorCode.tool_choice_unmet, unmet)
    response = r.obj("completed", done, r.items(text, calls, done.logprobs, _status(done), done.reasoning))
    r.keep(store, response, text, calls)
    return response


async def start_response_stream(node: ApiServices, body: ResponsesRequest, store: ClusterResponses
                                ) -> AsyncIterator[str]:
    """Starts the request (errors before the first token raise ApiError) and returns its event stream."""
    history = await _history(body, store)
    chat = responses_to_chat(body, history)
    session = await start_chat(node, chat)
    builder = ResponseBuilder(session, body, tool_family(node, chat), forced_tool(chat), history)
    return response_events(session, builder, store)
