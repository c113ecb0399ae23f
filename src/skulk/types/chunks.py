"""Data-plane messages: what the sampling rank publishes on `data/<command_id>` for the API node."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag, model_validator

from .base import CamelModel, TaggedModel, tag_of
from .errors import ErrorCode
from .ids import CommandId
from .memory import Memory


class GenerationStats(CamelModel):
    """Engine-side throughput of one request, as Skulk reports it (snake_case keys on the wire, like Skulk's).

    prompt_tps counts the prompt over the time from admission to the first token (queueing for a slot
    included); generation_tps counts the tokens after the first over the time after it."""

    model_config = CamelModel.model_config | {"alias_generator": None}
    prompt_tps: float
    generation_tps: float
    prompt_tokens: int
    generation_tokens: int
    peak_memory_usage: Memory


class RequestStats(CamelModel):
    """What the runner measured for one request: Skulk's generation stats and how it was batched."""

    generation: GenerationStats
    in_flight_at_admission: int = 0
    """Other requests the runner was serving when this one was admitted."""
    serving_batches: int = 0
    """Engine steps (batched forwards) that produced this request's tokens."""


class TopLogprob(CamelModel):
    """One candidate token in OpenAI's logprobs shape: its text, log-probability and UTF-8 bytes."""

    model_config = CamelModel.model_config | {"alias_generator": None}
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """The emitted token's log-probability under the model, with the most likely alternatives (OpenAI's
    `logprobs.content[i]`); only on chunks of requests that asked for logprobs."""

    top_logprobs: list[TopLogprob] = []


class TokenChunk(TaggedModel):
    command_id: CommandId
    text: str
    token_id: int
    finish_reason: Literal["stop", "length"] | None = None
    stop_sequence: str | None = None
    """With finish_reason "stop": the request's stop string that ended it (None: the model's own end of turn)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: RequestStats | None = None
    """Only on the last chunk of a request."""
    logprobs: TokenLogprob | None = None
    """Only when the request asked for logprobs: one per token, even a token whose text is not out yet."""
    reasoning: Literal["think", "think_open", "harmony"] | None = None
    """Only on a request's first chunk: how its text splits into reasoning and content (engines/reasoning.py's
    ReasoningMode, decided by the runner from the chat template and the rendered prompt). None: no reasoning."""


class ErrorChunk(TaggedModel):
    """The request ended in error. status is the HTTP status the API answers if nothing was streamed yet."""

    command_id: CommandId
    message: str
    code: ErrorCode = ErrorCode.internal_error
    status: int = 500
    """The code's own status unless the sender chose another."""
    retryable: bool = True

    @model_validator(mode="before")
    @classmethod
    def _status_of_code(cls, data: Any) -> Any:
        if isinstance(data, dict) and "code" in data and "status" not in data:
            return {**data, "status": ErrorCode(data["code"]).status}
        return data


class EmbeddingChunk(TaggedModel):
    """The whole answer of an embedding request, in one message: `count` vectors of `dimension` float32s,
    row after row, little-endian, base64 (a fixed binary layout: a quarter of the JSON numbers' size, and
    exactly OpenAI's `encoding_format: base64` per row)."""

    command_id: CommandId
    count: int
    dimension: int
    vectors: str
    prompt_tokens: int
    """Tokens of every input together, specials included (OpenAI's usage.prompt_tokens)."""


Chunk = Annotated[
    Annotated[TokenChunk, Tag("TokenChunk")]
    | Annotated[ErrorChunk, Tag("ErrorChunk")]
    | Annotated[EmbeddingChunk, Tag("EmbeddingChunk")],
    Discriminator(tag_of),
]
