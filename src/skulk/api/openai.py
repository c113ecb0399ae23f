"""OpenAI-compatible endpoints: /v1/chat/completions (SSE or JSON), /bench/chat/completions, /v1/models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
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
from skulk.api.errors import claude_error, openai_error
from skulk.api.generation import GenerationFailed, collect, piece_batches
from skulk.api.model_facts import modified, not_served, rfc3339, served_cards
from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.api.tool_calls import ToolCallStream, ToolSpec, openai_tool_calls, parse_tool_calls
from skulk.state.queries import served_context
from skulk.types.answers import ChatCompletionAnswer, ClaudeModel, ClaudeModelList, OpenAIModel, OpenAIModelList
from skulk.types.chat import ChatCompletionRequest, ToolCall
from skulk.types.chunks import RequestStats, TokenChunk, TokenLogprob
from skulk.types.errors import ApiError, ErrorCode, error_body
from skulk.types.models import ModelCard


def _context_fields(context: int) -> dict[str, int]:
    """The context the model's placed instances admit (state.queries.served_context), under the names clients
    read it by: OpenRouter's context_length and vLLM's max_model_len."""
    return {"context_length": context, "max_model_len": context}


def _usage(prompt: int, completion: int, reasoning: int = 0) -> dict[str, Any]:
    """OpenAI's usage; completion_tokens_details.reasoning_tokens counts the completion's reasoning tokens."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def generation_stats_comment(stats: RequestStats | None) -> str:
    """Our `: serving_stats {...}` SSE comment (how the runner batched the request: the bench route's
    in_flight_at_admission and serving_batches), then Skulk's `: generation_stats {...}`, kept the last line before
    `data: [DONE]` as Skulk writes it. Clients skip comments."""
    if stats is None:
        return ""
    serving = {"in_flight_at_admission": stats.in_flight_at_admission, "serving_batches": stats.serving_batches}
    return (sse.comment(f"serving_stats {sse.compact(serving)}")
            + sse.comment(f"generation_stats {stats.generation.model_dump_json()}"))


def _prepared(node: ApiServices, request: ChatCompletionRequest) -> tuple[ChatCompletionRequest, ToolSpec | None]:
    """The request as sent (refusals first, JSON and tool-choice instructions added) and the tool-call format to
    parse, if any."""
    check_supported(request)
    return prepared(request), tool_family(node, request)


def _logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's `choices[i].logprobs` (refusal is never produced here)."""
    return {"content": [e.model_dump(mode="json") for e in entries], "refusal": None}


def _tool_choice_error(why: str) -> dict[str, Any]:
    return error_body(why, kind="invalid_request_error", code=ErrorCode.tool_choice_unmet.value, retryable=False)


