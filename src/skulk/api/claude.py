"""Anthropic Messages: POST /v1/messages (JSON or SSE events) and POST /v1/messages/count_tokens.

Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, whatever failed: the body, the
model, the context, or the generation after it started streaming (then an `error` event)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from skulk.api import sse
from skulk.api.chat_options import (
    UNMET_STATUS,
    check_supported,
    forced_tool,
    prepared,
    tool_family,
    unmet_tool_choice,
)
from skulk.api.chat_session import ChatSession, start_chat
from skulk.api.disconnect import Stream, unless_disconnected
from skulk.api.errors import claude_error, claude_error_body, text_only_error
from skulk.api.generation import GenerationFailed, collect, piece_batches
from skulk.api.images import checked_images
from skulk.api.openapi import Family, documented
from skulk.api.services import ApiServices
from skulk.api.tokens import check_context, count_chat_tokens
from skulk.api.tool_calls import ToolCallStream, ToolSpec, parse_tool_calls
from skulk.types.answers import ClaudeMessage, TokenCount
from skulk.types.chat import ChatCompletionRequest, ToolCall
from skulk.types.claude import ClaudeCountRequest, ClaudeRequest
from skulk.types.errors import ApiError, ErrorCode

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
M = TypeVar("M", bound=BaseModel)


SURROGATE_HINT = " (a \\uD800-\\uDFFF escape is half of a surrogate pair and needs its other half)"


async def parse_body(http: Request, model: type[M]) -> M:
    """The body validated into `model` straight from its bytes; a 400 that names each bad field otherwise.

    pydantic's JSON parser refuses two things Python's accepts that a node cannot use: a lone UTF-16 surrogate
    (`\\ud800`, which no UTF-8 encoder takes, so any reply echoing it failed) and nesting deep enough to exhaust
    the interpreter's recursion (a 500 before)."""
    try:
        return model.model_validate_json(await http.body())
    except ValidationError as exc:
        if (text_only := text_only_error(exc.errors())) is not None:
            raise text_only from exc
        unreadable = [e["msg"].removeprefix("Invalid JSON: ") for e in exc.errors() if e["type"] == "json_invalid"]
        if unreadable:
            hint = SURROGATE_HINT if "hex escape" in unreadable[0] or "surrogate" in unreadable[0] else ""
            raise ApiError(ErrorCode.invalid_request, f"the body is not valid JSON: {unreadable[0]}{hint}") from exc
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ApiError(ErrorCode.invalid_request, where) from exc


def _chat_tool_choice(body: ClaudeRequest) -> Literal["auto", "none", "required"] | dict[str, Any] | None:
    """Anthropic's tool_choice in chat's terms: any = required, tool = that named function."""
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "auto" or choice.type == "none":
        return choice.type
    if choice.type == "any":
        return "required"
    if not choice.name:
        raise ApiError(ErrorCode.invalid_request, 'tool_choice: {"type": "tool"} needs the tool\'s "name"')
    return {"type": "function", "function": {"name": choice.name}}


def to_chat_request(body: ClaudeRequest) -> ChatCompletionRequest:
    """The chat request; a forced tool choice (any, tool) is asked for in the prompt and checked on the reply."""
    if (why := body.unsupported()) is not None:
        raise ApiError(ErrorCode.unsupported_field, why)
    chat = ChatCompletionRequest(
        model=body.model, messages=body.chat_messages(), max_tokens=body.max_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop_sequences or None, stream=body.stream,
        tools=[t.to_openai() for t in body.tools] if body.tools else None,
        tool_choice=_chat_tool_choice(body),
        enable_thinking=body.thinking.template_switch() if body.thinking is not None else None,
        reasoning_budget=_budget(body),
    )
    check_supported(chat)
    return prepared(chat)


