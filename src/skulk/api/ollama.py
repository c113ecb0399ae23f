"""Ollama's API under /ollama, as Skulk mounts it: /api/chat and /api/generate (NDJSON or one JSON object),
/api/tags, /api/show, /api/ps, /api/version, /api/embed and the legacy /api/embeddings (api/embeddings.py),
/api/pull (api/ollama_pull.py). Errors are Ollama's
`{"error": "..."}` with the HTTP status."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from skulk import __version__
from skulk.api.chat_options import tool_family
from skulk.api.chat_session import ChatSession, start_chat
from skulk.api.claude import parse_body
from skulk.api.disconnect import Stream, unless_disconnected
from skulk.api.embeddings import embed_for_ollama, legacy_embedding_for_ollama
from skulk.api.errors import ollama_error
from skulk.api.generation import Finished, GenerationFailed, Piece, collect, piece_batches
from skulk.api.model_facts import digest, modified, parameter_count, parameter_size, rfc3339
from skulk.api.ollama_pull import OllamaPullRequest, pull
from skulk.api.ollama_show import capabilities, file_facts, template
from skulk.api.openapi import Family, documented
from skulk.api.services import ApiServices
from skulk.api.tool_calls import ToolCallStream, ToolSpec, parse_tool_calls
from skulk.models.cards import all_cards
from skulk.state.queries import card_of, served_context
from skulk.types.answers import (
    OllamaEmbeddings,
    OllamaLegacyEmbedding,
    OllamaPullStatus,
    OllamaReply,
    OllamaShow,
    OllamaTags,
    OllamaVersion,
)
from skulk.types.chat import ChatCompletionRequest, ResponseFormat, ToolCall
from skulk.types.chunks import RequestStats, TokenLogprob
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.models import ModelCard
from skulk.types.ollama import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest, think_kwargs

NEVER = "9999-12-31T23:59:59Z"
"""A placed instance stays until it is deleted: Ollama's keep-alive never runs out."""
Body = OllamaChatRequest | OllamaGenerateRequest
Shape = Callable[[str, str], dict[str, Any]]
"""Puts a piece of text and of thinking where the endpoint carries them: chat's `message.content` and
`message.thinking`, generate's `response` and `thinking` (the thinking only when there is some)."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def to_chat_request(body: Body, stream: bool) -> ChatCompletionRequest:
    if (why := body.unsupported()) is not None:
        raise ApiError(ErrorCode.unsupported_field, why)
    o = body.options
    tools = body.tools if isinstance(body, OllamaChatRequest) else None
    enable_thinking, effort = think_kwargs(body.think)
    return ChatCompletionRequest(
        enable_thinking=enable_thinking, reasoning_effort=effort,
        model=body.model, messages=body.chat_messages(), max_tokens=o.num_predict, temperature=o.temperature,
        top_p=o.top_p, top_k=o.top_k, seed=o.seed, stop=o.stop or None, stream=stream, tools=tools,
        logprobs=body.logprobs, top_logprobs=body.top_logprobs if body.logprobs else None,
        response_format=_response_format(body.format), reasoning_budget=o.reasoning_budget,
    )


def _response_format(fmt: str | dict[str, Any] | None) -> ResponseFormat | None:
    """Ollama's `format`: "json" for any JSON, or a JSON schema; both constrain decoding as OpenAI's do."""
    if fmt == "json":
        return ResponseFormat(type="json_object")
    if isinstance(fmt, dict):
        try:
            return ResponseFormat(type="json_schema", json_schema={"name": "ollama_format", "schema": fmt})
        except ValueError as exc:
            raise ApiError(ErrorCode.invalid_request,
                           f"format: {exc}") from exc
    return None


def _ollama_calls(calls: list[ToolCall], start: int = 0) -> list[dict[str, Any]]:
    """Ollama writes a call's arguments as an object; `index` is the call's place in the reply (from `start`)."""
    return [{"function": {"index": i, "name": c.function.name, "arguments": _object(c.function.arguments)}}
            for i, c in enumerate(calls, start)]


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def _chat_shape(text: str, thinking: str = "") -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}}


def _generate_shape(text: str, thinking: str = "") -> dict[str, Any]:
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def _timings(stats: RequestStats | None, prompt: int, generated: int, total_ns: int) -> dict[str, Any]:
    """Ollama's counts and nanosecond durations, from the runner's measurements where it sent them. The model is
    loaded before any request (load 0), and the parts never add up to more than the request's own wall time
    (`total_ns`, from before the request was sent): a rate measured on the runner is cut to what it can be."""
    g = stats.generation if stats is not None else None
    prompt_ns = int(prompt / g.prompt_tps * 1e9) if g and g.prompt_tps > 0 else 0
    eval_ns = int((generated - 1) / g.generation_tps * 1e9) if g and g.generation_tps > 0 else 0
    prompt_ns = min(prompt_ns, total_ns)
    eval_ns = min(eval_ns, total_ns - prompt_ns)
    return {"total_duration": total_ns, "load_duration": 0, "prompt_eval_count": prompt,
            "prompt_eval_duration": prompt_ns, "eval_count": generated, "eval_duration": eval_ns}


def _final(model: str, shape: Shape, done: Finished, calls: list[ToolCall] | None = None, start: int = 0
           ) -> dict[str, Any]:
    line = {"model": model, "created_at": _now(), **shape(done.text, done.reasoning), "done": True,
            "done_reason": done.finish_reason,
            **_timings(done.stats, done.prompt_tokens, done.completion_tokens, done.total_ns)}
    if calls:
        line["message"]["tool_calls"] = _ollama_calls(calls, start)
    if done.logprobs:
        line["logprobs"] = _logprobs(done.logprobs)
    return line


def _logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Ollama's `logprobs`: OpenAI's per-token entries (token, logprob, bytes, top_logprobs)."""
    return [e.model_dump(mode="json") for e in entries]