def _calls_chunk(head: dict[str, Any], calls: list[ToolCall], start: int) -> str:
    """One chunk whose delta carries whole tool calls, indexed from `start` (the calls sent before them)."""
    delta = {"tool_calls": openai_tool_calls(calls, start)}
    return sse.data({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def _chunk_prefix(head: dict[str, Any]) -> str:
    """The bytes every chunk of a reply starts with, up to its choice's delta: encoded once per reply."""
    return f'data: {sse.compact(head)[:-1]},"choices":[{{"index":0,"delta":'


def _token_event(prefix: str, text: str, reasoning: str, role: bool, logprobs: TokenLogprob | None) -> str:
    """One token's chunk, written as sse.data writes {**head, "choices": [{"index": 0, "delta": {...}, "logprobs":
    ..., "finish_reason": None}]} (the same bytes), without building and encoding the whole dict per token."""
    delta = '{"content":' + json.dumps(text)
    if reasoning:
        delta += ',"reasoning_content":' + json.dumps(reasoning)
    if role:
        delta += ',"role":"assistant"'
    encoded = "null" if logprobs is None else sse.compact(_logprobs([logprobs]))
    return f'{prefix}{delta}}},"logprobs":{encoded},"finish_reason":null}}]}}\n\n'


async def _stream_events(
    session: ChatSession, request: ChatCompletionRequest, family: ToolSpec | None
) -> AsyncIterator[str]:
    head = {
        "id": f"chatcmpl-{session.command_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.model,
    }
    prefix = _chunk_prefix(head)
    role_sent = False
    last: TokenChunk | None = None
    forced = forced_tool(request)
    held = ToolCallStream(family, hold_all=forced is not None) if family is not None else None
    try:
        async for batch in piece_batches(session):
            out: list[str] = []  # the batch's events, written at once (each still its own event)
            for piece in batch:
                chunk = last = piece.chunk
                text = held.push(piece.text) if held is not None else piece.text
                taken = held.take(session.command_id) if held is not None else []
                if text or piece.reasoning or not role_sent or chunk.logprobs is not None:
                    out.append(_token_event(prefix, text, piece.reasoning, not role_sent, chunk.logprobs))
                    role_sent = True
                if taken and held is not None:  # each call as soon as its text closed, numbered on over the reply
                    out.append(_calls_chunk(head, taken, len(held.sent) - len(taken)))
            if out:
                yield "".join(out)
    except GenerationFailed as failed:
        c = failed.chunk
        yield sse.data(error_body(c.message, kind="server_error", code=c.code, retryable=c.retryable)) + sse.DONE
        return
    assert last is not None and last.finish_reason is not None
    finish = last.finish_reason
    tail: list[str] = []  # the reply's last events, written at once
    if held is not None:
        text, calls = held.finish(session.command_id)
        unmet = unmet_tool_choice(forced, [*held.sent, *calls])
        if unmet is not None:
            yield sse.data(_tool_choice_error(unmet)) + sse.DONE
            return
        if text:
            tail.append(sse.data({**head, "choices": [{"index": 0, "delta": {"content": text},
                                                       "finish_reason": None}]}))
        if calls:
            tail.append(_calls_chunk(head, calls, len(held.sent)))
        finish = "tool_calls" if calls or held.sent else finish
    tail.append(sse.data({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    if request.stream_options is not None and request.stream_options.include_usage:
        tail.append(sse.data({**head, "choices": [], "usage": _usage(last.prompt_tokens, last.completion_tokens,
                                                                     session.reasoning_tokens)}))
    tail += [generation_stats_comment(last.stats), sse.DONE]
    yield "".join(tail)


def _bench_fields(stats: RequestStats | None) -> dict[str, Any]:
    """What POST /bench/chat/completions adds to a completion: the runner's measurements of the request."""
    return {
        "generation_stats": stats.generation.model_dump(mode="json") if stats else None,
        "serving_batches": stats.serving_batches if stats else None,
        "in_flight_at_admission": stats.in_flight_at_admission if stats else None,
    }


def _message(
    text: str, finish: str, family: ToolSpec | None, call_id: str, forced: str | None = None, reasoning: str = ""
) -> tuple[dict[str, Any], str]:
    message, finish = _answer(text, finish, family, call_id, forced)
    return ({**message, "reasoning_content": reasoning} if reasoning else message), finish


def _answer(
    text: str, finish: str, family: ToolSpec | None, call_id: str, forced: str | None = None
) -> tuple[dict[str, Any], str]:
    """The reply message and finish_reason, with tool calls parsed out of the text when tools were offered.
    ValueError (why) when a forced tool choice is not met."""
    if family is not None:
        content, calls = parse_tool_calls(family, text, call_id)
        unmet = unmet_tool_choice(forced, calls)
        if unmet is not None:
            raise ValueError(unmet)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": openai_tool_calls(calls)}, (
                "tool_calls"
            )
    return {"role": "assistant", "content": text}, finish


async def _complete(
    session: ChatSession, request: ChatCompletionRequest, family: ToolSpec | None = None, *, bench: bool = False
) -> JSONResponse:
    try:
        done = await collect(session)
    except GenerationFailed as failed:
        c = failed.chunk
        return JSONResponse(error_body(c.message, kind="server_error", code=c.code, retryable=c.retryable),
                            status_code=c.status if c.status >= 500 else 500)
    try:
        message, finish = _message(done.text, done.finish_reason, family, session.command_id, forced_tool(request),
                                   done.reasoning)
    except ValueError as unmet:
        return JSONResponse(_tool_choice_error(str(unmet)), status_code=UNMET_STATUS)
    return JSONResponse(
        {
            **(_bench_fields(done.stats) if bench else {}),
            "id": f"chatcmpl-{session.command_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": _logprobs(done.logprobs) if request.logprobs else None,
                    "finish_reason": finish,
                }
            ],
            "usage": _usage(done.prompt_tokens, done.completion_tokens, done.reasoning_tokens),
        }
    )


def _is_anthropic(http: Request) -> bool:
    return "anthropic-version" in http.headers


def _openai_model(node: ApiServices, card: ModelCard) -> dict[str, Any]:
    return {"id": card.model_id, "object": "model", "created": int(modified(node, card).timestamp()),
            "owned_by": card.model_id.split("/")[0], **_context_fields(served_context(node.state, card))}


def _claude_model(node: ApiServices, card: ModelCard) -> dict[str, Any]:
    """Anthropic's model object: `created_at` is when this node's copy of the files was written; `max_input_tokens`
    and `max_tokens` are the context the placed instances admit (the card's own while none is placed), which bounds
    the prompt and the reply alike (a prompt plus an explicit max_tokens beyond it is refused)."""
    context = served_context(node.state, card)
    return {"type": "model", "id": card.model_id, "display_name": card.model_id.rpartition("/")[2],
            "created_at": rfc3339(modified(node, card)), "max_input_tokens": context, "max_tokens": context}


def openai_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.post("/v1/chat/completions", response_model=None,
                 responses=documented(ChatCompletionAnswer, 400, 404, 422, 500, 503, 504, stream="sse"))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        body, family = _prepared(node, body)
        if body.stream:
            session = await start_chat(node, body)
            return Stream(
                _stream_events(session, body, family),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await unless_disconnected(http, _start_and_complete(body, family))

    @router.post("/bench/chat/completions", response_model=None,
                 responses=documented(ChatCompletionAnswer, 400, 404, 422, 500, 503, 504))
    async def bench_chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """Skulk's benchmarking route: never streamed; the reply carries the runner's generation_stats."""
        body, family = _prepared(node, body.model_copy(update={"stream": False}))
        return await unless_disconnected(http, _start_and_complete(body, family, True))

    async def _start_and_complete(
        body: ChatCompletionRequest, family: ToolSpec | None, bench: bool = False
    ) -> JSONResponse:
        return await _complete(await start_chat(node, body), body, family, bench=bench)

    @router.get("/v1/models", response_model=None, responses=documented(OpenAIModelList | ClaudeModelList))
    async def list_models(http: Request) -> dict[str, Any]:
        """The models being served (placed instances): what a client can call. The catalog, placed or not, is
        GET /models. Anthropic's SDKs (which send `anthropic-version`) get Anthropic's list shape."""
        cards = served_cards(node)
        if _is_anthropic(http):
            data = [_claude_model(node, card) for card in cards]
            return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None}
        return {"object": "list", "data": [_openai_model(node, card) for card in cards]}

    @router.get("/v1/models/{model_id:path}", response_model=None,
                responses=documented(OpenAIModel | ClaudeModel, 404))
    async def get_model(model_id: str, http: Request) -> Response | dict[str, Any]:
        card = next((c for c in served_cards(node) if c.model_id == model_id), None)
        if card is None:
            error = ApiError(ErrorCode.model_not_found, not_served(node, model_id))
            return claude_error(error) if _is_anthropic(http) else openai_error(error)
        return _claude_model(node, card) if _is_anthropic(http) else _openai_model(node, card)

    return router
