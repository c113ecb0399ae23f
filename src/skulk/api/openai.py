"""OpenAI-compatible endpoints: /v1/chat/completions (SSE or JSON), /bench/chat/completions, /v1/models."""

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
from skulk.api.handle import NodeHandle
from skulk.models.cards import all_cards
from skulk.types.chat import ChatCompletionRequest
from skulk.types.chunks import ErrorChunk, TokenChunk


def _usage(chunk: TokenChunk) -> dict[str, int]:
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def generation_stats_comment(chunk: TokenChunk | None) -> str:
    """Skulk's `: generation_stats {...}` SSE comment (clients that do not know it skip comments)."""
    if chunk is None or chunk.stats is None:
        return ""
    return f": generation_stats {chunk.stats.generation.model_dump_json()}\n\n"


def require_one_choice(request: ChatCompletionRequest) -> None:
    if request.n is not None and request.n != 1:
        raise ApiError(400, f"n: only n=1 is supported (one choice per request), got {request.n}; "
                       "send n separate requests instead", code="invalid_request")


async def _stream_events(session: ChatSession, request: ChatCompletionRequest) -> AsyncIterator[str]:
    head = {
        "id": f"chatcmpl-{session.command_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
    }
    head["model"] = request.model
    role_sent = False
    last: TokenChunk | None = None
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            yield _sse(
                error_body(chunk.message, kind="server_error", code=chunk.code, retryable=chunk.retryable)
            )
            break
        last = chunk
        if not chunk.text and role_sent:
            continue
        delta: dict[str, str] = {"content": chunk.text}
        if not role_sent:
            delta["role"], role_sent = "assistant", True
        yield _sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    if last is not None and last.finish_reason is not None:
        yield _sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": last.finish_reason}]})
        if request.stream_options is not None and request.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(last)})
    yield generation_stats_comment(last)
    yield "data: [DONE]\n\n"


async def _complete(session: ChatSession, request: ChatCompletionRequest, *, bench: bool = False) -> JSONResponse:
    parts: list[str] = []
    last: TokenChunk | None = None
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            return JSONResponse(
                error_body(chunk.message, kind="server_error", code=chunk.code, retryable=chunk.retryable),
                status_code=chunk.status if chunk.status >= 500 else 500,
            )
        parts.append(chunk.text)
        last = chunk
    assert last is not None
    body: dict[str, Any] = {}
    if bench:
        stats = last.stats
        body = {
            "generation_stats": stats.generation.model_dump(mode="json") if stats else None,
            "serving_batches": stats.serving_batches if stats else None,
            "in_flight_at_admission": stats.in_flight_at_admission if stats else None,
        }
    return JSONResponse(
        {
            **body,
            "id": f"chatcmpl-{session.command_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(parts)},
                    "logprobs": None,
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": _usage(last),
        }
    )


def openai_router(node: NodeHandle) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        require_one_choice(body)
        if body.stream:
            session = await start_chat(node, body)
            return StreamingResponse(
                _stream_events(session, body),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await unless_disconnected(http, _start_and_complete(body))

    @router.post("/bench/chat/completions", response_model=None)
    async def bench_chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """Skulk's benchmarking route: never streamed; the reply carries the runner's generation_stats."""
        require_one_choice(body)
        return await unless_disconnected(http, _start_and_complete(body.model_copy(update={"stream": False}), True))

    async def _start_and_complete(body: ChatCompletionRequest, bench: bool = False) -> JSONResponse:
        return await _complete(await start_chat(node, body), body, bench=bench)

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": card.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": card.model_id.split("/")[0],
                }
                for card in all_cards()
            ],
        }

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        for card in all_cards():
            if card.model_id == model_id:
                return {
                    "id": card.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": model_id.split("/")[0],
                }
        raise ApiError(404, f"model {model_id} is not known; GET /v1/models lists the known ones")

    return router
