"""One chat request on the API node: vet it, start it through Requests, read its text, cancel it if abandoned."""

from __future__ import annotations

from collections.abc import AsyncIterator

from skulk.api.chat_options import forced_tool, tool_family
from skulk.api.images import checked_images
from skulk.api.model_facts import not_served
from skulk.api.model_kinds import refuse_embedding_model
from skulk.api.patience import next_chunk
from skulk.api.requests import Silent, WrongKind, stream_error
from skulk.api.schema_check import check_output_schema
from skulk.api.security import OWNERS
from skulk.api.services import ApiServices
from skulk.api.serving_metrics import Generation, instance_of
from skulk.cluster.dataplane import ChunkStream
from skulk.master.decide import failed_for_good, instance_failed_message
from skulk.state.queries import card_of, served_context
from skulk.types.chat import ChatCompletionRequest
from skulk.types.chunks import Chunk, EmbeddingChunk, ErrorChunk, TokenChunk
from skulk.types.commands import StartChatCompletion
from skulk.types.errors import VALIDATION_STATUS, ApiError, ErrorCode
from skulk.types.ids import CommandId, ModelId, new_id
from skulk.types.tasks import ChatCompletionTaskParams


class ChatSession:
    def __init__(self, node: ApiServices, stream: ChunkStream, first: TokenChunk, model: str,
                 generation: Generation) -> None:
        self.node = node
        self.stream = stream
        self.first = first
        self.model = model
        self.generation = generation
        """The request's metrics record (api/serving_metrics.py): one int added per token, observed at its end."""
        self.finished = False
        self.reasoning_tokens = 0
        """Tokens of the reply spent reasoning (api/generation.py's `pieces` counts them)."""

    @property
    def command_id(self) -> CommandId:
        return self.stream.command_id

    async def chunks(self) -> AsyncIterator[TokenChunk | ErrorChunk]:
        """Token chunks up to the one with a finish_reason, or one ErrorChunk. Always closes the stream. The
        request is finished before its last chunk is yielded: a reader that stops there (generation.pieces, once
        the reply is whole) leaves this generator suspended, and its close must not cancel what completed."""
        generation = self.generation
        try:
            chunk: TokenChunk | ErrorChunk = self.first
            while True:
                if isinstance(chunk, ErrorChunk):
                    self.finished = True
                    generation.end("error", completion_tokens=generation.tokens - 1)  # this chunk was no token
                    yield chunk
                    return
                if chunk.finish_reason is not None:
                    self.finished = True
                    generation.end(chunk.finish_reason, chunk.prompt_tokens, chunk.completion_tokens)
                    yield chunk
                    return
                yield chunk
                waiting = self.stream.take_waiting()  # a fast stream's next chunk usually is: no wait to arm
                chunk = (await next_text(self.node, self.stream, self.model, first=False) if waiting is None
                         else _as_text(self.node, self.stream, waiting))
                generation.tokens += 1  # the per-token cost of the metrics: one int add
        finally:
            self.close()

    def ready(self) -> bool:
        """A chunk waits on the stream: reading it will not wait (api/generation.py's `piece_batches`)."""
        return self.stream.waiting > 0

    def close(self) -> None:
        if self.finished:
            self.node.requests.close(self.stream)
        else:
            self.finished = True
            self.generation.end("cancelled")
            self.node.requests.cancel(self.stream)


async def next_text(node: ApiServices, stream: ChunkStream, model: str, *, first: bool) -> TokenChunk | ErrorChunk:
    """The stream's next chunk as a chat reads it: text, or the error a silence or a chunk of vectors means."""
    chunk = await next_chunk(lambda: node.state, node.requests, stream, model, first=first)
    if isinstance(chunk, Silent):
        return _error(node, stream, chunk)
    return _as_text(node, stream, chunk)


def _as_text(node: ApiServices, stream: ChunkStream, chunk: Chunk) -> TokenChunk | ErrorChunk:
    """A chunk as a chat reads it: vectors where text was asked for end the stream."""
    if isinstance(chunk, EmbeddingChunk):
        return _error(node, stream, WrongKind(wanted="text"))
    return chunk


