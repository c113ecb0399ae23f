"""Embeddings: OpenAI's `POST /v1/embeddings` here, Ollama's `/ollama/api/embed` through `embed_for_ollama`.

A request takes the path a chat takes, with its own command and task kind: the texts stay on this node (the
payload book) while `StartEmbedding` asks the master for a task on the least-loaded instance of the model; the
instance's runner fetches them, runs the encoder and answers with one `EmbeddingChunk` (float32 rows in
base64). Which model may do what is decided here, from its card, before anything is sent: a chat model asked
for embeddings and an embedding model asked to chat both get a 400 that names the models that can.

`dimensions`: MiniLM- and BGE-style encoders are not trained Matryoshka-style, so a truncated vector would be a
worse, silently different embedding. Only the model's own dimension is accepted; anything else is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from skulk.api.chat_session import require_instance
from skulk.api.claude import parse_body
from skulk.api.disconnect import unless_disconnected
from skulk.api.errors import ollama_error
from skulk.api.model_kinds import check_dimensions, embedding_card
from skulk.api.openapi import documented
from skulk.api.patience import next_chunk
from skulk.api.requests import Silent, WrongKind, stream_error
from skulk.api.security import OWNERS
from skulk.api.services import ApiServices
from skulk.cluster.dataplane import ChunkStream
from skulk.types.answers import EmbeddingList
from skulk.types.chunks import EmbeddingChunk, ErrorChunk, TokenChunk
from skulk.types.commands import StartEmbedding
from skulk.types.embeddings import EmbeddingRequest, OllamaEmbedRequest, OllamaLegacyEmbedRequest
from skulk.types.errors import ApiError, ErrorCode, error_body
from skulk.types.ids import CommandId, ModelId, new_id
from skulk.types.tasks import EmbeddingTaskParams


@dataclass(frozen=True, slots=True)
class Embedded:
    vectors: np.ndarray[Any, np.dtype[np.float32]]
    """[inputs, dimension], in input order."""
    prompt_tokens: int
    seconds: float


async def embed(node: ApiServices, model: str, inputs: list[str] | list[list[int]], *,
                truncate: bool = False) -> Embedded:
    """Run one embedding request on an instance of the model; ApiError with the runner's status otherwise."""
    require_instance(node, model)
    started = asyncio.get_running_loop().time()
    command_id = CommandId(new_id())
    OWNERS.claim(command_id)  # only this key (or an admin) may cancel it by id
    payload = EmbeddingTaskParams(model=ModelId(model), inputs=inputs, truncate=truncate)
    stream = node.requests.open(command_id, payload)
    answered = False
    try:
        node.send_command(StartEmbedding(command_id=command_id, model=ModelId(model), origin_node_id=node.node_id))
        chunk = await _first(node, stream, model)
        answered = True
        if isinstance(chunk, ErrorChunk):
            raise ApiError(chunk.code, chunk.message, status=chunk.status)
        return Embedded(unpack_vectors(chunk), chunk.prompt_tokens, asyncio.get_running_loop().time() - started)
    finally:
        if answered:
            node.requests.close(stream)
        else:  # timed out or the client went away: the task must not run on for nobody
            node.requests.cancel(stream)


async def _first(node: ApiServices, stream: ChunkStream, model: str) -> EmbeddingChunk | ErrorChunk:
    chunk = await next_chunk(lambda: node.state, node.requests, stream, model, first=True)
    if isinstance(chunk, Silent):
        happening: Silent | WrongKind = chunk
    elif not isinstance(chunk, TokenChunk):
        return chunk
    else:
        happening = WrongKind(wanted="vectors")
    error = stream_error(node.state, happening, stream.command_id)
    assert error is not None
    raise ApiError(error.code, error.message)


def unpack_vectors(chunk: EmbeddingChunk) -> np.ndarray[Any, np.dtype[np.float32]]:
    raw = base64.b64decode(chunk.vectors)
    if len(raw) != chunk.count * chunk.dimension * 4:
        raise ApiError(ErrorCode.internal_error,
                       "the runner sent a malformed embedding (size does not match its shape)")
    return np.frombuffer(raw, dtype="<f4").reshape(chunk.count, chunk.dimension)


def _openai_body(request: EmbeddingRequest, done: Embedded) -> dict[str, Any]:
    def encode(row: np.ndarray[Any, np.dtype[np.float32]]) -> list[float] | str:
        if request.encoding_format == "base64":
            return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        return row.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encode(row)} for i, row in enumerate(done.vectors)]
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}}


async def _openai(node: ApiServices, request: EmbeddingRequest) -> dict[str, Any]:
    check_dimensions(embedding_card(node, request.model), request.dimensions)
    return _openai_body(request, await embed(node, request.model, request.inputs()))


async def _ollama(node: ApiServices, body: OllamaEmbedRequest) -> Response:
    check_dimensions(embedding_card(node, body.model), body.dimensions)
    done = await embed(node, body.model, body.inputs(), truncate=body.truncate)
    return JSONResponse({"model": body.model, "embeddings": done.vectors.tolist(),
                         "total_duration": int(done.seconds * 1e9), "load_duration": 0,
                         "prompt_eval_count": done.prompt_tokens})


async def _ollama_legacy(node: ApiServices, body: OllamaLegacyEmbedRequest) -> Response:
    embedding_card(node, body.model)
    done = await embed(node, body.model, [body.prompt], truncate=True)
    return JSONResponse({"embedding": done.vectors[0].tolist()})


async def legacy_embedding_for_ollama(node: ApiServices, http: Request) -> Response:
    """Ollama's legacy /api/embeddings: `{"model", "prompt"}` in, `{"embedding": [...]}` out (Skulk's vectors are
    the same unit-length ones /api/embed returns)."""
    try:
        body = await parse_body(http, OllamaLegacyEmbedRequest)
        return await unless_disconnected(http, _ollama_legacy(node, body))
    except ApiError as exc:
        return ollama_error(exc)


async def embed_for_ollama(node: ApiServices, http: Request) -> Response:
    """Ollama's /api/embed: `{"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}`,
    errors as Ollama's `{"error": "..."}`."""
    try:
        body = await parse_body(http, OllamaEmbedRequest)  # the whole body first: then only a disconnect can come
        return await unless_disconnected(http, _ollama(node, body))
    except ApiError as exc:
        return ollama_error(exc)


def embeddings_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.post("/v1/embeddings", response_model=None,
                 responses=documented(EmbeddingList, 400, 404, 422, 500, 503, 504))
    async def embeddings(http: Request) -> Response | dict[str, Any]:
        try:
            request = await parse_body(http, EmbeddingRequest)  # the whole body first: then only a disconnect
            return await unless_disconnected(http, _openai(node, request))
        except ApiError as exc:
            return JSONResponse(error_body(exc.message, kind=exc.kind, code=exc.code), status_code=exc.status)

    return router
