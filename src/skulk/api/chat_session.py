"""One chat request's life on the API node: send the command, read its chunks, cancel if abandoned."""

from __future__ import annotations

from collections.abc import AsyncIterator

from skulk.api.handle import NodeHandle
from skulk.api.model_kinds import refuse_embedding_model
from skulk.api.security import OWNERS
from skulk.cluster.dataplane import ChunkStream
from skulk.master.decide import failed_for_good, instance_failed_message
from skulk.models.cards import get_card
from skulk.types.chat import ChatCompletionRequest
from skulk.types.chunks import Chunk, EmbeddingChunk, ErrorChunk, TokenChunk
from skulk.types.commands import CancelCommand, StartChatCompletion
from skulk.types.errors import VALIDATION_STATUS, ApiError, ErrorCode
from skulk.types.ids import CommandId, ModelId, new_id
from skulk.types.tasks import ChatCompletionTaskParams

FIRST_CHUNK_TIMEOUT_S = 120.0
NEXT_CHUNK_TIMEOUT_S = 300.0


class ChatSession:
    def __init__(self, node: NodeHandle, stream: ChunkStream, first: TokenChunk) -> None:
        self.node = node
        self.stream = stream
        self.first = first
        self.finished = False

    @property
    def command_id(self) -> CommandId:
        return self.stream.command_id

    async def chunks(self) -> AsyncIterator[TokenChunk | ErrorChunk]:
        """Token chunks up to the one with a finish_reason, or one ErrorChunk. Always closes the stream."""
        try:
            chunk: TokenChunk | ErrorChunk = self.first
            while True:
                yield chunk
                if isinstance(chunk, ErrorChunk) or chunk.finish_reason is not None:
                    self.finished = True
                    return
                try:
                    chunk = text_chunk(await self.stream.next(NEXT_CHUNK_TIMEOUT_S))
                except TimeoutError:
                    chunk = ErrorChunk(
                        command_id=self.command_id,
                        message=f"no token for {NEXT_CHUNK_TIMEOUT_S:.0f} s; retry the request",
                        code=ErrorCode.timeout,
                    )
        finally:
            self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.node.send_command(
                CancelCommand(command_id=CommandId(new_id()), target_command_id=self.command_id)
            )
        self.node.close_stream(self.stream)


def text_chunk(chunk: Chunk) -> TokenChunk | ErrorChunk:
    """A chat reads text: vectors on its key (a runner that embedded instead) end it as an error."""
    if isinstance(chunk, EmbeddingChunk):
        return ErrorChunk(command_id=chunk.command_id, message="the instance answered with embeddings, not text",
                          code=ErrorCode.internal_error)
    return chunk


def require_instance(node: NodeHandle, model: str) -> None:
    """404 without an instance; 503 at once when every instance of the model failed for good (it would
    otherwise wait FIRST_CHUNK_TIMEOUT_S for a runner that is not coming back)."""
    state = node.state
    instances = [i for i in state.instances.values() if i.model_id == model]
    if not instances:
        raise ApiError(ErrorCode.model_not_found, f"No instance found for model {model}")
    failed = [(i.instance_id, failed_for_good(state, i.instance_id)) for i in instances]
    if all(why is not None for _, why in failed):
        instance_id, why = failed[0]
        assert why is not None
        raise ApiError(ErrorCode.instance_failed, instance_failed_message(instance_id, why))


def check_top_k(node: NodeHandle, request: ChatCompletionRequest) -> None:
    """top_k is bounded by the model's vocabulary where its card knows it (422, like every other bound)."""
    card = get_card(request.model) or node.state.model_cards.get(ModelId(request.model))
    vocab = card.vocab_size if card is not None else None
    if vocab is not None and request.top_k is not None and request.top_k > vocab:
        raise ApiError(ErrorCode.invalid_request,
                       f"top_k: top_k must be an integer in 0...{vocab} (the vocabulary of {request.model}; 0 = off), "
                       f"got {request.top_k}", status=VALIDATION_STATUS)


async def start_chat(node: NodeHandle, request: ChatCompletionRequest) -> ChatSession:
    """Raises ApiError with the runner's status (e.g. 400 context_length_exceeded) before anything streams."""
    refuse_embedding_model(node, request.model)
    require_instance(node, request.model)
    check_top_k(node, request)
    command_id = CommandId(new_id())
    OWNERS.claim(command_id)  # only this key (or an admin) may cancel it by id
    stream = node.open_stream(command_id)
    params = ChatCompletionTaskParams(model=ModelId(request.model), messages=request.messages,
                                      sampling=request.sampling(), tools=request.tool_specs())
    node.offer_payload(command_id, params)  # the prompt stays here; runners fetch it point to point
    node.send_command(StartChatCompletion(command_id=command_id, model=ModelId(request.model),
                                          origin_node_id=node.node_id))
    try:
        first = text_chunk(await stream.next(FIRST_CHUNK_TIMEOUT_S))
    except TimeoutError:
        first = ErrorChunk(
            command_id=command_id,
            message=f"the instance for {request.model} produced nothing in {FIRST_CHUNK_TIMEOUT_S:.0f} s; "
            "it may still be loading, retry shortly",
            code=ErrorCode.instance_not_ready,
        )
    except BaseException:
        _abandon(node, stream)
        raise
    if isinstance(first, ErrorChunk):
        _abandon(node, stream)
        raise ApiError(first.code, first.message, status=first.status)
    return ChatSession(node, stream, first)


def _abandon(node: NodeHandle, stream: ChunkStream) -> None:
    node.send_command(CancelCommand(command_id=CommandId(new_id()), target_command_id=stream.command_id))
    node.close_stream(stream)
