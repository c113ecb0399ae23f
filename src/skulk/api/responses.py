"""OpenAI's other text APIs: POST /v1/completions (legacy text completion) and POST /v1/responses (Responses API,
JSON or its typed SSE events). Errors are OpenAI's shape, raised as ApiError like the chat route's."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from skulk.api.chat_session import ChatSession, start_chat
from skulk.api.disconnect import unless_disconnected
from skulk.api.errors import ApiError, error_body
from skulk.api.generation import Finished, GenerationFailed, collect, deltas
from skulk.api.handle import NodeHandle
from skulk.types.chat import ChatCompletionRequest, ChatMessage
from skulk.types.responses import CompletionRequest, ResponsesRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ------------------------------------------------------------------------------------------ /v1/completions


def completion_to_chat(body: CompletionRequest) -> ChatCompletionRequest:
    if isinstance(body.prompt, list) and len(body.prompt) != 1:
        raise ApiError(400, "prompt: one prompt per request (a list of exactly one string); send the others "
                       "as separate requests", code="invalid_request")
    if body.echo or (body.n is not None and body.n != 1):
        raise ApiError(400, "echo and n other than 1 are not supported; drop them", code="invalid_request")
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    return ChatCompletionRequest(
        model=body.model, messages=[ChatMessage(role="user", content=prompt)], max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop, stream=body.stream,
    )


def _text_choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


async def _completion_events(session: ChatSession, body: CompletionRequest) -> AsyncIterator[str]:
    head = {"id": f"cmpl-{session.command_id}", "object": "text_completion", "created": int(time.time()),
            "model": body.model}
    try:
        async for chunk in deltas(session):
            yield _data({**head, "choices": [_text_choice(chunk.text, chunk.finish_reason)]})
            if chunk.finish_reason is not None and body.stream_options and body.stream_options.include_usage:
                yield _data({**head, "choices": [], "usage": _usage(chunk.prompt_tokens, chunk.completion_tokens)})
    except GenerationFailed as failed:
        c = failed.chunk
        yield _data(error_body(c.message, kind="server_error", code=c.code, retryable=c.retryable))
    yield "data: [DONE]\n\n"


async def _completion(node: NodeHandle, body: CompletionRequest) -> JSONResponse:
    session = await start_chat(node, completion_to_chat(body))
    done = await _collect_or_raise(session)
    return JSONResponse({"id": f"cmpl-{session.command_id}", "object": "text_completion", "created": int(time.time()),
                         "model": body.model, "choices": [_text_choice(done.text, done.finish_reason)],
                         "usage": _usage(done.prompt_tokens, done.completion_tokens)})


async def _collect_or_raise(session: ChatSession) -> Finished:
    try:
        return await collect(session)
    except GenerationFailed as failed:
        raise ApiError(max(failed.chunk.status, 500), failed.chunk.message, code=failed.chunk.code) from failed


# -------------------------------------------------------------------------------------------- /v1/responses


def responses_to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model=body.model, messages=body.chat_messages(), max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream,
    )


class _Response:
    """One Responses API response object as it grows: ids, the output message, status and usage."""

    def __init__(self, session: ChatSession, body: ResponsesRequest) -> None:
        self.id = f"resp_{session.command_id}"
        self.item_id = f"msg_{session.command_id}"
        self.body = body
        self.created = int(time.time())
        self.seq = 0

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def obj(self, status: str, text: str | None = None, done: Finished | None = None) -> dict[str, Any]:
        usage = None
        if done is not None:
            usage = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                     "total_tokens": done.prompt_tokens + done.completion_tokens,
                     "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} if done is not None and done.finish_reason == "length" else None
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "model": b.model,
                "status": "incomplete" if incomplete else status, "incomplete_details": incomplete, "error": None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "tools": [], "tool_choice": "auto",
                "parallel_tool_calls": False, "text": {"format": {"type": "text"}},
                "output": [] if text is None else [self.item(text, "completed")], "usage": usage}

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"


async def _response_events(session: ChatSession, r: _Response) -> AsyncIterator[str]:
    where = {"item_id": r.item_id, "output_index": 0, "content_index": 0}
    yield r.event("response.created", response=r.obj("in_progress"))
    yield r.event("response.in_progress", response=r.obj("in_progress"))
    yield r.event("response.output_item.added", output_index=0, item=r.item(None, "in_progress"))
    yield r.event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
    started, parts = time.monotonic(), []
    done = Finished("", "stop", 0, 0, None, started)
    try:
        async for chunk in deltas(session):
            if chunk.text:
                parts.append(chunk.text)
                yield r.event("response.output_text.delta", **where, delta=chunk.text, logprobs=[])
            if chunk.finish_reason is not None:
                done = Finished("".join(parts), chunk.finish_reason, chunk.prompt_tokens, chunk.completion_tokens,
                                chunk.stats, started)
    except GenerationFailed as failed:
        yield r.event("error", code=failed.chunk.code, message=failed.chunk.message, param=None)
        return
    text = done.text
    yield r.event("response.output_text.done", **where, text=text, logprobs=[])
    yield r.event("response.content_part.done", **where, part={"type": "output_text", "text": text, "annotations": []})
    yield r.event("response.output_item.done", output_index=0, item=r.item(text, "completed"))
    yield r.event("response.completed", response=r.obj("completed", text, done))


async def _response(node: NodeHandle, body: ResponsesRequest) -> JSONResponse:
    session = await start_chat(node, responses_to_chat(body))
    done = await _collect_or_raise(session)
    return JSONResponse(_Response(session, body).obj("completed", done.text, done))


def responses_router(node: NodeHandle) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        if not body.stream:
            return await unless_disconnected(http, _completion(node, body))
        session = await start_chat(node, completion_to_chat(body))
        return StreamingResponse(_completion_events(session, body), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @router.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        if not body.stream:
            return await unless_disconnected(http, _response(node, body))
        session = await start_chat(node, responses_to_chat(body))
        return StreamingResponse(_response_events(session, _Response(session, body)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    return router