def _error(node: ApiServices, stream: ChunkStream, happening: Silent | WrongKind) -> ErrorChunk:
    error = stream_error(node.state, happening, stream.command_id)
    assert error is not None, "a silence or a wrong chunk always ends the stream"
    return error.chunk(stream.command_id)


def require_instance(node: ApiServices, model: str) -> None:
    """404 without an instance; 503 at once when every instance of the model failed for good (it would
    otherwise wait out its patience (api/patience.py) for a runner that is not coming back)."""
    state = node.state
    instances = [i for i in state.instances.values() if i.model_id == model]
    if not instances:
        raise ApiError(ErrorCode.model_not_found, not_served(node, model))
    failed = [(i.instance_id, failed_for_good(state, i.instance_id)) for i in instances]
    if all(why is not None for _, why in failed):
        instance_id, why = failed[0]
        assert why is not None
        raise ApiError(ErrorCode.instance_failed, instance_failed_message(instance_id, why))


def check_top_k(node: ApiServices, request: ChatCompletionRequest) -> None:
    """top_k is bounded by the model's vocabulary where its card knows it (422, like every other bound)."""
    card = card_of(node.state, request.model)
    vocab = card.vocab_size if card is not None else None
    if vocab is not None and request.top_k is not None and request.top_k > vocab:
        raise ApiError(ErrorCode.invalid_request,
                       f"top_k: top_k must be an integer in 0...{vocab} (the vocabulary of {request.model}; 0 = off), "
                       f"got {request.top_k}", status=VALIDATION_STATUS)


async def start_chat(node: ApiServices, request: ChatCompletionRequest) -> ChatSession:
    """Raises ApiError with the runner's status (e.g. 400 context_length_exceeded) before anything streams."""
    request = checked_images(node, request)  # text_only for a model without vision; a bad image's 400
    refuse_embedding_model(node, request.model)
    await check_output_schema(request)  # before admission: a 400 of its own, never an error mid-stream
    require_instance(node, request.model)
    check_top_k(node, request)
    command_id = CommandId(new_id())
    OWNERS.claim(command_id)  # only this key (or an admin) may cancel it by id
    card = card_of(node.state, request.model)
    params = ChatCompletionTaskParams(model=ModelId(request.model), messages=request.messages,
                                      sampling=request.sampling(), tools=request.tool_specs(),
                                      template_kwargs=request.template_kwargs(),
                                      context_limit=served_context(node.state, card) if card else None)
    generation = Generation(node.serving, request.model)  # admitted: the model is served (require_instance)
    stream = node.requests.open(command_id, params)  # the prompt stays here; runners fetch it point to point
    node.send_command(StartChatCompletion(command_id=command_id, model=ModelId(request.model),
                                          origin_node_id=node.node_id))
    try:
        first = await next_text(node, stream, request.model, first=True)
    except BaseException:
        generation.end("cancelled")
        node.requests.cancel(stream)
        raise
    if isinstance(first, ErrorChunk):
        generation.end("error")
        node.requests.cancel(stream)
        raise ApiError(first.code, first.message, status=first.status, retryable=first.retryable)
    generation.first(instance_of(node.state, command_id))
    return ChatSession(node, stream, harmony_call_split(node, request, first), request.model, generation)


def harmony_call_split(node: ApiServices, request: ChatCompletionRequest, first: TokenChunk) -> TokenChunk:
    """The first chunk, saying the reply splits as harmony's where it is a forced call in harmony's format: its
    grammar lets one analysis message through before the call (engines/constrained.py), and the runner reports
    no split for a constrained reply (runner/core.py's `_reasoning_mode`), which would leave that reasoning in the
    content. A reply with no analysis (the call alone) splits as before: no header, no reasoning."""
    if first.reasoning is not None or forced_tool(request) is None:
        return first
    family = tool_family(node, request)
    return first if family is None or family.parser != "harmony" else first.model_copy(update={"reasoning": "harmony"})