def _line(fields: dict[str, Any]) -> str:
    return json.dumps(fields, separators=(",", ":")) + "\n"


async def _ndjson(session: ChatSession, model: str, shape: Shape, family: ToolSpec | None, started: float
                  ) -> AsyncIterator[str]:
    """One line per piece of text, then the `done` line, which carries no text of its own (as Ollama's: a client
    that appends every line's content must not see the last piece twice) but the counts and the tool calls still
    held. A call goes out in the line of the piece that closed it (/api/chat: `message.tool_calls`). The lines of
    the pieces waiting together go out in one write (api/generation.py's `piece_batches`)."""
    held = ToolCallStream(family) if family is not None else None
    try:
        async for batch in piece_batches(session):
            yield "".join([line for piece in batch for line in _piece_lines(session, piece, model, shape, held,
                                                                             started)])
    except GenerationFailed as failed:
        yield json.dumps({"error": failed.chunk.message}) + "\n"


def _piece_lines(session: ChatSession, piece: Piece, model: str, shape: Shape, held: ToolCallStream | None,
                 started: float) -> list[str]:
    """A piece's line (when it has text, reasoning, logprobs or a call that closed), and the `done` line after
    the last piece."""
    chunk = piece.chunk
    lines: list[str] = []
    text = held.push(piece.text) if held is not None else piece.text
    logprobs = [chunk.logprobs] if chunk.logprobs is not None else []
    taken = held.take(session.command_id) if held is not None else []  # each call once its text closed
    calls: list[ToolCall] = []
    if chunk.finish_reason is not None and held is not None:
        tail, calls = held.finish(session.command_id)
        text += tail if not calls else ""
    if text or piece.reasoning or logprobs or taken:
        line = {"model": model, "created_at": _now(), **shape(text, piece.reasoning), "done": False}
        if taken and held is not None and "message" in line:
            line["message"]["tool_calls"] = _ollama_calls(taken, len(held.sent) - len(taken))
        if logprobs:
            line["logprobs"] = _logprobs(logprobs)
        lines.append(_line(line))
    if chunk.finish_reason is not None:
        done = Finished("", chunk.finish_reason, chunk.prompt_tokens, chunk.completion_tokens, chunk.stats,
                        started)
        lines.append(_line(_final(model, shape, done, calls, len(held.sent) if held else 0)))
    return lines


async def _complete(node: ApiServices, body: Body, shape: Shape) -> JSONResponse:
    started = time.monotonic()
    chat = to_chat_request(body, False)
    session = await start_chat(node, chat)
    family = tool_family(node, chat)
    try:
        done = await collect(session)
        done.started = started
        calls: list[ToolCall] = []
        if family is not None:
            done.text, calls = parse_tool_calls(family, done.text, session.command_id)
        return JSONResponse(_final(body.model, shape, done, calls))
    except GenerationFailed as failed:
        return JSONResponse({"error": failed.chunk.message}, status_code=max(failed.chunk.status, 500))


async def _generate(node: ApiServices, http: Request, kind: type[Body], shape: Shape) -> Response:
    try:
        body = await parse_body(http, kind)
        if not body.stream:
            return await unless_disconnected(http, _complete(node, body, shape))
        started = time.monotonic()
        chat = to_chat_request(body, True)
        session = await start_chat(node, chat)
    except ApiError as exc:
        return ollama_error(exc)
    return Stream(_ndjson(session, body.model, shape, tool_family(node, chat), started),
                             media_type="application/x-ndjson")


