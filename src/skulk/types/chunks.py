"""Data-plane messages: what the sampling rank publishes on `data/<command_id>` for the API node."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Tag

from .base import TaggedModel, tag_of
from .ids import CommandId


class TokenChunk(TaggedModel):
    command_id: CommandId
    text: str
    token_id: int
    finish_reason: Literal["stop", "length"] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ErrorChunk(TaggedModel):
    """The request ended in error. status is the HTTP status the API answers if nothing was streamed yet."""

    command_id: CommandId
    message: str
    code: str = "internal_error"
    status: int = 500
    retryable: bool = True


Chunk = Annotated[
    Annotated[TokenChunk, Tag("TokenChunk")] | Annotated[ErrorChunk, Tag("ErrorChunk")],
    Discriminator(tag_of),
]