def tool_use_blocks(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": f"toolu_{c.id}", "name": c.function.name, "input": _input(c)} for c in calls]


def _input(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return {}


def _sse(event: str, data: dict[str, Any]) -> str:
    return sse.frame(sse.compact({"type": event, **data}), event=event)


def stop_fields(finish_reason: str | None, stop_sequence: str | None, calls: list[ToolCall]) -> dict[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for how the generation ended: a tool call is `tool_use`, one of
    the request's `stop_sequences` is `stop_sequence` naming it, the model's own end `end_turn`, the token limit
    `max_tokens`."""
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish_reason == "stop" and stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    return {"stop_reason": STOP_REASONS.get(finish_reason or "stop", "end_turn"), "stop_sequence": None}


def _message(msg_id: str, model: str, content: list[dict[str, Any]], stop: dict[str, str | None],
             usage: dict[str, int]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            **stop, "usage": usage}


def thinking_block(thinking: str) -> dict[str, Any]:
    """A thinking block; its signature is empty (Anthropic signs its own thinking; a local model's is not)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


BlockKind = Literal["thinking", "text"]
_EMPTY: dict[str, dict[str, Any]] = {"thinking": thinking_block(""), "text": {"type": "text", "text": ""}}


class _Blocks:
    """The thinking, text and tool_use blocks of a streamed message, each opened at its first piece (a tool_use
    block as its call closes): a reply that is only tool calls has no empty text block before its tool_use blocks
    (Anthropic's own streams have none)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: BlockKind | None = None

    def piece(self, kind: BlockKind, text: str) -> list[str]:
        head = [] if self.kind == kind else [*self._stop(), *self._start(kind)]
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        return [*head, _sse("content_block_delta", {"index": self.index, "delta": delta})]

    def _start(self, kind: BlockKind) -> list[str]:
        self.index, self.kind = self.index + 1, kind
        return [_sse("content_block_start", {"index": self.index, "content_block": _EMPTY[kind]})]

    def _stop(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_sse("content_block_stop", {"index": self.index})]

    def tools(self, calls: list[ToolCall]) -> list[str]:
        """A whole tool_use block per call (its input in one delta), after the open block's stop."""
        events = self._stop() if calls else []
        for tool in tool_use_blocks(calls):
            self.index += 1
            events += [_sse("content_block_start", {"index": self.index, "content_block": {**tool, "input": {}}}),
                       _sse("content_block_delta", {"index": self.index, "delta": {
                           "type": "input_json_delta", "partial_json": json.dumps(tool["input"])}}),
                       _sse("content_block_stop", {"index": self.index})]
        return events

    def close(self, calls: list[ToolCall]) -> list[str]:
        """The open block's stop, opening an empty text block first only for a reply with no block and no calls."""
        head = self._start("text") if self.index < 0 and not calls else []
        return [*head, *self._stop()]


async def _events(
    session: ChatSession, model: str, family: ToolSpec | None, forced: str | None = None
) -> AsyncIterator[str]:
    """message_start, ping, then a thinking block when the model reasons and a text block when there is text
    (each content_block_start, content_block_delta..., content_block_stop), a tool_use block per call,
    message_delta, message_stop: the order Anthropic's SDKs expect."""
    msg_id = f"msg_{session.command_id}"
    usage = {"input_tokens": session.first.prompt_tokens, "output_tokens": 0}
    yield _sse("message_start", {"message": _message(msg_id, model, [], {"stop_reason": None, "stop_sequence": None},
                                                     usage)}) + _sse("ping", {})
    finish: tuple[str | None, str | None] = (None, None)
    held = ToolCallStream(family, hold_all=forced is not None) if family is not None else None
    block = _Blocks()
    try:
        async for batch in piece_batches(session):
            out: list[str] = []  # the events of the pieces waiting together, written at once
            for piece in batch:
                chunk = piece.chunk
                out += block.piece("thinking", piece.reasoning) if piece.reasoning else []
                text = held.push(piece.text) if held is not None else piece.text
                out += block.piece("text", text) if text else []
                out += block.tools(held.take(session.command_id)) if held is not None else []  # each call once closed
                if chunk.finish_reason is not None:
                    usage["output_tokens"] = chunk.completion_tokens
                    finish = (chunk.finish_reason, chunk.stop_sequence)
            if out:
                yield "".join(out)
    except GenerationFailed as failed:
        yield _sse("error", {"error": claude_error_body(failed.chunk.status, failed.chunk.message)["error"]})
        return
    tail, rest = held.finish(session.command_id) if held is not None else ("", [])
    calls = [*held.sent, *rest] if held is not None else []
    unmet = unmet_tool_choice(forced, calls)
    if unmet is not None:
        yield _sse("error", {"error": claude_error_body(UNMET_STATUS, unmet)["error"]})
        return
    yield "".join([*(block.piece("text", tail) if tail else []), *block.close(calls), *block.tools(rest),
                   _sse("message_delta", {"delta": stop_fields(*finish, calls),
                                          "usage": {"output_tokens": usage["output_tokens"]}}),
                   _sse("message_stop", {})])


async def _complete(node: ApiServices, body: ClaudeRequest) -> JSONResponse:
    chat = to_chat_request(body)
    session = await start_chat(node, chat)
    try:
        done = await collect(session)
    except GenerationFailed as failed:
        status = failed.chunk.status if failed.chunk.status >= 500 else 500
        return JSONResponse(claude_error_body(status, failed.chunk.message), status_code=status)
    usage = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens}
    family = tool_family(node, chat)
    text, calls = parse_tool_calls(family, done.text, session.command_id) if family is not None else (done.text, [])
    unmet = unmet_tool_choice(forced_tool(chat), calls)
    if unmet is not None:
        return JSONResponse(claude_error_body(UNMET_STATUS, unmet), status_code=UNMET_STATUS)
    thinking = [thinking_block(done.reasoning)] if done.reasoning else []
    content = thinking + ([{"type": "text", "text": text}] if text or not (calls or thinking) else []) \
        + tool_use_blocks(calls)
    stop = stop_fields(done.finish_reason, done.stop_sequence, calls)
    return JSONResponse(_message(f"msg_{session.command_id}", body.model, content, stop, usage))


def _budget(body: ClaudeRequest) -> int | None:
    """The reasoning tokens `thinking.budget_tokens` allows: the engine closes the reasoning there and the answer
    follows (engines/reasoning.py's ReasoningBudget)."""
    return body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None


def claude_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["claude"])

    @router.post("/v1/messages", response_model=None,
                 responses=documented(ClaudeMessage, 400, 404, 422, 500, 503, 504, family=Family.claude, stream="sse"))
    async def messages(http: Request) -> Response:
        try:
            body = await parse_body(http, ClaudeRequest)
            if not body.stream:
                return await unless_disconnected(http, _complete(node, body))
            chat = to_chat_request(body)
            session = await start_chat(node, chat)
        except ApiError as exc:
            return claude_error(exc)
        return Stream(_events(session, body.model, tool_family(node, chat), forced_tool(chat)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.post("/v1/messages/count_tokens", response_model=None,
                 responses=documented(TokenCount, 400, 404, 422, 503, family=Family.claude))
    async def count_tokens(http: Request) -> Response:
        try:
            body = await parse_body(http, ClaudeCountRequest)
            chat = checked_images(node, to_chat_request(body.as_request()))  # as /v1/messages would send it
            counted = await count_chat_tokens(node, body.model, chat.messages, chat.tool_specs(),
                                              chat.template_kwargs())
            check_context(node, body.model, counted)
            return JSONResponse({"input_tokens": counted})
        except ApiError as exc:
            return claude_error(exc)

    return router
