"""The one path every text API shares (OpenAI, Claude Messages, Ollama, Responses, legacy completions).

Each router turns its request into a ChatCompletionRequest, starts it with `start_chat` (errors before the first
token are ApiErrors, which each router writes in its own error shape), then reads `deltas` or `collect` and only
formats. The chunk loop and the cancel-on-abandon behaviour (ChatSession.close) live here once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from skulk.api.chat_session import ChatSession
from skulk.types.chunks import ErrorChunk, RequestStats, TokenChunk, TokenLogprob


class GenerationFailed(Exception):
    """The request ended in error after it started streaming (a lost node, a session change, an engine fault)."""

    def __init__(self, chunk: ErrorChunk) -> None:
        super().__init__(chunk.message)
        self.chunk = chunk


@dataclass(slots=True)
class Finished:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats | None
    started: float
    """time.monotonic() when the request was started, for APIs that report durations."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per generated token when the request asked for logprobs."""
    stop_sequence: str | None = None
    """The stop string that ended the reply, if one did (TokenChunk.stop_sequence)."""

    @property
    def total_ns(self) -> int:
        return int((time.monotonic() - self.started) * 1e9)


async def deltas(session: ChatSession) -> AsyncIterator[TokenChunk]:
    """Chunks that carry text or logprobs, and always the last one (its finish_reason and counts);
    GenerationFailed on error."""
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            raise GenerationFailed(chunk)
        if chunk.text or chunk.finish_reason is not None or chunk.logprobs is not None:
            yield chunk


async def collect(session: ChatSession) -> Finished:
    """The whole answer of a non-streaming request."""
    started = time.monotonic()
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    last: TokenChunk | None = None
    async for chunk in deltas(session):
        parts.append(chunk.text)
        if chunk.logprobs is not None:
            logprobs.append(chunk.logprobs)
        last = chunk
    assert last is not None and last.finish_reason is not None
    return Finished("".join(parts), last.finish_reason, last.prompt_tokens, last.completion_tokens, last.stats,
                    started, logprobs, last.stop_sequence)