def _details(node: ApiServices, card: ModelCard) -> dict[str, Any]:
    return {"parent_model": "", **file_facts(node, card), "family": card.family,
            "families": [card.family], "parameter_size": parameter_size(parameter_count(node, card))}


def _tag(node: ApiServices, card: ModelCard) -> dict[str, Any]:
    return {"name": card.model_id, "model": card.model_id, "modified_at": rfc3339(modified(node, card)),
            "size": card.storage_size.in_bytes, "digest": digest(card).removeprefix("sha256:"),
            "details": _details(node, card)}


def _available(node: ApiServices) -> list[ModelCard]:
    """Models this cluster can answer for now or has on disk: placed ones, and completed downloads."""
    state = node.state
    wanted = {i.model_id for i in state.instances.values()}
    wanted |= {m for per_node in state.downloads.values() for m, d in per_node.items() if d.status == "Completed"}
    cards = {c.model_id: c for c in [*all_cards(), *state.model_cards.values()]}
    return [cards[m] for m in sorted(wanted) if m in cards]


def ollama_router(node: ApiServices) -> APIRouter:
    router = APIRouter(prefix="/ollama", tags=["ollama"])

    @router.post("/api/chat", response_model=None,
                 responses=documented(OllamaReply, 400, 404, 422, 500, 503, 504, family=Family.ollama, stream="ndjson"))
    async def chat(http: Request) -> Response:
        return await _generate(node, http, OllamaChatRequest, _chat_shape)

    @router.post("/api/generate", response_model=None,
                 responses=documented(OllamaReply, 400, 404, 422, 500, 503, 504, family=Family.ollama, stream="ndjson"))
    async def generate(http: Request) -> Response:
        return await _generate(node, http, OllamaGenerateRequest, _generate_shape)

    @router.post("/api/embed", response_model=None,
                 responses=documented(OllamaEmbeddings, 400, 404, 422, 500, 503, 504, family=Family.ollama))
    async def embed(http: Request) -> Response:
        return await embed_for_ollama(node, http)

    @router.post("/api/embeddings", response_model=None,
                 responses=documented(OllamaLegacyEmbedding, 400, 404, 422, 500, 503, 504, family=Family.ollama))
    async def embeddings(http: Request) -> Response:
        return await legacy_embedding_for_ollama(node, http)

    @router.post("/api/pull", response_model=None,
                 responses=documented(OllamaPullStatus, 400, 404, 422, 502, 503, 507, family=Family.ollama,
                                      stream="ndjson"))
    async def pull_route(http: Request) -> Response:
        try:
            return await pull(node, await parse_body(http, OllamaPullRequest))
        except ApiError as exc:
            return ollama_error(exc)

    @router.get("/api/tags", response_model=None, responses=documented(OllamaTags))
    async def tags() -> dict[str, Any]:
        return {"models": [_tag(node, card) for card in _available(node)]}

    @router.post("/api/show", response_model=None,
                 responses=documented(OllamaShow, 400, 404, 422, family=Family.ollama))
    async def show(http: Request) -> Response:
        try:
            body = await parse_body(http, OllamaShowRequest)
            name = body.model or body.name
            if not name:
                raise ApiError(ErrorCode.invalid_request,
                               "model is required (the model id, as GET /ollama/api/tags lists it)")
            card = card_of(node.state, name)
            if card is None:
                raise ApiError(ErrorCode.model_not_found,
                               f"model '{name}' not found; GET /ollama/api/tags lists the models")
        except ApiError as exc:
            return ollama_error(exc)
        info = {"general.architecture": card.family, "general.parameter_count": parameter_count(node, card),
                f"{card.family}.context_length": served_context(node.state, card),
                f"{card.family}.block_count": card.n_layers,
                f"{card.family}.embedding_length": card.hidden_size}
        return JSONResponse({"modelfile": f"FROM {card.model_id}", "parameters": "",
                             "template": await template(node, card), "details": _details(node, card),
                             "model_info": info, "capabilities": await capabilities(node, card),
                             "modified_at": rfc3339(modified(node, card))})

    @router.get("/api/ps", response_model=None, responses=documented(OllamaTags))
    async def ps() -> dict[str, Any]:
        placed = {i.model_id for i in node.state.instances.values()}
        return {"models": [{**_tag(node, c), "expires_at": NEVER, "size_vram": 0,
                            "context_length": served_context(node.state, c)}
                           for c in _available(node) if c.model_id in placed]}

    @router.get("/api/version", response_model=None, responses=documented(OllamaVersion))
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return router
