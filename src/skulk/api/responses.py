"""OpenAI's other text APIs: POST /v1/completions (legacy text completion) and the route of POST /v1/responses
(Responses API, built in api/responses_api.py). Errors are OpenAI's shape, raised as ApiError like the chat route's."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from skulk.api import sse
from skulk.api.chat_session import ChatSession, start_chat
from skulk.api.disconnect import Stream, unless_disconnected
from skulk.api.generation import Finished, GenerationFailed, collect, piece_batches
from skulk.api.openapi import documented
from skulk.api.response_peers import ClusterResponses, internal_router
from skulk.api.responses_api import respond, start_response_stream
from skulk.api.services import ApiServices
from skulk.types.answers import ResponseAnswer, ResponseDeleted, TextCompletionAnswer
from skulk.types.chat import ChatCompletionRequest, ChatMessage
from skulk.types.chunks import TokenLogprob
from skulk.types.errors import ApiError, ErrorCode, error_body
from skulk.types.responses import CompletionRequest, ResponsesRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ------------------------------------------------------------------------------------------ /v1/completions


def completion_to_chat(body: CompletionRequest) -> ChatCompletionRequest:
    if (why := body.unsupported()) is not None:
        raise ApiError(ErrorCode.unsupported_field, why)
    if isinstance(body.prompt, list) and len(body.prompt) != 1:
        raise ApiError(ErrorCode.invalid_request,
                       "prompt: one prompt per request (a list of exactly one string); send the others "
                       "as separate requests")
    if body.echo or (body.n is not None and body.n != 1):
        raise ApiError(ErrorCode.invalid_request, "echo and n other than 1 are not supported; drop them")
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    return ChatCompletionRequest(
        model=body.model, messages=[ChatMessage(role="user", content=prompt)], max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop, stream=body.stream,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs,
    )


def legacy_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' logprobs: parallel lists, top alternatives as {token text: logprob}, and each
    token's character offset in the completion text (from `offset`, where earlier chunks of a stream ended)."""
    offsets: list[int] = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
            "text_offset": offsets}


def _text_choice(text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}


async def _completion_events(session: ChatSession, body: CompletionRequest) -> AsyncIterator[str]:
    """One chunk per token, the usage after the last when asked, then [DONE]; the events of the tokens waiting
    together go out in one write (api/generation.py's `piece_batches`), the same bytes as one by one."""
    head = {"id": f"cmpl-{session.command_id}", "object": "text_completion", "created": int(time.time()),
            "model": body.model}
    usage = body.stream_options is not None and body.stream_options.include_usage
    offset, done = 0, False
    try:
        async for batch in piece_batches(session, split=False):  # a text completion has no place for reasoning
            out: list[str] = []
            for piece in batch:
                chunk, logprobs = piece.chunk, None
                if chunk.logprobs is not None:
                    logprobs = legacy_logprobs([chunk.logprobs], offset)
                    offset += len(chunk.logprobs.token)
                out.append(sse.data({**head, "choices": [_text_choice(chunk.text, chunk.finish_reason, logprobs)]}))
                if chunk.finish_reason is not None:  # the last chunk (ChatSession.chunks): [DONE] goes with it
                    if usage:
                        out.append(sse.data({**head, "choices": [],
                                             "usage": _usage(chunk.prompt_tokens, chunk.completion_tokens)}))
                    out.append(sse.DONE)
                    done = True
            yield "".join(out)
    except GenerationFailed as failed:
        c = failed.chunk
        yield sse.data(error_body(c.message, kind="server_error", code=c.code, retryable=c.retryable)) + sse.DONE
        return
    if not done:
        yield sse.DONE


async def _completion(node: ApiServices, body: CompletionRequest) -> JSONResponse:
    session = await start_chat(node, completion_to_chat(body))
    done = await _collect_or_raise(session)
    return JSONResponse({"id": f"cmpl-{session.command_id}", "object": "text_completion", "created": int(time.time()),
                         "model": body.model, "choices": [_text_choice(
                             done.text, done.finish_reason,
                             legacy_logprobs(done.logprobs) if body.logprobs is not None else None)],
                         "usage": _usage(done.prompt_tokens, done.completion_tokens)})


async def _collect_or_raise(session: ChatSession) -> Finished:
    try:
        return await collect(session, split=False)  # a text completion has no place for reasoning
    except GenerationFailed as failed:
        raise ApiError(failed.chunk.code, failed.chunk.message, status=max(failed.chunk.status, 500),
                       retryable=failed.chunk.retryable) from failed


async def _response(node: ApiServices, body: ResponsesRequest, store: ClusterResponses) -> JSONResponse:
    return JSONResponse(await respond(node, body, store))


def responses_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["openai"])
    store = ClusterResponses(node)
    router.include_router(internal_router(store))

    @router.post("/v1/completions", response_model=None,
                 responses=documented(TextCompletionAnswer, 400, 404, 422, 500, 503, 504, stream="sse"))
    async def completions(body: CompletionRequest, http: Request) -> Response:
        if not body.stream:
            return await unless_disconnected(http, _completion(node, body))
        session = await start_chat(node, completion_to_chat(body))
        return Stream(_completion_events(session, body), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @router.post("/v1/responses", response_model=None,
                 responses=documented(ResponseAnswer, 400, 404, 422, 500, 503, 504, stream="sse"))
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        if not body.stream:
            return await unless_disconnected(http, _response(node, body, store))
        return Stream(await start_response_stream(node, body, store), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @router.get("/v1/responses/{response_id}", response_model=None, responses=documented(ResponseAnswer, 404))
    async def retrieve(response_id: str) -> Response:
        """A stored response, as it was answered (api/response_store.py says which are kept, and how long)."""
        return Response((await store.require(response_id)).response, media_type="application/json")

    @router.delete("/v1/responses/{response_id}", response_model=None, responses=documented(ResponseDeleted, 404))
    async def delete(response_id: str) -> dict[str, Any]:
        await store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
